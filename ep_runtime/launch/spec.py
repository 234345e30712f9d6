"""What a run is: the launcher's fields and one ``Workload`` (``RunSpec``, picklable, sent to
every rank), the collective ``Step`` s a workload is made of, and how a failed run is reported.

A workload is three things: its ``plan`` (the steps, identical on every rank), a ``worker`` per
rank (an object whose methods are the steps) and ``finish`` (validate, print and write the
report in the launching process). ``launch/layer_run.py`` (one synthetic layer, the default),
``launch/elastic_run.py`` (that layer on an elastic group that loses ranks, ``--elastic``) and
``launch/hf_run.py`` (a transformers model, ``--hf-model``) are the workloads; the launchers
(Ray, spawn, torchrun) and the rank runtime (``launch/rank.py``) know only this interface.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from rich.console import Console

    from ep_runtime.comm import Comm
    from ep_runtime.elastic import ElasticGroup

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype | None:
    """``--dtype``: ``None`` for ``auto`` (the layer chooses: bf16 on CUDA, fp32 on CPU)."""
    return None if name == "auto" else DTYPES[name]


@dataclass(frozen=True)
class Step:
    """One collective step: ``<the workload's rank worker>.<method>(*args)``; ``work`` units
    for progress bars."""

    method: str
    args: tuple
    work: int
    label: str


@dataclass(frozen=True)
class RankContext:
    """What a workload's rank worker gets from the rank runtime, once its process group is up."""

    spec: RunSpec
    rank: int
    device: torch.device
    comm: Comm
    node_ip: str | None = None
    interfaces: dict[str, dict[str, str | None]] = field(default_factory=dict)
    elastic: ElasticGroup | None = None  # the group, where the workload forms one

    def describe(self) -> dict:
        """Where this rank runs and which interface each backend was told to use (and by whom)."""
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "node_ip": self.node_ip,
            "interfaces": self.interfaces,
        }


class WorkloadWorker(Protocol):
    """One rank's part of a workload: a method per ``Step.method`` of its plan, and ``close``.
    The last step returns the rank's summary (a picklable dict)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunOutcome:
    """A run that every rank finished: what ``Workload.finish`` reports on."""

    launcher: str
    summaries: list[dict]  # the last step's result of every rank, by rank (an elastic run: of
    # every survivor, by original rank; the ranks it was told to lose have none)
    elapsed_s: float
    reports_here: bool  # this process prints and writes the report (torchrun: rank 0 only)
    json_path: str | None = None
    plot_path: str | None = None


class Workload(ABC):
    """What the ranks run (a frozen dataclass in each implementation: it travels to the ranks)."""

    @abstractmethod
    def plan(self) -> list[Step]:
        """The collective steps, identical on every rank."""

    @abstractmethod
    def worker(self, context: RankContext) -> WorkloadWorker:
        """This rank's worker; no CUDA work before its first step."""

    @abstractmethod
    def finish(self, spec: RunSpec, outcome: RunOutcome, console: Console) -> bool:
        """Validate what needs the launching process, print and write the report; whether the
        run passed (a process that does not report answers True)."""

    @abstractmethod
    def to_json(self) -> dict:
        """The workload's fields, for the JSON report."""

    @property
    def forms_elastic_group(self) -> bool:
        """The ranks form an ``ElasticGroup`` on the launcher's store (``--elastic``) instead of
        a plain process group."""
        return False

    @property
    def killed_ranks(self) -> frozenset[int]:
        """Ranks the workload kills itself (``--kill-rank``): their death is expected, the
        launcher goes on with the others."""
        return frozenset()

    @property
    def reporting_rank(self) -> int:
        """The rank whose steps drive the progress bar: the lowest one not killed."""
        rank = 0
        while rank in self.killed_ranks:
            rank += 1
        return rank


@dataclass(frozen=True)
class RunSpec:
    """The launcher's fields and the workload, identical on every rank."""

    world_size: int
    device: str  # "cpu" or "cuda", resolved by the launcher
    workload: Workload
    timeout_s: float = 60.0  # every collective; a desync fails instead of hanging

    def to_json(self) -> dict:
        launcher = {"world_size": self.world_size, "device": self.device}
        return launcher | {"timeout_s": self.timeout_s} | self.workload.to_json()


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
