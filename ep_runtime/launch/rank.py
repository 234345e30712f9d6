"""The rank runtime: the code every launcher (Ray actor, spawn process, torchrun process) runs.

It owns the rank's device and process group and hosts the run's workload (``spec.Workload``):
a run is the workload's fixed list of collective steps (``plan``), executed by every rank in
the same order. A launcher either calls one step at a time on all ranks (Ray: progress and
supervision between steps) or lets each rank run the whole plan (spawn, torchrun).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.elastic import ElasticGroup
from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.spec import LaunchError, RankContext, RunSpec, Step, WorkloadWorker


def plan(spec: RunSpec) -> list[Step]:
    """The steps of a run, identical on every rank."""
    return spec.workload.plan()


def run_plan(worker: RankWorker, on_step: Callable[[Step], None] | None = None) -> dict:
    """Run every step on this rank; returns the last step's result (the rank's summary)."""
    result: dict = {}
    for step in plan(worker.spec):
        result = worker.step(step.method, step.args)
        if on_step is not None:
            on_step(step)
    return result


class RankWorker:
    """One rank: device, process group, and the workload's worker. No CUDA work happens in
    ``__init__``.

    ``node_ip``: the address the rank's peers reach it by (``LOOPBACK`` within one host); gloo
    and NCCL are bound to the interface holding it unless the environment names one (``network``).
    """

    def __init__(
        self,
        spec: RunSpec,
        rank: int,
        device_index: int | None = None,
        node_ip: str | None = None,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.node_ip = node_ip
        self.device = (
            torch.device("cuda", device_index or 0)
            if spec.device == "cuda"
            else torch.device("cpu")
        )
        self.comm: Comm | None = None
        self.workload: WorkloadWorker | None = None

    def init_process_group(
        self, store: dist.Store | None = None, init_method: str | None = None
    ) -> None:
        """NCCL on CUDA, gloo on CPU; the spec's timeout on every collective. Then the
        workload's worker for this rank.

        A workload that ``forms_elastic_group`` gets an ``ElasticGroup`` on ``store`` (the
        launcher's, hosted outside every rank), which forms the default group itself."""
        interfaces = apply_interface_defaults(self.node_ip)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # ranks share the cores; BLAS threads would fight
        elastic = None
        if self.spec.workload.forms_elastic_group:
            elastic = self._elastic_group(store)
        else:
            self._default_group(store, init_method)
        self.comm = Comm.create(None, self.device)
        context = RankContext(
            self.spec, self.rank, self.device, self.comm, self.node_ip, interfaces, elastic
        )
        self.workload = self.spec.workload.worker(context)

    def _elastic_group(self, store: dist.Store | None) -> ElasticGroup:
        if store is None:
            raise LaunchError("--elastic: the ranks need the launcher's store (spawn or Ray)")
        return ElasticGroup(
            store,
            self.rank,
            self.spec.world_size,
            device=self.device,
            timeout_s=self.spec.timeout_s,
        )

    def _default_group(self, store: dist.Store | None, init_method: str | None) -> None:
        options: dict = {
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
            "rank": self.rank,
            "world_size": self.spec.world_size,
            "timeout": timedelta(seconds=self.spec.timeout_s),
        }
        if self.device.type == "cuda":
            options["device_id"] = self.device  # eager NCCL init, bound to this GPU
        if store is not None:
            options["store"] = store
        else:
            options["init_method"] = init_method or "env://"
        dist.init_process_group(**options)

    def step(self, method: str, args: tuple) -> object:
        """One step of the plan: ``<workload worker>.<method>(*args)``."""
        if self.workload is None:
            raise RuntimeError("init_process_group() must run before the steps")
        return getattr(self.workload, method)(*args)

    def shutdown(self) -> None:
        if self.workload is not None:
            self.workload.close()
            self.workload = None
        if dist.is_initialized():
            dist.destroy_process_group()
