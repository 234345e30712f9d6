"""What a run is (``RunSpec``, picklable, sent to every rank) and how a failed run is reported."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from ep_runtime.launch.presets import ModelPreset

if TYPE_CHECKING:
    from ep_runtime.launch.hf_run import HFRun

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FAILURE_KINDS = ("raise", "input", "exit", "kill", "hang")


@dataclass(frozen=True)
class FailureInjection:
    """Test hook: make ``rank`` fail at timed iteration ``iteration`` of the first layout.

    raise: a Python exception; input: ``EPInputError``, as a backend rejecting its input;
    exit: ``os._exit(1)``; kill: SIGKILL itself; hang: sleep forever.
    """

    rank: int
    kind: str
    iteration: int = 0

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
class RunSpec:
    """Everything a rank needs to build and run its part, identical on every rank."""

    model: ModelPreset
    world_size: int
    device: str  # "cpu" or "cuda", resolved by the launcher
    dtype: str  # "auto", "bf16" or "fp32"
    dispatcher: str = "auto"
    experts: str = "auto"
    layouts: tuple[str, ...] = ("auto",)  # one layer per entry, run one after the other
    mode: str = "exact"
    iters: int = 10
    warmup: int = 3
    seed: int = 0
    validate_tokens: int = 64  # per rank; 0 = every token
    baselines: bool = True
    timeout_s: float = 60.0  # every collective; a desync fails instead of hanging
    inject_failure: FailureInjection | None = None
    hf: HFRun | None = None  # --hf-model: a transformers model generating (launch/hf_run.py)

    def torch_dtype(self) -> torch.dtype | None:
        """``None`` lets ``MoEConfig`` choose (bf16 on CUDA, fp32 on CPU)."""
        return None if self.dtype == "auto" else DTYPES[self.dtype]

    def to_json(self) -> dict:
        data = asdict(self)
        data["model"] = self.model.to_json()
        return data


def resolve_device(requested: str, world_size: int, gpus: float, where: str) -> str:
    """``--device``: ``auto`` is CUDA when ``gpus`` (visible to the launcher, ``where``) give
    every rank one, else CPU; ``cuda`` with too few GPUs cannot start."""
    if requested == "cuda" and gpus < world_size:
        raise LaunchError(
            f"--device cuda: expected a GPU per rank ({world_size}), given {gpus:g} GPUs on {where}"
        )
    if requested == "auto":
        return "cuda" if gpus >= world_size else "cpu"
    return requested


class RankFailure(RuntimeError):
    """A rank raised or died: the run was ended; ``rank`` is the first one that failed.

    ``usage_error`` is set when that rank rejected its input or found no backend
    (``EPInputError``, ``BackendUnavailableError``): one line naming the argument, printed
    instead of the traceback (exit 2)."""

    def __init__(
        self, rank: int | None, where: str, detail: str, usage_error: str | None = None
    ) -> None:
        self.rank = rank
        self.where = where
        self.detail = detail
        self.usage_error = usage_error
        who = "a rank" if rank is None else f"rank {rank}"
        super().__init__(f"{who} ({where}) failed:\n{detail}")

    def __reduce__(self) -> tuple:
        return type(self), (self.rank, self.where, self.detail, self.usage_error), self.__dict__


class LaunchError(RuntimeError):
    """The run could not start (no cluster, not enough GPUs or CPUs, an unwritable output);
    no rank failed."""
