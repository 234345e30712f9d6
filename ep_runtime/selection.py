"""Backend selection: which (dispatcher, experts, layout) a layer runs with, and why every other
candidate was refused or passed over. Local to one rank; ``agreement.py`` makes the ranks agree."""

from __future__ import annotations

from dataclasses import dataclass, field

from ep_runtime import dispatch as _dispatch_backends  # noqa: F401  (registers dispatchers)
from ep_runtime import experts as _experts_backends  # noqa: F401  (registers experts)
from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher
from ep_runtime.dispatch.setup import DispatchSetup
from ep_runtime.experts.base import EXPERTS, Experts, ExpertsSetup
from ep_runtime.types import BackendUnavailableError, TopkLayout


@dataclass(frozen=True)
class BackendChoice:
    """What was picked, what else could have run (and why it lost), and every refusal."""

    dispatcher: str
    experts: str
    layout: TopkLayout
    refused: dict[str, str] = field(default_factory=dict)  # "kind:name" -> reason
    passed_over: dict[str, str] = field(default_factory=dict)  # "kind:name" -> why not chosen

    def describe(self) -> str:
        lines = [f"dispatcher={self.dispatcher} experts={self.experts} layout={self.layout.value}"]
        lines += [f"  passed over {name}: {reason}" for name, reason in self.passed_over.items()]
        lines += [f"  refused {name}: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def _layouts_to_try(experts_cls: type[Experts], layout: TopkLayout | None) -> list[TopkLayout]:
    if layout is not None:
        return [layout]
    preferred = experts_cls.capabilities.preferred_layout
    return [preferred, *(x for x in TopkLayout if x != preferred)]


def _dispatcher_refusal(
    dispatcher_cls: type[Dispatcher],
    requested: str,
    setup: DispatchSetup,
    layout: TopkLayout | None,
) -> str | None:
    """Why ``dispatcher_cls`` cannot serve ``setup`` in ``layout``, or (``"auto"``) may not."""
    reason = dispatcher_cls.refusal(setup, layout)
    if reason is None and requested == "auto":
        reason = dispatcher_cls.auto_refusal(setup)
    return reason


def _fit(
    experts_cls: type[Experts],
    dispatcher: str,
    layout: TopkLayout | None,
    dispatch_setup: DispatchSetup,
    experts_setup: ExpertsSetup,
) -> tuple[type[Dispatcher], TopkLayout] | str:
    """The first (dispatcher, layout) that ``experts_cls`` runs with, or why there is none."""
    reasons = []
    for candidate_layout in _layouts_to_try(experts_cls, layout):
        reason = experts_cls.refusal(experts_setup, candidate_layout)
        if reason is not None:
            reasons.append(f"layout {candidate_layout.value}: {reason}")
            continue
        for dispatcher_cls in DISPATCHERS.candidates(dispatcher):
            why = _dispatcher_refusal(dispatcher_cls, dispatcher, dispatch_setup, candidate_layout)
            if why is None:
                return dispatcher_cls, candidate_layout
            reasons.append(f"{dispatcher_cls.name} ({candidate_layout.value}): {why}")
    return "no dispatcher fits: " + "; ".join(reasons)


def choose_backends(
    dispatcher: str,
    experts: str,
    layout: TopkLayout | None,
    dispatch_setup: DispatchSetup,
    experts_setup: ExpertsSetup,
) -> tuple[type[Dispatcher], type[Experts], BackendChoice]:
    """Pick (dispatcher, experts, layout): the highest-priority experts backend that runs here
    with some dispatcher, in its preferred layout if a dispatcher supports it. Every candidate
    gets a line in the choice: why it was refused, or why it lost although it could run."""
    refused: dict[str, str] = {}
    runnable: list[tuple[type[Experts], type[Dispatcher], TopkLayout]] = []
    for experts_cls in EXPERTS.candidates(experts):
        reason = experts_cls.refusal(experts_setup, None)
        if reason is None and experts == "auto":
            reason = experts_cls.auto_refusal(experts_setup)
        fit = (
            reason
            if reason is not None
            else _fit(experts_cls, dispatcher, layout, dispatch_setup, experts_setup)
        )
        if isinstance(fit, str):
            refused[f"experts:{experts_cls.name}"] = fit
        else:
            runnable.append((experts_cls, *fit))
    if not runnable:
        raise BackendUnavailableError(
            "experts+dispatcher", f"experts={experts}, dispatcher={dispatcher}", refused
        )
    experts_cls, dispatcher_cls, chosen_layout = runnable[0]
    passed_over = {
        f"experts:{other.name}": (
            f"runs here too; {experts_cls.name} ranks higher for 'auto' "
            f"(priority {experts_cls.auto_priority} > {other.auto_priority})"
        )
        for other, _, _ in runnable[1:]
    }
    for other in DISPATCHERS.candidates(dispatcher):
        if other is dispatcher_cls:
            continue
        why = _dispatcher_refusal(other, dispatcher, dispatch_setup, chosen_layout)
        if why is not None:
            refused[f"dispatcher:{other.name}"] = why
        else:
            passed_over[f"dispatcher:{other.name}"] = (
                f"runs here too; {dispatcher_cls.name} ranks higher for 'auto' "
                f"(priority {dispatcher_cls.auto_priority} > {other.auto_priority})"
            )
    choice = BackendChoice(
        dispatcher_cls.name, experts_cls.name, chosen_layout, refused, passed_over
    )
    return dispatcher_cls, experts_cls, choice
