"""ep_runtime: expert-parallel Mixture-of-Experts across ranks (forward/inference only)."""

from ep_runtime.config import MoEConfig
from ep_runtime.forward_graphs import GraphPolicy
from ep_runtime.layer import EPMoE
from ep_runtime.reference import reference_moe
from ep_runtime.routing import route
from ep_runtime.types import (
    Activation,
    BackendUnavailableError,
    ClosedError,
    Dispatched,
    DispatchMode,
    EPInputError,
    RemoteRankError,
    TopkLayout,
)

__all__ = [
    "Activation",
    "BackendUnavailableError",
    "ClosedError",
    "DispatchMode",
    "Dispatched",
    "EPInputError",
    "EPMoE",
    "GraphPolicy",
    "MoEConfig",
    "RemoteRankError",
    "TopkLayout",
    "reference_moe",
    "route",
]
