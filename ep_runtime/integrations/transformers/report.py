"""``PatchReport``: what ``patch_moe_blocks`` replaced on this rank, and the handle lockstep loops
use: every EP block on zero tokens, the ranks' agreement whether anyone still generates, and, on
an elastic model, the recovery after a rank is lost. Where the group is, which rank this is and
which experts it serves are read from the EP blocks, so they stay current after a recovery."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ep_runtime.elastic import ElasticGroup, Recovery
    from ep_runtime.integrations.transformers.block import EPMoEBlock
    from ep_runtime.layer import EPMoE


@dataclass(frozen=True)
class PatchedBlock:
    name: str  # qualified module name, e.g. "model.layers.1.mlp"
    hf_class: str
    module: EPMoEBlock


@dataclass
class PatchReport:
    """What ``patch_moe_blocks`` replaced, on this rank; also the handle for lockstep loops."""

    blocks: list[PatchedBlock]  # in layer (execution) order
    num_experts: int
    expert_params_kept: int  # elements of this rank's expert shards when patched, all blocks
    expert_params_freed: int  # elements of the HF expert tensors released, all blocks
    elastic: ElasticGroup | None = field(repr=False, default=None)  # patch_moe_blocks(elastic=)

    @property
    def _first(self) -> EPMoE:
        return self.blocks[0].module.ep

    @property
    def rank(self) -> int:
        """This rank in the EP group (after a recovery: in the survivors' group)."""
        return self._first.comm.rank

    @property
    def world_size(self) -> int:
        return self._first.comm.world_size

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The EP blocks' process group (an elastic model's current generation)."""
        return self._first.comm.group

    @property
    def local_experts(self) -> range | tuple[int, ...]:
        """The logical expert of each of this rank's slots (of the first block)."""
        return slot_experts(self._first.eplb.local_experts)

    @property
    def device(self) -> torch.device:
        return self._first.device

    @property
    def choice(self) -> str:
        """What "auto" picked for the EP layers (one line), and refusals below it."""
        return self._first.choice.describe()

    @property
    def recoveries(self) -> tuple[Recovery, ...]:
        """The elastic group's recoveries so far (none for a model that is not elastic)."""
        return () if self.elastic is None else tuple(self.elastic.recoveries)

    def held_expert_bytes(self) -> int:
        """Bytes of the expert weights the EP layers hold (distinct storages)."""
        return sum(tensor_bytes(block.module.ep.experts) for block in self.blocks)

    def forward_idle(self) -> None:
        """Every EP block on zero tokens, in layer order: a rank with nothing to run this step
        still takes part in each block's collectives."""
        for block in self.blocks:
            block.module.forward_idle()

    def check(self) -> None:
        """Raise what the EP blocks recorded on the device (``EPMoE.check``, one host sync
        each): the ids' verdicts of forwards that did not read them on the host."""
        for block in self.blocks:
            block.module.ep.check()

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank: one 1-element all-reduce on the EP blocks' current
        group, watched like theirs (a lost peer raises ``RemoteRankError`` naming it)."""
        comm = self._first.dispatcher.comm
        if not comm.has_peers:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        comm.all_reduce(value)
        return comm.to_host(value)[0] > 0

    def least(self, value: int) -> int:
        """The smallest of every rank's ``value`` (one watched all-gather)."""
        return min(self._first.dispatcher.comm.all_gather_object(value))

    def recover(self) -> Recovery | None:
        """On an elastic model whose group lost a rank: the survivors re-form the group and
        rebuild every EP block on it (``ElasticGroup.recover``, collective over them); None
        where nothing needs recovering (the model is not elastic, or no rank was lost)."""
        if self.elastic is None or not self.elastic.needs_recovery():
            return None
        return self.elastic.recover()

    def describe(self) -> str:
        classes = sorted({block.hf_class for block in self.blocks})
        return (
            f"{len(self.blocks)} {'/'.join(classes)} blocks → EPMoE on rank "
            f"{self.rank}/{self.world_size}: experts {_describe_experts(self.local_experts)} "
            f"of {self.num_experts}; expert parameters kept "
            f"{self.expert_params_kept:,}, freed {self.expert_params_freed:,}; "
            f"{self.choice.splitlines()[0]}"
        )


def _describe_experts(experts: range | tuple[int, ...]) -> str:
    if isinstance(experts, range):
        return f"[{experts.start}, {experts.stop})"
    return f"{list(experts)} (one per slot)"


def slot_experts(experts: tuple[int, ...]) -> range | tuple[int, ...]:
    """The logical expert of each slot: a range where they run contiguously (always without
    redundant experts, before a rebalance or a recovery), else the tuple."""
    run = range(experts[0], experts[0] + len(experts))
    return run if tuple(run) == experts else experts


def tensor_bytes(obj: object) -> int:
    """Bytes of the distinct storages behind the tensors among ``obj``'s attributes (and the
    fields of dataclass attributes: an fp8 shard with its scales)."""
    storages: dict[int, int] = {}
    for value in vars(obj).values():
        is_record = is_dataclass(value) and not isinstance(value, type)
        for tensor in [getattr(value, f.name) for f in fields(value)] if is_record else [value]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
