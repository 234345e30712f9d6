"""The rank: the code every launcher (Ray actor, spawn process, torchrun process) runs.

A run is a fixed list of collective steps (``plan``); every rank executes the same steps in the
same order. A launcher either calls one step at a time on all ranks (Ray: progress and
supervision between steps) or lets each rank run the whole plan (spawn, torchrun).
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_runtime import EPMoE
from ep_runtime.bench.baselines import time_all_to_all, time_dense_gemm
from ep_runtime.bench.metrics import (
    Traffic,
    destination_rows,
    expert_flops_per_pair,
    expert_token_counts,
    imbalance,
)
from ep_runtime.bench.timing import PhaseClock, PhaseRecorder, max_over_ranks_stats
from ep_runtime.comm import Comm
from ep_runtime.launch import workload
from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.spec import RunSpec
from ep_runtime.layer import PHASES as LAYER_PHASES
from ep_runtime.tolerance import compare_per_token, tolerance_for
from ep_runtime.types import DispatchMode, EPInputError

PHASES = (*LAYER_PHASES, "layer")
GRAPH_PHASE = "layer_graph"  # capacity mode on CUDA: the layer replayed as a captured CUDA graph


@dataclass(frozen=True)
class Step:
    """One collective step: ``RankWorker.<method>(*args)``; ``work`` units for progress bars."""

    method: str
    args: tuple
    work: int
    label: str


def plan(spec: RunSpec) -> list[Step]:
    """The steps of a run, identical on every rank."""
    if spec.hf is not None:
        from ep_runtime.launch import hf_run

        return hf_run.plan(spec)
    steps = [Step("setup", (), 1, "weights and inputs")]
    chunk = max(1, spec.iters // 10)
    for case, layout in enumerate(spec.layouts):
        steps.append(Step("build", (case,), 1, f"build layer (layout {layout})"))
        if spec.warmup:
            steps.append(Step("run_iters", (spec.warmup, False), spec.warmup, "warm-up"))
        for start in range(0, spec.iters, chunk):
            count = min(chunk, spec.iters - start)
            steps.append(Step("run_iters", (count, True), count, f"timed ({layout})"))
        steps.append(Step("validate", (), 1, f"validate ({layout})"))
        steps.append(Step("close_case", (), 0, "close layer"))
    if spec.baselines:
        steps.append(Step("baselines", (), 1, "baselines"))
    steps.append(Step("summarize", (), 0, "summarize"))
    return steps


def run_plan(worker: RankWorker, on_step: Callable[[Step], None] | None = None) -> dict:
    """Run every step on this rank; returns ``summarize()``'s result."""
    result: dict = {}
    for step in plan(worker.spec):
        result = getattr(worker, step.method)(*step.args)
        if on_step is not None:
            on_step(step)
    return result


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class RankWorker:
    """One rank's state across the steps of a run. No CUDA work happens in ``__init__``.

    ``node_ip`` (a run across nodes): the address the launcher knows this rank's node by; gloo
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
        self.interfaces: dict[str, dict[str, str | None]] = {}
        self.device = (
            torch.device("cuda", device_index or 0)
            if spec.device == "cuda"
            else torch.device("cpu")
        )
        self.comm: Comm | None = None
        self.layer: EPMoE | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_out: torch.Tensor | None = None  # [T, H] the graph's static output
        self.case = -1
        self.cases: list[dict] = []
        self.hf_worker = None  # --hf-model runs (launch/hf_run.py)

    # rendezvous -----------------------------------------------------------------------------
    def describe(self) -> dict:
        """Where this rank runs and which interface each backend was told to use (and by whom)."""
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "node_ip": self.node_ip,
            "interfaces": self.interfaces,
        }

    def init_process_group(
        self, store: dist.Store | None = None, init_method: str | None = None
    ) -> None:
        """NCCL on CUDA, gloo on CPU; the spec's timeout on every collective."""
        self.interfaces = apply_interface_defaults(self.node_ip)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # ranks share the cores; BLAS threads would fight
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
        self.comm = Comm.create(None, self.device)
        self.clock = PhaseClock(self.comm)

    def shutdown(self) -> None:
        if self.hf_worker is not None:
            self.hf_worker.close()
        if self.layer is not None:
            self.layer.close()
            self.layer = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # steps ----------------------------------------------------------------------------------
    def hf(self, method: str) -> object:
        """A step of an ``--hf-model`` run: ``HFRankWorker.<method>()``."""
        if self.hf_worker is None:
            from ep_runtime.launch.hf_run import HFRankWorker

            self.hf_worker = HFRankWorker(self)
        return getattr(self.hf_worker, method)()

    def setup(self) -> None:
        """Inputs and routing of this rank and the global routing counts."""
        spec, model, device = self.spec, self.spec.model, self.device
        config = model.moe_config(spec.torch_dtype())
        self.config = config
        self.dtype = config.resolve_dtype(device)
        tokens = model.tokens_per_rank
        self.x = workload.rank_hidden_states(
            config, self.rank, tokens, spec.seed, device, self.dtype
        )
        self.topk_ids, self.topk_weights = workload.rank_routing(
            model, self.rank, tokens, spec.seed, device
        )
        self.local_experts = workload.local_experts(config, self.rank, spec.world_size)
        comm = self._comm()
        per_rank_counts = comm.all_gather_object(
            expert_token_counts(self.topk_ids, model.num_experts)
        )
        self.expert_counts = [sum(column) for column in zip(*per_rank_counts, strict=True)]
        rows = comm.all_gather_object(
            destination_rows(self.topk_ids, model.num_experts, spec.world_size)
        )
        self.traffic = Traffic(rows=rows, row_bytes=model.hidden_size * self.dtype.itemsize)
        self.timed_iterations = 0

    def build(self, case: int) -> dict:
        """Construct the layer for ``spec.layouts[case]`` and load this rank's shard."""
        spec = self.spec
        self.case = case
        self.layer = EPMoE(
            self.config,
            dispatcher=spec.dispatcher,
            experts=spec.experts,
            layout=spec.layouts[case],
            mode=spec.mode,
            max_tokens_per_rank=self.config.max_tokens_per_rank,
        )
        # this rank's shard only, [L, ...]; regenerated per layer and not kept here, so a backend
        # that converts the weights holds the only copy
        shard = workload.stacked_expert_weights(
            self.config, self.local_experts, spec.seed, self.device, self.dtype
        )
        self.layer.load_weights(*shard)
        self.expert_weight_bytes = sum(w.nbytes for w in shard)
        del shard
        self.graph = self._capture_graph()
        phases = PHASES if self.graph is None else (*PHASES, GRAPH_PHASE)
        choice = self.layer.choice
        self.cases.append(
            {
                "requested_layout": spec.layouts[case],
                "dispatcher": choice.dispatcher,
                "experts": choice.experts,
                "layout": choice.layout.value,
                "refused": dict(choice.refused),
                "choice": choice.describe(),
                "times": {phase: [] for phase in phases},
            }
        )
        return {"choice": choice.describe()}

    def run_iters(self, count: int, timed: bool) -> None:
        """``count`` iterations: a layer forward with each phase timed alone (the layer's phase
        hook: barrier and sync around dispatch, experts and combine), then the layer untouched."""
        layer, clock = self._layer(), self.clock
        x, ids, weights = self.x, self.topk_ids, self.topk_weights
        times = self.cases[self.case]["times"]
        recorder = PhaseRecorder(clock)
        for _ in range(count):
            if timed:
                self._maybe_fail()
            recorder.reset()
            layer.phase_timer = recorder
            try:
                layer(x, ids, weights)
            finally:
                layer.phase_timer = None
            _, t_layer = clock.time(lambda: layer(x, ids, weights))
            if self.graph is not None:
                _, t_graph = clock.time(self.graph.replay)
            if timed:
                self.timed_iterations += 1
                for phase in LAYER_PHASES:
                    times[phase].append(recorder.seconds.get(phase, 0.0))
                times["layer"].append(t_layer)
                if self.graph is not None:
                    times[GRAPH_PHASE].append(t_graph)

    def validate(self) -> dict:
        """Layer output on a token sample vs ``reference_moe`` (only the experts it touches), and
        the phase-timed forward's output vs this one's, bitwise (combine is deterministic)."""
        layer, spec, model = self._layer(), self.spec, self.spec.model
        out = layer(self.x, self.topk_ids, self.topk_weights)  # [T, H]
        layer.phase_timer = PhaseRecorder(self.clock)  # the path run_iters times
        try:
            phase_out = layer(self.x, self.topk_ids, self.topk_weights)
        finally:
            layer.phase_timer = None
        sample = workload.validation_sample(out.size(0), spec.validate_tokens, spec.seed, self.rank)
        rows = sample.to(self.device)
        reference, scale, touched = workload.sampled_reference(
            model, self.x[rows], self.topk_ids[rows], self.topk_weights[rows], spec.seed
        )
        tolerance = tolerance_for(self.dtype, max(model.hidden_size, model.intermediate_size))
        comparison = compare_per_token(out[rows], reference, tolerance, scale)
        deterministic = torch.equal(out, phase_out)
        if self.graph is not None:
            self.graph.replay()
            deterministic = deterministic and torch.equal(out, self.graph_out)
        result = {
            "passed": comparison.passed and deterministic,
            "max_abs_err": comparison.max_abs_error,
            "max_rel_err": comparison.max_relative_error,
            "tolerance": tolerance,
            "validated_tokens": comparison.num_tokens,
            "finite": comparison.finite,
            "deterministic": deterministic,
            "experts_regenerated": len(touched),
            "verdict": comparison.describe(),
        }
        self.cases[self.case]["validation"] = result
        return result

    def close_case(self) -> None:
        self.graph = self.graph_out = None
        self._layer().close()
        self.layer = None

    def _capture_graph(self) -> torch.cuda.CUDAGraph | None:
        """Capacity mode on CUDA (the decode path): capture one layer forward as a CUDA graph,
        after warm-up on a side stream; every rank captures at the same step."""
        layer = self._layer()
        if layer.mode is not DispatchMode.CAPACITY or self.device.type != "cuda":
            return None
        x, ids, weights = self.x, self.topk_ids, self.topk_weights
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                layer(x, ids, weights)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.graph_out = layer(x, ids, weights)
        return graph

    def baselines(self) -> None:
        """The all-to-all floor (both directions) and the dense-GEMM ceiling, same run."""
        spec, model = self.spec, self.spec.model
        iters, warmup = max(1, spec.iters), spec.warmup
        num_pairs = sum(self.expert_counts[e] for e in self.local_experts)
        self.baseline_times = {
            "a2a_dispatch": time_all_to_all(
                self.clock, self.traffic, model.hidden_size, self.dtype, iters, warmup
            ),
            "a2a_combine": time_all_to_all(
                self.clock, self.traffic, model.hidden_size, self.dtype, iters, warmup, reverse=True
            ),
            "dense_gemm": time_dense_gemm(
                self.clock,
                num_pairs,
                model.hidden_size,
                model.intermediate_size,
                self.config.activation.is_gated,
                self.dtype,
                iters,
                warmup,
            ),
        }

    def summarize(self) -> dict:
        """This rank's results plus the cross-rank phase statistics (identical on every rank)."""
        comm, model = self._comm(), self.spec.model
        local_counts = [self.expert_counts[e] for e in self.local_experts]
        cases = []
        for case in self.cases:
            gathered = comm.all_gather_object(case["times"])
            stats = {
                phase: max_over_ranks_stats([times[phase] for times in gathered]).to_json()
                for phase in case["times"]
            }
            cases.append({k: v for k, v in case.items() if k != "times"} | {"phases": stats})
        baselines = {}
        for name, times in getattr(self, "baseline_times", {}).items():
            baselines[name] = max_over_ranks_stats(comm.all_gather_object(times)).to_json()
        gated = self.config.activation.is_gated
        return {
            **self.describe(),
            "device": str(self.device),
            "tokens": model.tokens_per_rank,
            "dtype": str(self.dtype).removeprefix("torch."),
            "received_rows": self.traffic.received_rows(self.rank),
            "dispatch_received_bytes": self.traffic.dispatch_received_bytes(self.rank),
            "combine_bytes": self.traffic.combine_bytes(self.rank),
            "valid_pairs": sum(local_counts),
            "expert_flops": sum(local_counts)
            * expert_flops_per_pair(model.hidden_size, model.intermediate_size, gated),
            "local_experts": [self.local_experts[0], self.local_experts[-1] + 1],
            "local_expert_counts": local_counts,
            "expert_imbalance": imbalance(local_counts),
            "expert_weight_bytes": self.expert_weight_bytes,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "cases": cases,
            # identical on every rank:
            "global_expert_counts": self.expert_counts,
            "traffic_rows": self.traffic.rows,
            "baselines": baselines,
        }

    # helpers --------------------------------------------------------------------------------
    def _comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError("init_process_group() must run before the steps")
        return self.comm

    def _layer(self) -> EPMoE:
        if self.layer is None:
            raise RuntimeError("build() must run before this step")
        return self.layer

    def _maybe_fail(self) -> None:
        """Test hook (``--inject-failure``): fail as told, on the first layout only."""
        failure = self.spec.inject_failure
        if (
            failure is None
            or failure.rank != self.rank
            or self.case != 0
            or failure.iteration != self.timed_iterations
        ):
            return
        if failure.kind == "raise":
            raise RuntimeError(
                f"injected failure on rank {self.rank} at unix time {time.time():.3f}"
            )
        if failure.kind == "input":
            num_experts = self.config.num_experts
            raise EPInputError(
                "topk_ids",
                f"ids in [-1, {num_experts})",
                f"id {num_experts} (injected on rank {self.rank})",
            )
        if failure.kind == "exit":
            os._exit(1)
        if failure.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10**9)  # "hang": peers must time out of their collective
