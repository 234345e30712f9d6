"""What a dispatcher is built for: its capabilities, its setup and the peers' agreed identities."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ep_runtime.comm import Comm, PeerIdentity
from ep_runtime.dispatch.protocol import Checks
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import Quantization
from ep_runtime.types import DispatchMode, TopkLayout

DEVICE_CHECKS_ENV = "EP_RUNTIME_CHECKS_ON_DEVICE"


@dataclass(frozen=True)
class DispatcherCapabilities:
    layouts: frozenset[TopkLayout]
    modes: frozenset[DispatchMode]
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    min_world_size: int = 1
    max_world_size: int | None = None  # None: no bound
    # at world size one with device checks nothing is read on the host: CUDA-graph capturable
    graph_capturable: bool = False
    # can be built again on a re-formed group after a rank loss (an elastic layer's backends)
    rebuilds_on_new_group: bool = False

    def refusal(self, setup: DispatchSetup, layout: TopkLayout | None) -> str | None:
        """Why these capabilities do not cover ``setup`` (and ``layout``, when given)."""
        if setup.comm.device.type not in self.device_types:
            return f"runs on {sorted(self.device_types)}, not {setup.comm.device.type}"
        if setup.mode not in self.modes:
            return f"supports modes {sorted(m.value for m in self.modes)}, not {setup.mode.value}"
        if layout is not None and layout not in self.layouts:
            return f"supports layouts {sorted(x.value for x in self.layouts)}, not {layout.value}"
        if setup.dtype not in self.dtypes:
            return f"supports dtypes {sorted(map(str, self.dtypes))}, not {setup.dtype}"
        if setup.comm.world_size < self.min_world_size:
            return f"needs a group of >= {self.min_world_size} ranks, got {setup.comm.world_size}"
        if self.max_world_size is not None and setup.comm.world_size > self.max_world_size:
            return f"runs in a group of <= {self.max_world_size} ranks, got {setup.comm.world_size}"
        if setup.elastic and not self.rebuilds_on_new_group:
            return "cannot be built again on a re-formed group (elastic=...)"
        return None


@dataclass(frozen=True)
class DispatchSetup:
    """Everything a dispatcher instance is built for (and shared by)."""

    comm: Comm
    num_experts: int
    hidden_size: int
    max_top_k: int
    max_tokens_per_rank: int | None  # capacity: the cap; exact: the user's bound per round or None
    dtype: torch.dtype
    mode: DispatchMode
    poison: bool = False  # debug: NaN in padding rows and filler
    # fp8 block-scaled experts: rows travel as the contract's q(x), e4m3 and per-128-column
    # scales (Dispatched.hidden_states_scale), where the dispatcher can send them
    quantization: Quantization | None = None
    # exact mode without peers: ids checked on the device (raised by check()), no host read
    device_checks: bool = False
    elastic: bool = False  # an elastic layer's: backends that rebuild on a re-formed group only

    @property
    def placement(self) -> ExpertPlacement:
        return ExpertPlacement(self.num_experts, self.comm.rank, self.comm.world_size)

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def checks(self) -> Checks:
        """How forwards are checked, decided here only. Capacity mode on CUDA never syncs:
        headers are checked on the device; so does exact mode without peers when asked
        (``device_checks``: nothing else there needs a host read). (Tests set
        ``EP_RUNTIME_CHECKS_ON_DEVICE=1`` to run that path's logic on CPU ranks too.)"""
        on_device = self.device.type == "cuda" or os.environ.get(DEVICE_CHECKS_ENV) == "1"
        deferred = self.mode is DispatchMode.CAPACITY or (
            self.device_checks and not self.comm.has_peers
        )
        return Checks(
            on_device=deferred and on_device,
            peers=self.comm.has_peers,
            exact=self.mode is DispatchMode.EXACT,
        )

    @property
    def checks_on_device(self) -> bool:
        return self.checks.on_device


@dataclass(frozen=True)
class PeerSetup:
    """Agreed by all ranks when the first layer on a dispatcher is built."""

    namespace: str  # the store keys of this dispatcher's notices
    identities: list[PeerIdentity]
