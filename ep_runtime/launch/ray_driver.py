"""Ray launcher: one placement group of N bundles, one rank actor per bundle, a supervised run.

Pattern: rank actors report (node, ip, gpu); ranks are ordered by (driver's node first, ip, gpu);
the driver hosts the TCPStore on port 0 (no free-port race): on loopback when every rank runs on
its node, else on its node's IP; no rank process holds it, so it outlives any rank (an elastic
run's survivors agree on their new group through it). NCCL on GPUs with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (Ray does not mask devices; each rank picks its
GPU itself), gloo on CPU. The driver issues one collective step at a time and watches every rank
with ``ray.wait``: the first failure kills every actor, removes the placement group and (for a
cluster it started) shuts Ray down; in an elastic run, the death of a rank named in
``--kill-rank`` (``RayActorError``) is expected instead, and the driver goes on driving the
others. On a run across nodes each rank binds gloo and NCCL to the interface holding its node's
IP unless its node says otherwise (``network``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ep_runtime.launch.network import NODE_LOCAL_VARIABLES
from ep_runtime.launch.progress import ProgressFactory, RunProgress
from ep_runtime.launch.rank import RankWorker, plan
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store
from ep_runtime.launch.spec import LaunchError, RankFailure, RunSpec, Step, resolve_device
from ep_runtime.launch.supervision import (
    Failure,
    FailureKind,
    classify_exception_text,
    install_stop_handlers,
    raise_if_stop_requested,
    root_failure,
    usage_error_line,
    window_closed,
)

PROPAGATED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "EP_")
PROPAGATED_NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")
RANK_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # as Ray Train: fail, don't hang
PLACEMENT_TIMEOUT_S = 60.0
POLL_S = 0.25  # ray.wait slice: keeps Ctrl-C responsive


def propagated_env() -> dict[str, str]:
    """Whitelisted driver variables for the ranks; never CUDA_VISIBLE_DEVICES/RANK/MASTER_*, nor
    a node's own network settings (``NODE_LOCAL_VARIABLES``): each rank keeps its node's."""
    env = {
        key: value
        for key, value in os.environ.items()
        if (key.startswith(PROPAGATED_PREFIXES) or key in PROPAGATED_NAMES)
        and key not in NODE_LOCAL_VARIABLES
    }
    return RANK_ENV_DEFAULTS | env


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """Hosts one ``RankWorker``. No CUDA work before ``start``."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.worker: RankWorker | None = None

    def meta(self) -> dict:
        """Where this actor runs and which GPU it was given (device index, not masked)."""
        context = ray.get_runtime_context()
        gpu_ids = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        device_index = None
        if gpu_ids:
            visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
            device_index = visible.index(gpu_ids[0]) if gpu_ids[0] in visible else int(gpu_ids[0])
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_id": int(gpu_ids[0]) if gpu_ids and gpu_ids[0].isdigit() else -1,
            "device_index": device_index,
            "pid": os.getpid(),
        }

    def start(
        self, rank: int, device_index: int | None, host: str, port: int, node_ip: str | None
    ) -> None:
        """Join the driver's store and the process group; gloo and NCCL are bound to the
        interface holding ``node_ip`` (loopback on one node) unless this node set its own
        (``network``)."""
        store = join_store(host, port, None, self.spec.timeout_s)
        self.worker = RankWorker(self.spec, rank, device_index, node_ip)
        self.worker.init_process_group(store=store)

    def step(self, method: str, args: tuple) -> object:
        assert self.worker is not None, "start() first"
        return self.worker.step(method, args)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class _TokenAuthOnNotice(logging.Filter):
    """Drops Ray's warning that token authentication is on, for the private cluster the
    launcher starts itself: on is what that cluster should be (the token guards its services),
    and the warning's only advice is to turn it off. Ray's warning that it is *off* still shows.
    """

    LOGGER = "ray._private.authentication.authentication_token_setup"

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextlib.contextmanager
def node_on_loopback() -> Iterator[None]:
    """A cluster started inside runs on 127.0.0.1, as Ray runs one on macOS and Windows: Ray
    gives a node on a loopback address loopback-only services (its gRPC servers, the agents'
    HTTP and metrics ports, the metrics of the autoscaler monitor and the dashboard process),
    but on Linux it maps ``_node_ip_address="127.0.0.1"`` back to the machine's address unless
    its switch for clusters beyond one machine is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``,
    read once, at import, into ``ray_constants.ENABLE_RAY_CLUSTER``). Turned off for the start
    only: a driver joining a cluster needs its real address."""
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


