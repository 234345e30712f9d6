"""The default workload: one model-shaped EP MoE layer per layout, timed phase by phase against
same-run baselines and validated on every rank against ``reference_moe``.

Each rank builds only its expert shard and its own inputs (``layer_data``: deterministic per
seed), times the layer's phases (``bench.timing``), validates a token sample, and summarises;
the launching process turns the summaries into the report (``bench.report``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, replace

import torch
from rich.console import Console

from ep_runtime import EPMoE
from ep_runtime.bench.baselines import time_all_to_all, time_dense_gemm, time_weights_read
from ep_runtime.bench.metrics import (
    Traffic,
    expert_flops_per_pair,
    expert_token_counts,
    imbalance,
    peak_memory_bytes,
)
from ep_runtime.bench.report import build_report, print_report, write_json, write_plot
from ep_runtime.bench.timing import PhaseClock, PhaseRecorder, max_over_ranks_stats
from ep_runtime.eplb import DeviceMap, LoadStats, LoadSummary, parse_zipf
from ep_runtime.launch import layer_data, layer_eplb
from ep_runtime.launch.presets import ModelPreset
from ep_runtime.launch.spec import RankContext, RunOutcome, RunSpec, Step, Workload, torch_dtype
from ep_runtime.layer import PHASES as LAYER_PHASES
from ep_runtime.types import DispatchMode, EPInputError

PHASES = (*LAYER_PHASES, "layer")
GRAPH_PHASE = "layer_graph"  # capacity mode on CUDA: the layer replayed as a captured CUDA graph
FAILURE_KINDS = ("raise", "input", "exit", "kill", "hang")
RANK_ONLY = ("times", "rebalances", "validation_before_rebalance")  # a case's, not summarised


@dataclass(frozen=True)
class FailureInjection:
    """Test hook: make ``rank`` fail at timed iteration ``iteration`` of the first layout.

    raise: a Python exception; input: ``EPInputError``, as a backend rejecting its input;
    exit: ``os._exit(1)``; kill: SIGKILL itself; hang: sleep forever.
    """

    rank: int
    kind: str
    iteration: int = 0

    def __str__(self) -> str:
        return f"{self.rank}:{self.kind}:{self.iteration}"

    @staticmethod
    def parse(text: str) -> FailureInjection:
        """``RANK:KIND[:ITER]``, e.g. ``1:raise`` or ``0:kill:2``."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[1] not in FAILURE_KINDS:
            raise ValueError(
                f"--inject-failure: expected RANK:{'|'.join(FAILURE_KINDS)}[:ITER], given {text!r}"
            )
        return FailureInjection(int(parts[0]), parts[1], int(parts[2]) if len(parts) == 3 else 0)


