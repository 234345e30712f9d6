"""Types that cross module boundaries: layouts, modes, the ``Dispatched`` hand-off, and errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class TopkLayout(str, enum.Enum):
    """How received rows are laid out for the experts.

    STANDARD: one row per (token, this rank), ``topk_ids`` is ``[R, K]``.
    EXPANDED: one row per (token, local expert), grouped by expert, ``topk_ids`` is ``[R, 1]``.
    """

    STANDARD = "standard"
    EXPANDED = "expanded"


class DispatchMode(str, enum.Enum):
    """EXACT: counts exchanged, one host sync, exact sizes. CAPACITY: static shapes, no sync."""

    EXACT = "exact"
    CAPACITY = "capacity"


class Activation(str, enum.Enum):
    """Expert activation. SILU is gated (SwiGLU, ``w13`` rows ``[gate; up]``); RELU2 is not."""

    SILU = "silu"
    RELU2 = "relu2"

    @property
    def is_gated(self) -> bool:
        return self is Activation.SILU


@dataclass
class Dispatched:
    """What a dispatcher hands to the experts (see DESIGN.md, "Dispatched").

    A row is padding iff all its ids are -1; padding may hold anything (NaN included).
    """

    hidden_states: torch.Tensor  # [R, H] received rows, compute dtype
    topk_ids: torch.Tensor  # [R, K'] int32 global ids, -1 = slot not served here
    topk_weights: torch.Tensor  # [R, K'] float32
    layout: TopkLayout
    expert_offsets: torch.Tensor | None  # [L + 1] int32 group starts (EXPANDED), else None
    expert_num_tokens: torch.Tensor  # [L] int32 valid (row, slot) pairs per local expert
    expert_num_tokens_cpu: list[int] | None  # same as a host list, exact mode only
    num_valid_rows: int | torch.Tensor  # upper bound on rows holding data (0-d tensor: capacity)
    handle: Any  # backend-private, consumed by combine
    hidden_states_scale: torch.Tensor | None = None  # fp8 dispatch only
    num_chunks: int = 1  # exact mode: rounds this forward takes (max over ranks)

    @property
    def top_k(self) -> int:
        """The K the expert kernel must be told: always the tensor's, never the config's."""
        return self.topk_ids.size(1)


class EPInputError(ValueError):
    """Bad input: names the argument, what was expected and what was given."""

    def __init__(self, argument: str, expected: str, given: object) -> None:
        self.argument = argument
        self.expected = expected
        self.given = given
        super().__init__(f"{argument}: expected {expected}, given {given}")

    def __reduce__(self) -> tuple:
        """Unpickle through ``__init__`` (Ray and multiprocessing send errors between ranks)."""
        return type(self), (self.argument, self.expected, self.given), self.__dict__


class BackendUnavailableError(RuntimeError):
    """No backend (or not the requested one) can run here; lists each refusal with its reason."""

    def __init__(self, kind: str, requested: str, refusals: dict[str, str]) -> None:
        self.kind = kind
        self.requested = requested
        self.refusals = dict(refusals)
        lines = "\n".join(f"  - {name}: {reason}" for name, reason in refusals.items())
        super().__init__(f"no {kind} backend available for {requested!r}:\n{lines}")

    def __reduce__(self) -> tuple:
        """Unpickle through ``__init__`` (Ray and multiprocessing send errors between ranks)."""
        return type(self), (self.kind, self.requested, self.refusals), self.__dict__


class RemoteRankError(RuntimeError):
    """Another rank failed during a forward this rank took part in."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"rank {rank} failed: {reason}")

    def __reduce__(self) -> tuple:
        """Unpickle through ``__init__`` (Ray and multiprocessing send errors between ranks)."""
        return type(self), (self.rank, self.reason), self.__dict__


class ClosedError(RuntimeError):
    """A layer or dispatcher was used after ``close()``."""

    def __reduce__(self) -> tuple:
        """Unpickle with the same message (Ray and multiprocessing send errors between ranks)."""
        return type(self), self.args, self.__dict__
