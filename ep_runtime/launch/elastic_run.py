"""The elastic workload (``--elastic``): the synthetic layer on an ``ElasticGroup`` that loses
the ranks ``--kill-rank`` names and goes on serving on the survivors.

Each rank builds its shard of the seeded experts and its own tokens (``layer_data``); the
layer's weight source regenerates any expert by id from the same seed, so the experts only a
lost rank held come back bit for bit. Each iteration is one forward of the rank's tokens. A rank
told to die writes the time into the launcher's store and SIGKILLs itself as its iteration
starts (before the first kill, every rank measures the load counted so far). The survivors'
forward in flight raises ``RemoteRankError``: that forward is lost work, kept with the time it
was seen. Their next iteration recovers (``ElasticGroup.recover``, timed here), and the first
forward after a recovery is checked against ``reference_moe`` on the token sample. After the
iterations each survivor measures the load over a few forwards on the new placement and
validates its output; ``elastic_report`` turns the survivors' summaries into the report.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from ep_runtime import EPMoE
from ep_runtime.eplb import LoadStats, parse_zipf
from ep_runtime.launch import elastic_report, layer_data
from ep_runtime.launch.presets import ModelPreset
from ep_runtime.launch.spec import RankContext, RunOutcome, RunSpec, Step, Workload, torch_dtype
from ep_runtime.types import RemoteRankError

if TYPE_CHECKING:
    from ep_runtime.elastic import ElasticGroup

ELASTIC_ROUTING = "zipf:1.2"  # the default: skewed, so that balance matters
KILLED_KEY = "launch/elastic/killed/"  # + original rank: {"iteration", "at"} in the store
MEASURE_FORWARDS = 3  # forwards the load after the last recovery is measured over


@dataclass(frozen=True)
class KillAt:
    """``--kill-rank R@N``: rank ``rank`` SIGKILLs itself as iteration ``iteration`` starts."""

    rank: int
    iteration: int

    def __str__(self) -> str:
        return f"{self.rank}@{self.iteration}"

    @staticmethod
    def parse(text: str) -> tuple[KillAt, ...]:
        """``R@N`` or a comma list of them, e.g. ``2@5`` or ``1@3,2@6``."""
        kills = []
        for item in text.split(","):
            rank, at, iteration = item.strip().partition("@")
            if not (at and rank.strip().isdigit() and iteration.strip().isdigit()):
                raise ValueError(
                    "--kill-rank: expected R@N (rank R killed as iteration N starts; several: "
                    f"R@N,R@N), given {text!r}"
                )
            kills.append(KillAt(int(rank), int(iteration)))
        return tuple(kills)


@dataclass(frozen=True)
class ElasticWorkload(Workload):
    """``iters`` forwards of one synthetic layer of ``model``'s shape on an elastic group;
    ``kills``: the ranks that SIGKILL themselves, and when."""

    model: ModelPreset
    dtype: str = "auto"
    dispatcher: str = "auto"
    experts: str = "auto"
    layout: str = "auto"
    mode: str = "exact"
    iters: int = 10
    seed: int = 0
    validate_tokens: int = 64  # per rank; 0 = every token
    routing: str = ELASTIC_ROUTING
    redundant_experts: int = 0
    kills: tuple[KillAt, ...] = ()

    @property
    def forms_elastic_group(self) -> bool:
        return True

    @property
    def killed_ranks(self) -> frozenset[int]:
        return frozenset(kill.rank for kill in self.kills)

    def plan(self) -> list[Step]:
        steps = [
            Step("setup", (), 1, "inputs"),
            Step("build", (), 1, f"build elastic layer (layout {self.layout})"),
        ]
        chunk = max(1, self.iters // 10)
        for start in range(0, self.iters, chunk):
            count = min(chunk, self.iters - start)
            steps.append(Step("run_iters", (start, count), count, "iterations"))
        steps += [
            Step("measure", (), 1, "load after recovery"),
            Step("validate", (), 1, "validate survivors"),
            Step("summarize", (), 0, "summarize"),
        ]
        return steps

    def worker(self, context: RankContext) -> ElasticRankWorker:
        return ElasticRankWorker(self, context)

    def finish(self, spec: RunSpec, outcome: RunOutcome, console: Console) -> bool:
        kills = {kill.rank: kill.iteration for kill in self.kills}
        report = elastic_report.build_report(spec, kills, outcome)
        if outcome.reports_here:
            elastic_report.print_report(report, console)
            if outcome.json_path:
                elastic_report.write_json(report, outcome.json_path)
        return report["passed"]

    def to_json(self) -> dict:
        fields = asdict(self)
        fields["kills"] = [str(kill) for kill in self.kills]
        return fields


class ElasticRankWorker:
    """One rank's state across the steps of ``ElasticWorkload.plan``."""

    def __init__(self, workload: ElasticWorkload, context: RankContext) -> None:
        if context.elastic is None:
            raise RuntimeError("the elastic workload needs the rank runtime's ElasticGroup")
        self.workload = workload
        self.context = context
        self.rank = context.rank  # the original rank: its tokens, its kill
        self.device = context.device
        self.group: ElasticGroup = context.elastic
        self.layer: EPMoE | None = None
        self.first_kill = min((kill.iteration for kill in workload.kills), default=None)
        self.my_kill = next((k.iteration for k in workload.kills if k.rank == self.rank), None)
        self.lost_forwards: list[dict] = []
        self.recoveries: list[dict] = []  # wall times of each recovery, its first forward
        self.forward_s: dict[int, list[float]] = {}  # world size -> forward seconds
        self.regenerated: list[int] = []  # experts this rank read from the weight source, so far
        self.load_before: dict | None = None
        self.load_after: dict | None = None
        self.validation: dict | None = None

    def setup(self) -> None:
        """This rank's tokens and routing (skewed, ``--routing``)."""
        run, model = self.workload, self.workload.model
        self.config = model.moe_config(torch_dtype(run.dtype))
        self.dtype = self.config.resolve_dtype(self.device)
        tokens = model.tokens_per_rank
        self.x = layer_data.rank_hidden_states(
            self.config, self.rank, tokens, run.seed, self.device, self.dtype
        )
        self.topk_ids, self.topk_weights = layer_data.rank_routing(
            model, self.rank, tokens, run.seed, self.device, zipf=parse_zipf(run.routing)
        )

    def build(self) -> dict:
        """The layer on the elastic group, this rank's shard loaded; experts no survivor holds
        after a loss come from ``_weight_source``."""
        run = self.workload
        self.layer = EPMoE(
            self.config,
            dispatcher=run.dispatcher,
            experts=run.experts,
            layout=run.layout,
            mode=run.mode,
            max_tokens_per_rank=self.config.max_tokens_per_rank,
            num_redundant_experts=run.redundant_experts,
            elastic=self.group,
            weight_source=self._weight_source,
        )
        experts = list(self.layer.placement.experts_on_rank(self.group.rank))
        shard = layer_data.stacked_expert_weights(
            self.config, experts, run.seed, self.device, self.dtype
        )
        self.layer.load_weights(*shard, weights_are="slots")
        return {"choice": self.layer.choice.describe()}

    def _weight_source(self, experts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Any expert's weights by id, from the seed, as every rank loaded them."""
        self.regenerated += experts
        return layer_data.stacked_expert_weights(
            self.config, list(experts), self.workload.seed, self.device, self.dtype
        )

    def run_iters(self, start: int, count: int) -> None:
        """Iterations ``[start, start + count)``: recover where the group lost a rank, then
        one forward; a rank told to die at one of them dies as it starts."""
        for iteration in range(start, start + count):
            if iteration == self.first_kill and iteration > 0:
                self.load_before = self._measured_load(iteration)  # every rank is alive
            if iteration == self.my_kill:
                self._die(iteration)
            self._recover_if_needed(iteration)
            self._forward(iteration)

    def measure(self) -> None:
        """The load over ``MEASURE_FORWARDS`` forwards on the final placement (after a kill
        at the last iteration, the recovery first)."""
        self._recover_if_needed(self.workload.iters)
        self._layer().expert_load(reset=True)
        for _ in range(MEASURE_FORWARDS):
            self._forward(self.workload.iters)
        self.load_after = self._measured_load(MEASURE_FORWARDS)

    def validate(self) -> dict:
        """This survivor's output on its token sample vs ``reference_moe``, and its slots
        holding, bit for bit, the experts the placement puts there (regenerated here)."""
        layer = self._layer()
        out = layer(self.x, self.topk_ids, self.topk_weights)
        experts = list(layer.placement.experts_on_rank(self.group.rank))
        slots_ok = layer_data.slots_hold_experts(
            self.config, layer.eplb.slot_weights, experts, self.workload.seed
        )
        self.validation = self._check(out) | {"slots_hold_their_experts": slots_ok}
        self.validation["passed"] = self.validation["passed"] and slots_ok
        return self.validation

    def summarize(self) -> dict:
        """What this survivor saw: the kills (from the store), its lost forwards, each
        recovery with its wall times and first forward, the load, its validation."""
        layer, group = self._layer(), self.group
        kills = []
        for kill in self.workload.kills:
            key = f"{KILLED_KEY}{kill.rank}"
            if group.store.check([key]):
                kills.append({"rank": kill.rank, **json.loads(group.store.get(key).decode())})
        recoveries = [
            asdict(recovery) | {"total_s": recovery.total_s, "lines": recovery.lines()} | times
            for recovery, times in zip(group.recoveries, self.recoveries, strict=True)
        ]
        return {
            **self.context.describe(),
            "new_rank": group.rank,
            "world_size": group.world_size,
            "members": list(group.members),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "tokens": self.workload.model.tokens_per_rank,
            "choice": layer.choice.describe(),
            "kills": kills,
            "lost_forwards": self.lost_forwards,
            "recoveries": recoveries,
            "forward_ms": {
                str(world): statistics.median(times) * 1e3
                for world, times in self.forward_s.items()
            },
            "load_before": self.load_before,
            "load_after": self.load_after,
            "placement": list(layer.placement.experts_on_rank(group.rank)),
            "validation": self.validation,
        }

    def close(self) -> None:
        if self.layer is not None:
            self.layer.close()
            self.layer = None

    # ----------------------------------------------------------------- one iteration
    def _die(self, iteration: int) -> None:
        """``--kill-rank``: the time into the launcher's store, then SIGKILL."""
        record = json.dumps({"iteration": iteration, "at": time.time()})
        self.group.store.set(f"{KILLED_KEY}{self.rank}", record)
        os.kill(os.getpid(), signal.SIGKILL)

    def _recover_if_needed(self, iteration: int) -> None:
        if not self.group.needs_recovery():
            return
        started, read = time.time(), len(self.regenerated)
        self.group.recover()
        self.recoveries.append(
            {
                "iteration": iteration,
                "started_at": started,
                "ended_at": time.time(),
                "regenerated": sorted(self.regenerated[read:]),
            }
        )

    def _forward(self, iteration: int) -> None:
        """One forward, timed; a peer lost during it is lost work, the first forward after a
        recovery is checked against the reference."""
        layer = self._layer()
        started = time.perf_counter()
        try:
            out = layer(self.x, self.topk_ids, self.topk_weights)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except RemoteRankError as error:
            self.lost_forwards.append(
                {
                    "iteration": iteration,
                    "seen_at": time.time(),
                    "tokens": self.x.size(0),
                    "error": str(error),
                }
            )
            return
        done_at = time.time()
        self.forward_s.setdefault(self.group.world_size, []).append(time.perf_counter() - started)
        if self.recoveries and "first_forward" not in self.recoveries[-1]:
            self.recoveries[-1]["first_forward"] = {
                "iteration": iteration,
                "done_at": done_at,
                **self._check(out),
            }

    def _check(self, out: torch.Tensor) -> dict:
        run = self.workload
        sample = layer_data.validation_sample(out.size(0), run.validate_tokens, run.seed, self.rank)
        comparison, tolerance, _ = layer_data.check_sample(
            run.model,
            out,
            self.x,
            self.topk_ids,
            self.topk_weights,
            sample.to(self.device),
            run.seed,
        )
        return {
            "passed": comparison.passed,
            "max_abs_err": comparison.max_abs_error,
            "max_rel_err": comparison.max_relative_error,
            "tolerance": tolerance,
            "validated_tokens": comparison.num_tokens,
            "verdict": comparison.describe(),
        }

    def _measured_load(self, forwards: int) -> dict:
        """The load per forward counted since the last reset (collective), on the current
        placement."""
        layer = self._layer()
        load = layer.expert_load().double() / max(1, forwards)
        stats = LoadStats.of_slots(load, layer.placement)
        return asdict(stats) | {
            "rank_imbalance": stats.rank_imbalance,
            "forwards": forwards,
            "world_size": self.group.world_size,
        }

    def _layer(self) -> EPMoE:
        if self.layer is None:
            raise RuntimeError("build() must run before this step")
        return self.layer
