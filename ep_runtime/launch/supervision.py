"""Which failure ended the run: the root cause, not a peer's echo of it.

When one rank dies, its peers blocked in a collective fail a few milliseconds later ("Connection
reset by peer", a timeout, or ``RemoteRankError``). Launchers collect every failure seen within a
short window and blame the most causal one: a rank that died, then a rank that raised for
its own reasons, then ranks that only report a broken collective.
"""

from __future__ import annotations

import contextlib
import enum
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ep_runtime.launch.spec import RankFailure
from ep_runtime.types import BackendUnavailableError, EPInputError

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote tracebacks
GRACE_S = 2.0  # after a peer's echo, how long to wait for the failure that caused it
# Phrases of an error message that say a *peer* broke the collective. They are looked for in the
# exception messages only, never in the stack frames: every gloo or NCCL set-up traceback passes
# through ``ProcessGroupGloo(`` / ``ProcessGroupNCCL``, whoever is at fault.
ECHO_MARKERS = (
    "RemoteRankError",  # ep_runtime: another rank failed during this forward
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",  # gloo: the peer never sent or received
    "timed out",
    "Socket Timeout",
    "remote process exited",  # NCCL: a peer died
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "collective operation timeout",  # NCCL watchdog
)
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')
USAGE_ERRORS = (EPInputError, BackendUnavailableError)


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
    usage_error: str | None = None  # one line, when the rank rejected its input (see RankFailure)


def window_closed(failures: Sequence[Failure], first_seen: float, now: float) -> bool:
    """Stop collecting once a causal failure (died or raised) is known, or after ``GRACE_S``:
    a rank's own failure is the root cause; only a peer's echo needs the wait."""
    if not failures:
        return False
    return any(f.kind < FailureKind.COMMUNICATION for f in failures) or now - first_seen >= GRACE_S


def exception_messages(text: str) -> str:
    """The lines of a traceback that are not stack frames: the messages of every exception in
    the chain, and the headers around them."""
    kept: list[str] = []
    in_frame = False
    for line in ANSI_ESCAPE.sub("", text).splitlines():
        if _FRAME.match(line):
            in_frame = True
        elif in_frame and line.startswith("    "):  # the frame's source lines and ^^^ markers
            continue
        else:
            in_frame = False
            kept.append(line)
    return "\n".join(kept)


def classify_exception_text(text: str) -> FailureKind:
    """COMMUNICATION when the exception messages say a peer broke the collective, else RAISED:
    the rank's own error (a bad interface name, bad input, a bug) is blamed on that rank."""
    messages = exception_messages(text)
    if any(marker in messages for marker in ECHO_MARKERS):
        return FailureKind.COMMUNICATION
    return FailureKind.RAISED


def usage_error_line(error: BaseException | None) -> str | None:
    """One line for a rank's ``EPInputError`` / ``BackendUnavailableError``, else ``None``."""
    if not isinstance(error, USAGE_ERRORS):
        return None
    text = "; ".join(line.strip().removeprefix("- ") for line in str(error).splitlines())
    return f"{type(error).__name__}: {text}"


def root_failure(
    failures: Sequence[Failure], where: str, still_running: Sequence[int] = ()
) -> RankFailure:
    """The error to report: the most causal failure, listing the others and any silent ranks.

    When every failure is an echo (peers timed out in a collective) and some rank never
    answered, that rank is the one to blame: it hung or desynchronised while its peers waited.
    """
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
    if root.kind is FailureKind.COMMUNICATION and still_running:
        culprit = min(still_running)
        lines.insert(0, f"rank {culprit} never answered; rank {root.rank} gave up waiting for it:")
        return RankFailure(culprit, f"hung during {where}", "\n".join(lines))
    if still_running:
        lines.append(
            f"still running when the run was ended (blocked in a collective): "
            f"ranks {sorted(still_running)}"
        )
    kind = "died" if root.kind is FailureKind.DIED else "raised"
    return RankFailure(root.rank, f"{kind} during {where}", "\n".join(lines), root.usage_error)


_STOP = threading.Event()


def _request_stop(signum: int, frame: object) -> None:
    if _STOP.is_set():  # a second Ctrl-C: interrupt at once
        raise KeyboardInterrupt
    _STOP.set()


def install_stop_handlers() -> None:
    """Ctrl-C and SIGTERM only set a flag; ``raise_if_stop_requested`` turns it into
    ``KeyboardInterrupt`` between polls, so no signal lands inside a Ray call (an interrupted
    ``ray.wait`` followed by ``ray.shutdown`` segfaulted at exit here). Ray's ``init`` installs
    its own SIGTERM handler, so launchers call this again after it."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _request_stop)


def raise_if_stop_requested() -> None:
    if _STOP.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def stop_handlers() -> Iterator[None]:
    """Install the handlers for the duration of a run (main thread only), then restore."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _STOP.clear()
    install_stop_handlers()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
