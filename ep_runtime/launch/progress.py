"""A rich progress bar over a run's steps, shared by the launchers."""

from __future__ import annotations

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


class RunProgress:
    """``with RunProgress(console, steps) as p: p.status("…"); p.done(step)``."""

    def __init__(self, console: Console, steps: list[Step]) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
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
