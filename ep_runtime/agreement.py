"""Cross-rank agreement when a layer is built: one all-gather in which every rank shows its
settings (``LayerSpec.settings()``), its backend choice and its identity; all ranks go on, or all
raise naming the setting (or the choice) and each rank's value."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ep_runtime.comm import Comm, PeerIdentity
from ep_runtime.dispatch.base import Dispatcher
from ep_runtime.dispatch.setup import DispatchSetup, PeerSetup
from ep_runtime.experts.base import Experts, ExpertsSetup
from ep_runtime.layer_spec import LayerSpec
from ep_runtime.placement import ExpertPlacement
from ep_runtime.selection import BackendChoice, choose_backends
from ep_runtime.types import BackendUnavailableError, EPInputError

Chosen = tuple[type[Dispatcher], type[Experts], BackendChoice]


@dataclass(frozen=True)
class _BuildReport:
    """What each rank contributes when a layer is built (one all-gather)."""

    settings: dict[str, str]
    choice: tuple[str, str, str] | str  # (dispatcher, experts, layout) or the refusal
    identity: PeerIdentity
    nonce: str


def agree_on_build(
    comm: Comm, spec: LayerSpec, chosen: Chosen | BackendUnavailableError
) -> PeerSetup:
    """One all-gather: every rank must have the same settings and run the same backends (their
    collectives must match), or all raise, naming the setting (or choice) and the ranks."""
    settings = spec.settings()
    summary = (
        chosen
        if isinstance(chosen, BackendUnavailableError)
        else (chosen[2].dispatcher, chosen[2].experts, chosen[2].layout.value)
    )
    own = _BuildReport(
        settings,
        summary if isinstance(summary, tuple) else f"no backend: {summary}",
        PeerIdentity.of_this_process(),
        uuid.uuid4().hex,
    )
    reports = comm.all_gather_object(own)
    for key in settings:
        values = [report.settings.get(key) for report in reports]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {rank} = {value}" for rank, value in enumerate(values))
            raise EPInputError(key, "the same value on every rank", per_rank)
    choices = [report.choice for report in reports]
    if any(isinstance(c, tuple) for c in choices) and len(set(map(str, choices))) > 1:
        per_rank = "\n".join(f"  rank {rank}: {c}" for rank, c in enumerate(choices))
        raise BackendUnavailableError(
            "experts+dispatcher",
            f"experts={spec.experts}, dispatcher={spec.dispatcher}",
            {"ranks disagree": f"every rank must run the same backends:\n{per_rank}"},
        )
    if isinstance(chosen, BackendUnavailableError):
        raise chosen
    return PeerSetup(
        namespace=f"ep_runtime/{reports[0].nonce}",
        identities=[report.identity for report in reports],
    )


@dataclass(frozen=True)
class AgreedBuild:
    """A layer's backends as every rank agreed them, with the setups they are built for."""

    dispatcher: type[Dispatcher]
    experts: type[Experts]
    choice: BackendChoice
    dispatch_setup: DispatchSetup
    experts_setup: ExpertsSetup
    peer_setup: PeerSetup


def agreed_backends(comm: Comm, spec: LayerSpec) -> AgreedBuild:
    """Pick the backends for ``spec`` on ``comm`` (``selection.py``) and agree on them and the
    settings with every rank (``agree_on_build``). Backends see physical slots."""
    dispatch_setup = spec.dispatch_setup(comm)
    slot_placement = ExpertPlacement(spec.num_slots, comm.rank, comm.world_size)
    experts_setup = spec.experts_setup(slot_placement, comm.device)
    try:
        chosen: Chosen | BackendUnavailableError = choose_backends(
            spec.dispatcher, spec.experts, spec.layout, dispatch_setup, experts_setup
        )
    except BackendUnavailableError as error:
        chosen = error
    peer_setup = agree_on_build(comm, spec, chosen)
    assert not isinstance(chosen, BackendUnavailableError)
    dispatcher_cls, experts_cls, choice = chosen
    return AgreedBuild(
        dispatcher_cls, experts_cls, choice, dispatch_setup, experts_setup, peer_setup
    )
