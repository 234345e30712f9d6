"""A rich progress bar over a run's steps, shared by the launchers, shown on a terminal only;
off a terminal (a log, a pipe) transformers' own progress bars are silenced too."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from ep_runtime.launch.spec import Step

# huggingface_hub's switch, read when it is imported; transformers' bars follow it
HF_PROGRESS_BARS_OFF = "HF_HUB_DISABLE_PROGRESS_BARS"


class RunProgress:
    """``with RunProgress(console, steps) as p: p.status("…"); p.done(step)``; draws nothing
    where ``console`` is not a terminal (no carriage returns or bar characters in a log)."""

    def __init__(self, console: Console, steps: list[Step]) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self._task = self._progress.add_task("starting", total=sum(s.work for s in steps) or 1)

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def status(self, text: str) -> None:
        """Show what is happening now (start-up phases before the steps)."""
        self._progress.update(self._task, description=text)

    def done(self, step: Step) -> None:
        self._progress.update(self._task, advance=step.work, description=step.label)


ProgressFactory = Callable[[list[Step]], RunProgress]  # what a launcher is given: steps -> bar


def silence_library_progress_bars() -> None:
    """Off a terminal: no transformers progress bar (``Loading weights``, checkpoint shards) in
    this process or those it starts (they inherit the environment), unless the user set
    ``HF_HUB_DISABLE_PROGRESS_BARS`` otherwise. The variable is read when huggingface_hub is
    imported: where it (or transformers) is imported already, their own switch is thrown."""
    if os.environ.setdefault(HF_PROGRESS_BARS_OFF, "1") != "1":
        return
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()  # huggingface_hub's as well
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