class RaySession:
    """Connect to a cluster, or start a private local one that ``close`` fully removes."""

    def __init__(self, address: str | None) -> None:
        self.owns_cluster = False
        self.temp_dir: str | None = None
        if ray.is_initialized():  # an embedding program (or a test) already connected
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address is None:
            address = "auto" if os.environ.get("RAY_ADDRESS") else "local"
        try:
            if address == "local":
                # a short private temp dir: no collisions with other local clusters, socket paths
                # stay under the 107-byte limit, and everything is removed at the end
                self.temp_dir = tempfile.mkdtemp(prefix="epray_", dir="/tmp")
                self.owns_cluster = True
                # every service of the cluster on loopback (``node_on_loopback``), and Ray's
                # token on them, on by default for a local cluster since Ray 2.59
                # (RAY_AUTH_MODE=disabled: off)
                auth_logger = logging.getLogger(_TokenAuthOnNotice.LOGGER)
                notice = _TokenAuthOnNotice()
                auth_logger.addFilter(notice)
                try:
                    with node_on_loopback():
                        ray.init(
                            address="local",
                            include_dashboard=False,
                            dashboard_host=LOOPBACK,
                            _node_ip_address=LOOPBACK,
                            _temp_dir=self.temp_dir,
                            logging_level="WARNING",
                        )
                finally:
                    auth_logger.removeFilter(notice)
            else:
                ray.init(address=address, logging_level="WARNING")
        except (ConnectionError, RuntimeError, ValueError) as error:
            self.close()
            reason = " ".join(str(error).split())  # one line
            if self.owns_cluster:
                message = f"--address local: a private Ray cluster did not start ({reason})"
            else:
                message = (
                    f"--address {address}: expected a running Ray cluster, given none ({reason})"
                )
            raise LaunchError(message) from None
        install_stop_handlers()  # ray.init replaced the SIGTERM handler

    def close(self) -> None:
        if self.owns_cluster:
            with contextlib.suppress(Exception):
                ray.shutdown()
            if self.temp_dir is not None:
                remove_dir(self.temp_dir)


def remove_dir(path: str, within_s: float = 5.0) -> None:
    """Remove ``path``; Ray's processes can still write their logs there for a moment after
    ``ray.shutdown()`` (a file made during ``rmtree`` leaves the folder), so retry until it is
    gone or ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    shutil.rmtree(path, ignore_errors=True)
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
        shutil.rmtree(path, ignore_errors=True)


def reserve_bundles(device: str, world_size: int):
    """One bundle per rank; STRICT_PACK when one node can hold them all, else PACK."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    total_cpus = sum(n.get("CPU", 0) for n in nodes)
    cpus = min(1.0, int(total_cpus / world_size * 4) / 4) or 0.25  # fractional on small boxes
    bundle = {"CPU": cpus, "GPU": 1} if device == "cuda" else {"CPU": cpus}
    fits_one_node = any(
        all(n.get(key, 0) >= amount * world_size for key, amount in bundle.items()) for n in nodes
    )
    strategy = "STRICT_PACK" if fits_one_node else "PACK"
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise LaunchError(
            f"placement group of {world_size} x {bundle} ({strategy}) not ready after "
            f"{PLACEMENT_TIMEOUT_S:.0f} s; available: {ray.available_resources()}"
        )
    return group, bundle


def supervise(refs: Sequence, where: str, timeout_s: float, abandoned: list | None = None) -> list:
    """Results of ``refs[rank]`` (see ``supervise_ranks``), in order."""
    results = supervise_ranks(dict(enumerate(refs)), where, timeout_s, abandoned)
    return [results[rank] for rank in range(len(refs))]


def supervise_ranks(
    calls: dict[int, ray.ObjectRef],
    where: str,
    timeout_s: float,
    abandoned: list | None = None,
    killed: frozenset[int] = frozenset(),
) -> dict[int, object]:
    """Results of ``calls[rank]``, by rank; on failure, collect failures until the cause is
    known (see ``window_closed``) and raise it as ``RankFailure``. A rank of ``killed`` whose
    actor died (an elastic run's ``--kill-rank``) is no failure: it is left out of the results.
    ``timeout_s`` bounds the whole step. Calls still unanswered when it raises are appended to
    ``abandoned`` (see ``settle``)."""
    pending = {ref: rank for rank, ref in calls.items()}
    try:
        return _supervise(pending, where, timeout_s, killed)
    finally:
        if abandoned is not None:
            abandoned.extend(pending)