@dataclass(frozen=True)
class LayerWorkload(Workload):
    """One synthetic layer of ``model``'s shape and router per entry of ``layouts``."""

    model: ModelPreset
    dtype: str = "auto"  # "auto", "bf16" or "fp32"
    dispatcher: str = "auto"
    experts: str = "auto"
    layouts: tuple[str, ...] = ("auto",)  # one layer per entry, run one after the other
    mode: str = "exact"
    iters: int = 10
    warmup: int = 3
    seed: int = 0
    validate_tokens: int = 64  # per rank; 0 = every token
    baselines: bool = True
    inject_failure: FailureInjection | None = None
    quantization: str | None = None  # "fp8_block": e4m3 expert weights with 128×128 block scales
    routing: str = "model"  # or "zipf:S" (layer_eplb)
    redundant_experts: int = 0
    rebalance_every: int | None = None  # iterations, warm-up and timed

    @property
    def balances_load(self) -> bool:
        """The report shows the expert load (skewed routing, redundant slots or rebalancing)."""
        return bool(
            self.redundant_experts
            or self.rebalance_every is not None
            or parse_zipf(self.routing) is not None
        )

    def plan(self) -> list[Step]:
        steps = [Step("setup", (), 1, "weights and inputs")]
        chunk = max(1, self.iters // 10)
        for case, layout in enumerate(self.layouts):
            steps.append(Step("build", (case,), 1, f"build layer (layout {layout})"))
            if self.warmup:
                steps.append(Step("run_iters", (self.warmup, False), self.warmup, "warm-up"))
            for start in range(0, self.iters, chunk):
                count = min(chunk, self.iters - start)
                steps.append(Step("run_iters", (count, True), count, f"timed ({layout})"))
            steps.append(Step("validate", (), 1, f"validate ({layout})"))
            steps.append(Step("close_case", (), 0, "close layer"))
        if self.baselines:
            steps.append(Step("baselines", (), 1, "baselines"))
        steps.append(Step("summarize", (), 0, "summarize"))
        return steps

    def worker(self, context: RankContext) -> LayerRankWorker:
        return LayerRankWorker(self, context)

    def finish(self, spec: RunSpec, outcome: RunOutcome, console: Console) -> bool:
        report = build_report(
            spec.to_json(), outcome.launcher, outcome.summaries, outcome.elapsed_s
        )
        if outcome.reports_here:
            print_report(report, console)
            if outcome.json_path:
                write_json(report, outcome.json_path)
            if outcome.plot_path:
                write_plot(report, outcome.plot_path)
        return report["passed"]

    def to_json(self) -> dict:
        return asdict(self)


class LayerRankWorker:
    """One rank's state across the steps of ``LayerWorkload.plan``."""

    def __init__(self, workload: LayerWorkload, context: RankContext) -> None:
        self.workload = workload
        self.context = context
        self.rank = context.rank
        self.device = context.device
        self.comm = context.comm
        self.clock = PhaseClock(context.comm)
        self.layer: EPMoE | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_out: torch.Tensor | None = None  # [T, H] the graph's static output
        self.case = -1
        self.cases: list[dict] = []
        self.slot_counts: list[int] | None = None  # per forward, the last window (balancing)
        self.layer_peak_bytes: int | None = None  # peak memory before the baselines ran

    def setup(self) -> None:
        """Inputs and routing of this rank and the global routing counts."""
        run, model, device = self.workload, self.workload.model, self.device
        world_size = self.context.spec.world_size
        config = replace(model.moe_config(torch_dtype(run.dtype)), quantization=run.quantization)
        self.config = config
        self.dtype = config.resolve_dtype(device)
        tokens = model.tokens_per_rank
        self.x = layer_data.rank_hidden_states(
            config, self.rank, tokens, run.seed, device, self.dtype
        )
        self.topk_ids, self.topk_weights = layer_data.rank_routing(
            model, self.rank, tokens, run.seed, device, zipf=parse_zipf(run.routing)
        )
        self.local_experts = layer_data.local_experts(
            config, self.rank, world_size, run.redundant_experts
        )
        per_rank_counts = self.comm.all_gather_object(
            expert_token_counts(self.topk_ids, model.num_experts)
        )
        self.expert_counts = [sum(column) for column in zip(*per_rank_counts, strict=True)]
        self.pairs_per_forward = sum(self.expert_counts)  # over all ranks
        initial = layer_eplb.initial_device_map(
            model.num_experts, run.redundant_experts, world_size, device
        )
        self._set_traffic(initial)
        self.timed_iterations = 0

    def _set_traffic(self, device_map: DeviceMap) -> None:
        """Rows between ranks under the placement of ``device_map`` (collective)."""
        destinations = layer_eplb.physical_destinations(
            self.topk_ids, device_map, self.rank, self.context.spec.world_size
        )
        rows = self.comm.all_gather_object(destinations)
        config = self.config
        self.traffic = Traffic.of_layer(
            rows, config.hidden_size, self.dtype, config.top_k, config.quantization is not None
        )

    def build(self, case: int) -> dict:
        """Construct the layer for ``layouts[case]`` and load this rank's shard."""
        run = self.workload
        self.case = case
        self.layer = EPMoE(
            self.config,
            dispatcher=run.dispatcher,
            experts=run.experts,
            layout=run.layouts[case],
            mode=run.mode,
            max_tokens_per_rank=self.config.max_tokens_per_rank,
            num_redundant_experts=run.redundant_experts,
        )
        self.iterations = 0
        self.load_before: LoadStats | None = None
        self.local_experts = list(self.layer.placement.experts_on_rank(self.rank))
        # this rank's slots only, [S, ...]; regenerated per layer and not kept here, so a backend
        # that converts the weights holds the only copy
        shard, scales = layer_data.rank_shard(
            self.config, self.local_experts, run.seed, self.device, self.dtype
        )
        self.layer.load_weights(*shard, weights_are="slots", **scales)
        self.expert_weight_bytes = sum(w.nbytes for w in (*shard, *scales.values()))
        del shard, scales
        self.graph = self._capture_graph()
        phases = PHASES if self.graph is None else (*PHASES, GRAPH_PHASE)
        choice = self.layer.choice
        self.cases.append(
            {
                "requested_layout": run.layouts[case],
                "dispatcher": choice.dispatcher,
                "experts": choice.experts,
                "layout": choice.layout.value,
                "refused": dict(choice.refused),
                "choice": choice.describe(),
                "times": {phase: [] for phase in phases},
                "rebalances": [],
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
            self.iterations += 1
            every = self.workload.rebalance_every
            if every is not None and self.iterations % every == 0:
                self._rebalance()

    def _window_load(self) -> LoadStats:
        """The load per forward since the last rebalance (or the build), on the current map
        (collective); kept as this rank's slot counts."""
        layer = self._layer()
        load = layer_eplb.per_forward(layer.expert_load(), self.pairs_per_forward)
        slots = load[list(layer.placement.slots_of_rank(self.rank))]
        self.slot_counts = [round(float(count)) for count in slots]
        return LoadStats.of_slots(load, layer.placement)

    def _rebalance(self) -> None:
        """Between iterations, on every rank: validate the first placement before the first
        rebalance, then rebalance from the window's load and re-read the placement."""
        layer, case = self._layer(), self.cases[self.case]
        if self.load_before is None:
            case["validation_before_rebalance"] = self._validation()
            self.load_before = self._window_load()
        case["rebalances"].append(layer.rebalance())
        self.local_experts = list(layer.placement.experts_on_rank(self.rank))
        if self.graph is not None:  # a backend that converts the weights needs a new capture
            self.graph = self._capture_graph()

    def validate(self) -> dict:
        """``_validation`` of the final placement (and, where the layer was rebalanced, of the
        first one, done before the first rebalance); with load balancing the load summary and
        the traffic of the final placement."""
        case = self.cases[self.case]
        result = self._validation()
        before = case.get("validation_before_rebalance")
        if before is not None:
            result["before_rebalance"] = before
            result["passed"] = result["passed"] and before["passed"]
            for key in ("max_abs_err", "max_rel_err"):
                result[key] = max(result[key], before[key])
        case["validation"] = result
        rebalances = tuple(case["rebalances"])
        if self.workload.balances_load:
            after = self._window_load()
            summary = LoadSummary(
                self.load_before or after, after if rebalances else None, rebalances
            )
            case["eplb"] = layer_eplb.summary_json(summary)
            self._set_traffic(self._layer().eplb.device_map)
        return result

    def _validation(self) -> dict:
        """Layer output on a token sample vs ``reference_moe`` (only the experts it touches), the
        phase-timed forward's output vs this one's, bitwise (combine is deterministic), and the
        weights in this rank's slots vs the experts the placement puts there."""
        layer, run, model = self._layer(), self.workload, self.workload.model
        out = layer(self.x, self.topk_ids, self.topk_weights)  # [T, H]
        layer.phase_timer = PhaseRecorder(self.clock)  # the path run_iters times
        try:
            phase_out = layer(self.x, self.topk_ids, self.topk_weights)
        finally:
            layer.phase_timer = None
        sample = layer_data.validation_sample(out.size(0), run.validate_tokens, run.seed, self.rank)
        comparison, tolerance, touched = layer_data.check_sample(
            model,
            out,
            self.x,
            self.topk_ids,
            self.topk_weights,
            sample.to(self.device),
            run.seed,
            self.config.quantization,
        )
        deterministic = torch.equal(out, phase_out)
        if self.graph is not None:
            self.graph.replay()
            deterministic = deterministic and torch.equal(out, self.graph_out)
        slots_hold_their_experts = None  # checked where the layer places experts itself
        if run.balances_load and self.config.quantization is None:
            slots_hold_their_experts = layer_data.slots_hold_experts(
                self.config, layer.eplb.slot_weights, self.local_experts, run.seed
            )
        result = {
            "passed": comparison.passed and deterministic and slots_hold_their_experts is not False,
            "max_abs_err": comparison.max_abs_error,
            "max_rel_err": comparison.max_relative_error,
            "tolerance": tolerance,
            "validated_tokens": comparison.num_tokens,
            "finite": comparison.finite,
            "deterministic": deterministic,
            "experts_regenerated": len(touched),
            "slots_hold_their_experts": slots_hold_their_experts,
            "placement": list(self.local_experts),
            "verdict": comparison.describe(),
        }
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
        """The all-to-all floor (both directions) and the experts' compute and memory floors
        (dense GEMMs of the same FLOPs; reading the weights of the local experts with tokens)."""
        self.layer_peak_bytes = peak_memory_bytes(self.device)  # the layers', not the copy's
        run, model = self.workload, self.workload.model
        iters, warmup = max(1, run.iters), run.warmup
        counts = self._local_counts()
        num_pairs = sum(counts)
        touched = sum(1 for count in counts if count)
        read_bytes = self.expert_weight_bytes * touched // len(counts)
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
            "weights_read": time_weights_read(self.clock, read_bytes, iters, warmup),
        }

    def summarize(self) -> dict:
        """This rank's results plus the cross-rank phase statistics (identical on every rank)."""
        comm, model = self.comm, self.workload.model
        local_counts = self._local_counts()
        cases = []
        for case in self.cases:
            gathered = comm.all_gather_object(case["times"])
            stats = {
                phase: max_over_ranks_stats([times[phase] for times in gathered]).to_json()
                for phase in case["times"]
            }
            kept = {k: v for k, v in case.items() if k not in RANK_ONLY}
            cases.append(kept | {"phases": stats})
        baselines = {}
        for name, times in getattr(self, "baseline_times", {}).items():
            baselines[name] = max_over_ranks_stats(comm.all_gather_object(times)).to_json()
        gated = self.config.activation.is_gated
        return {
            **self.context.describe(),
            "device": str(self.device),
            "tokens": model.tokens_per_rank,
            "dtype": str(self.dtype).removeprefix("torch."),
            "received_rows": self.traffic.received_rows(self.rank),
            "dispatch_received_bytes": self.traffic.dispatch_received_bytes(self.rank),
            "combine_bytes": self.traffic.combine_bytes(self.rank),
            "valid_pairs": sum(local_counts),
            "expert_flops": sum(local_counts)
            * expert_flops_per_pair(model.hidden_size, model.intermediate_size, gated),
            "local_experts": self._local_expert_ids(),
            "local_expert_counts": local_counts,
            "expert_imbalance": imbalance(local_counts),
            "expert_weight_bytes": self.expert_weight_bytes,
            "peak_memory_bytes": self.layer_peak_bytes or peak_memory_bytes(self.device),
            "cases": cases,
            # identical on every rank:
            "global_expert_counts": self.expert_counts,
            "traffic_rows": self.traffic.rows,
            "baselines": baselines,
        }

    def _local_counts(self) -> list[int]:
        """(token, expert) pairs per local expert, or with load balancing per slot as measured
        in the last window (the last layout's), one forward's worth."""
        if self.slot_counts is not None:
            return self.slot_counts
        return [self.expert_counts[e] for e in self.local_experts]

    def _local_expert_ids(self) -> list[int]:
        """``[first, last + 1)`` of the local experts; with load balancing the logical expert of
        each slot (the last layout's final placement)."""
        if self.workload.balances_load:
            return list(self.local_experts)
        return [self.local_experts[0], self.local_experts[-1] + 1]

    def close(self) -> None:
        if self.layer is not None:
            self.layer.close()
            self.layer = None

    def _layer(self) -> EPMoE:
        if self.layer is None:
            raise RuntimeError("build() must run before this step")
        return self.layer

    def _maybe_fail(self) -> None:
        """Test hook (``--inject-failure``): fail as told, on the first layout only."""
        failure = self.workload.inject_failure
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
