"""Types that cross module boundaries: layouts, modes, the ``Dispatched`` hand-off, and errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeVar

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


@dataclass(frozen=True)
class Dispatched:
    """What a dispatcher hands to the experts: only what some experts backend reads.

    A row is padding iff all its ids are -1; padding may hold anything (NaN included), and the
    experts' output rows for padding are never read.
    """

    hidden_states: torch.Tensor  # [R, H] received rows, compute dtype or e4m3 (may be strided)
    topk_ids: torch.Tensor  # [R, K'] int32 global ids, -1 = slot not served here
    topk_weights: torch.Tensor  # [R, K'] float32 (read only where the id is not -1)
    layout: TopkLayout
    expert_offsets: torch.Tensor | None  # [L + 1] int32 group starts (EXPANDED), else None
    handle: Any = None  # backend-private, consumed by combine
    # fp8 dispatch: [R, H/128] fp32 scales of e4m3 ``hidden_states`` (the contract's q(x), one
    # per token and 128 columns); None: the rows are in the compute dtype
    hidden_states_scale: torch.Tensor | None = None

    @property
    def top_k(self) -> int:
        """The K the expert kernel must be told: always the tensor's, never the config's."""
        return self.topk_ids.size(1)


EnumT = TypeVar("EnumT", bound=enum.Enum)


def enum_argument(kind: type[EnumT], argument: str, value: object) -> EnumT:
    """``kind(value)``, or an ``EPInputError`` naming ``argument`` and ``kind``'s values."""
    try:
        return kind(value)
    except ValueError:
        raise EPInputError(argument, f"one of {[m.value for m in kind]}", value) from None


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


class ForwardMismatchError(RuntimeError):
    """Ranks are not in the same forward: one skipped or repeated a forward, or ranks call
    layers in different orders. Raised on every rank, naming the ranks that differ."""

    def __init__(self, differing: dict[int, str], here: str) -> None:
        self.differing = dict(differing)
        self.here = here
        ranks = "; ".join(f"rank {rank} {what}" for rank, what in sorted(differing.items()))
        super().__init__(
            f"forwards do not match across ranks: {ranks}, while {here}. A rank skipped or "
            "repeated a forward (or a placement change), the ranks call layers in different "
            "orders, or their placements differ"
        )

    def __reduce__(self) -> tuple:
        """Unpickle through ``__init__`` (Ray and multiprocessing send errors between ranks)."""
        return type(self), (self.differing, self.here), self.__dict__


class GroupUnusableError(RuntimeError):
    """The dispatcher's process group is out of step after a peer failed or left."""
