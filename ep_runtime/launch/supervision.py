"""Which failure ended the run: the root cause, not a peer's echo of it.

When one rank dies, its peers blocked in a collective fail a few milliseconds later ("Connection
reset by peer", a timeout, or ``RemoteRankError``). Launchers collect every failure seen within a
short grace window and blame the most causal one: a rank that died, then a rank that raised for
its own reasons, then ranks that only report a broken collective.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ep_runtime.launch.spec import RankFailure

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote tracebacks
GRACE_S = 2.0  # how long to keep collecting failures after the first one
COMMUNICATION_MARKERS = (
    "RemoteRankError",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "Socket Timeout",
    "NCCL error",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
    "DistBackendError",
)


class FailureKind(enum.IntEnum):
    """Lower is more causal."""

    DIED = 0  # process exited or was killed
    RAISED = 1  # an exception of the rank's own
    COMMUNICATION = 2  # a collective broke because some other rank failed


@dataclass(frozen=True)
class Failure:
    rank: int
    kind: FailureKind
    detail: str  # traceback or exit description
    order: int  # arrival order, breaks ties


def classify_exception_text(text: str) -> FailureKind:
    return (
        FailureKind.COMMUNICATION
        if any(marker in text for marker in COMMUNICATION_MARKERS)
        else FailureKind.RAISED
    )


def root_failure(
    failures: Sequence[Failure], where: str, still_running: Sequence[int] = ()
) -> RankFailure:
    """The error to report: the most causal failure, listing the others and any silent ranks."""
    root = min(failures, key=lambda f: (f.kind, f.order))
    lines = [ANSI_ESCAPE.sub("", root.detail).rstrip()]
    others = [f for f in failures if f is not root]
    if others:
        lines.append(
            "also failed: "
            + ", ".join(
                f"rank {f.rank} ({f.kind.name.lower()})"
                for f in sorted(others, key=lambda f: f.rank)
            )
        )
    if still_running:
        lines.append(f"still running when the run was ended (hung?): ranks {sorted(still_running)}")
    kind = "died" if root.kind is FailureKind.DIED else "raised"
    return RankFailure(root.rank, f"{kind} during {where}", "\n".join(lines))
