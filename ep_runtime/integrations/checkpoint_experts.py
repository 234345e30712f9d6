"""A checkpoint's MoE experts read by expert id: this rank's slots while loading
(``SlotLoader``, ``patch_moe_blocks``' ``expert_weights``) and, on an elastic model, the experts
a recovery asks for (``CheckpointExpertSource``, its ``expert_source``). Either reads only those
experts: their per-expert tensors, or their rows of the fused ones (one read per run of
consecutive ids), each distinct expert once."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from ep_runtime.integrations.safetensors_index import (
    CheckpointIndex,
    LoadProgress,
    TensorInfo,
    TensorRead,
    TensorReader,
)


@dataclass(frozen=True)
class BlockExperts:
    """One MoE block's experts in the checkpoint: each expert's ``(gate, up, down)``
    (``[I, H]``, ``[I, H]``, ``[H, I]``), or the fused ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]`` whose rows are read; every expert checked against the model."""

    block: str
    per_expert: dict[int, tuple[TensorInfo, TensorInfo, TensorInfo]]  # every expert; {} if fused
    fused: tuple[TensorInfo, TensorInfo] | None
    shape: tuple[int, int, int]  # (E, I, H)

    def tensors(self, experts: Collection[int]) -> list[TensorInfo]:
        """The checkpoint tensors holding ``experts`` (fused: the two, of which rows are read)."""
        if self.fused is not None:
            return list(self.fused)
        return [t for expert in sorted(set(experts)) for t in self.per_expert[expert]]

    def nbytes(self, experts: Collection[int]) -> int:
        """Bytes read for ``experts``: their per-expert tensors, or their rows of the fused."""
        if self.fused is None:
            return sum(t.nbytes for t in self.tensors(experts))
        return sum(t.nbytes // t.shape[0] for t in self.fused) * len(set(experts))

    def read(
        self,
        experts: Sequence[int],
        reader: TensorReader,
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [n, 2I, H], [n, H, I]
        """``w13`` (rows ``[gate; up]``) and ``w2`` of ``experts`` (in that order, repeats
        allowed: a repeated expert is read once and copied), in ``dtype`` on ``device``."""
        _, inter, hidden = self.shape
        distinct = sorted(set(experts))
        row = {expert: i for i, expert in enumerate(distinct)}
        out13 = torch.empty(len(distinct), 2 * inter, hidden, dtype=dtype, device=device)
        out2 = torch.empty(len(distinct), hidden, inter, dtype=dtype, device=device)
        if self.fused is not None:
            gate_up, down = self.fused
            for run in _runs(distinct):  # one read per run of consecutive experts
                rows = slice(row[run.start], row[run.start] + len(run))
                reader.read_into(gate_up, out13[rows], run)
                reader.read_into(down, out2[rows], run)
        else:
            targets = []  # (checkpoint tensor, where it goes)
            for expert in distinct:
                gate, up, down = self.per_expert[expert]
                i = row[expert]
                targets += [(gate, out13[i, :inter]), (up, out13[i, inter:]), (down, out2[i])]
            for info, target in sorted(targets, key=lambda t: (str(t[0].file), t[0].name)):
                reader.read_into(info, target)
        if distinct == list(experts):
            return out13, out2
        rows_wanted = torch.tensor([row[expert] for expert in experts], device=device)
        return out13[rows_wanted], out2[rows_wanted]  # indexing copies


class SlotLoader:
    """``patch_moe_blocks``' ``expert_weights`` while loading: each block's experts of this
    rank's slots (``local``, the plan's), read with the load's reader onto ``device`` (the
    model's expert tensors are on the meta device), one row per slot."""

    def __init__(
        self,
        experts: dict[str, BlockExperts],
        local: tuple[int, ...],
        reader: TensorReader,
        device: torch.device,
    ) -> None:
        self.experts, self.local, self.reader, self.device = experts, local, reader, device

    def __call__(
        self, name: str, w13: torch.Tensor, w2: torch.Tensor, local: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [S, 2I, H], [S, H, I]
        if tuple(local) != self.local:  # the EP layer's placement is the plan's
            raise RuntimeError(f"{name}: EP layer serves experts {local}, plan {self.local}")
        return self.experts[name].read(local, self.reader, self.device, w13.dtype)


@dataclass
class CheckpointExpertSource:
    """``patch_moe_blocks``' ``expert_source`` for a checkpoint (``load_sharded(elastic=...)``):
    the experts a recovery asks for, read from the checkpoint with a reader of their own (the
    same value check as the load's: a NaN or Inf raises the ``EPInputError`` naming the tensor
    and its file). ``reads`` lists every read it made."""

    index: CheckpointIndex
    experts: dict[str, BlockExperts]  # by block name
    rank: int
    device: torch.device
    dtype: torch.dtype
    reads: list[TensorRead] = field(default_factory=list)

    def __call__(
        self, block: str, expert_ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [n, 2I, H], [n, H, I]
        experts = self.experts[block]
        reader = TensorReader(
            self.index,
            rank=self.rank,
            bytes_total=experts.nbytes(expert_ids),
            tensors_total=len(experts.tensors(expert_ids)),
            progress=_quiet,
        )
        try:
            weights = experts.read(list(expert_ids), reader, self.device, self.dtype)
        finally:
            reader.close()
            self.reads += reader.reads
        if reader.nonfinite:
            raise reader.nonfinite[0].error(others=reader.nonfinite[1:])
        return weights


def _quiet(_: LoadProgress) -> None:
    """No progress lines for a recovery's few experts."""


def _runs(experts: list[int]) -> list[range]:
    """Sorted distinct ids as maximal runs of consecutive ids: [0, 1, 2, 5] → [0:3, 5:6]."""
    runs: list[range] = []
    for expert in experts:
        if runs and runs[-1].stop == expert:
            runs[-1] = range(runs[-1].start, expert + 1)
        else:
            runs.append(range(expert, expert + 1))
    return runs