def _supervise(
    pending: dict, where: str, timeout_s: float, killed: frozenset[int]
) -> dict[int, object]:
    results: dict[int, object] = {}
    failures: list[Failure] = []
    deadline = time.monotonic() + timeout_s
    first_failure_at = 0.0
    while pending:
        raise_if_stop_requested()
        now = time.monotonic()
        if window_closed(failures, first_failure_at, now):
            break
        if now >= deadline:
            raise RankFailure(
                None,
                f"step {where}",
                f"no answer within {timeout_s:.0f} s from ranks {sorted(pending.values())}",
            )
        done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        for ref in done:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except RayActorError as error:  # the process died (killed, exited, OOM)
                if rank in killed:
                    continue
                failures.append(
                    Failure(rank, FailureKind.DIED, f"rank {rank} died: {error}", len(failures))
                )
            except RayTaskError as error:  # str() carries the remote traceback
                text = str(error)
                kind = classify_exception_text(text)
                usage = usage_error_line(error.cause)
                failures.append(Failure(rank, kind, text, len(failures), usage))
            if len(failures) == 1 and not first_failure_at:
                first_failure_at = time.monotonic()
    if failures:
        raise root_failure(failures, f"step {where}", still_running=list(pending.values()))
    return results


def run_with_ray(
    spec: RunSpec, address: str | None, progress_factory: ProgressFactory
) -> tuple[RunSpec, list[dict]]:
    """Run ``spec`` on Ray; returns the resolved spec and every rank's summary, by rank."""
    session = RaySession(address)
    group = None
    actors: list = []
    abandoned: list = []  # calls left unanswered when the run ended
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        device = resolve_device(spec.device, spec.world_size, gpus, "the cluster")
        spec = dataclasses.replace(spec, device=device)
        steps = plan(spec)
        with progress_factory(steps) as progress:
            progress.status("reserving placement group")
            group, bundle = reserve_bundles(spec.device, spec.world_size)
            env = propagated_env()
            if spec.device == "cuda":
                env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            actors = [
                RankActor.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
                    runtime_env={"env_vars": env},
                ).remote(spec)
                for index in range(spec.world_size)
            ]
            progress.status("starting rank actors")
            metas = supervise(
                [a.meta.remote() for a in actors], "start-up", spec.timeout_s * 3, abandoned
            )
            order = rank_order(metas)
            actors, metas = [actors[i] for i in order], [metas[i] for i in order]
            spans_nodes = len({m["node_id"] for m in metas}) > 1
            progress.status("rendezvous")
            driver_node = ray.get_runtime_context().get_node_id()
            on_driver_node = all(m["node_id"] == driver_node for m in metas)
            host = LOOPBACK if on_driver_node else ray.util.get_node_ip_address()
            store = host_store(host, None, spec.timeout_s)  # kept until the run ends
            port = store.port
            supervise(
                [
                    a.start.remote(
                        r, m["device_index"], host, port, m["ip"] if spans_nodes else LOOPBACK
                    )
                    for r, (a, m) in enumerate(zip(actors, metas, strict=True))
                ],
                "process group init",
                spec.timeout_s * 2,
                abandoned,
            )
            summaries = run_steps(actors, steps, spec, progress, abandoned)
        with contextlib.suppress(Exception):
            ray.get([a.shutdown.remote() for a in actors], timeout=10)
        return spec, summaries
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        settle(abandoned)
        if group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        session.close()


def settle(refs: list, budget_s: float = 2.0) -> None:
    """Fetch and drop the outcome of calls abandoned when the run ended (their actors are
    killed by now), so Ray does not print each one as an "Unhandled error" at exit."""
    deadline = time.monotonic() + budget_s
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))


def rank_order(metas: list[dict]) -> list[int]:
    """Actor indices in rank order: the driver's node first, then node ip, then GPU id."""
    driver_node = ray.get_runtime_context().get_node_id()
    return sorted(
        range(len(metas)),
        key=lambda i: (metas[i]["node_id"] != driver_node, metas[i]["ip"], metas[i]["gpu_id"], i),
    )


def run_steps(
    actors: list, steps: list[Step], spec: RunSpec, progress: RunProgress, abandoned: list
) -> list[dict]:
    """Each step on every rank at once, supervised; the last step's results are the summaries,
    by rank. A rank the workload kills (``killed_ranks``) is driven no more once it died."""
    step_timeout = spec.timeout_s * 10  # collectives time out long before; guards local hangs
    killed = spec.workload.killed_ranks
    live = dict(enumerate(actors))
    results: dict[int, object] = {}
    for step in steps:
        calls = {rank: actor.step.remote(step.method, step.args) for rank, actor in live.items()}
        results = supervise_ranks(calls, step.label, step_timeout, abandoned, killed)
        live = {rank: live[rank] for rank in results}
        progress.done(step)
    return [results[rank] for rank in sorted(results)]
