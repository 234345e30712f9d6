"""``LayerSpec``: every option an ``EPMoE`` is built with, checked and resolved, in one object.

The dispatch setup, the experts setup and the settings every rank must agree on (with their
fingerprint, carried in each forward's header) are all derived from it. The settings are read
from the spec's fields (a nested dataclass, the ``MoEConfig``, by each of its fields), so an
option added to the spec, or to ``MoEConfig``, is agreed between ranks without further code.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ep_runtime.comm import Comm
from ep_runtime.config import (
    DEFAULT_MAX_TOKENS_PER_RANK,
    EXACT_MODE_TOKENS_HINT,
    MoEConfig,
    check_token_bound,
)
from ep_runtime.dispatch.protocol import fingerprint_of
from ep_runtime.dispatch.setup import DispatchSetup
from ep_runtime.experts.base import ExpertsSetup
from ep_runtime.placement import ExpertPlacement
from ep_runtime.types import DispatchMode, EPInputError, TopkLayout

AUTO = "auto"
NONE_TEXT = "none_text"  # field metadata: how a None value reads in the settings


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer's options. ``config`` is the caller's ``MoEConfig`` with the compute dtype
    resolved for the device and ``max_tokens_per_rank`` set to the layer's bound (the one place
    it lives): capacity mode's static cap (default ``DEFAULT_MAX_TOKENS_PER_RANK``), or exact
    mode's tokens per round as the user set it (``None``: no bound of theirs). A field left
    ``None`` reads "none" in the settings unless its metadata names another word (the layout
    request: "auto"). Only what every rank is built with is here: the bounds a rank derives
    for itself (free device memory, rounds.py) are not, so they never enter the settings."""

    config: MoEConfig
    mode: DispatchMode
    layout: TopkLayout | None = dataclasses.field(  # requested; None = the backend's preferred
        metadata={NONE_TEXT: AUTO}
    )
    dispatcher: str  # a registered name or "auto"
    experts: str  # a registered name or "auto"
    poison: bool = False  # debug: NaN in padding rows, filler and the output before it is written
    num_redundant_experts: int = 0  # R: expert slots beyond one per logical expert (eplb/)
    eplb_interval: int | None = None  # rebalance every N forwards; None: only when asked
    # exact mode alone (a world of one): ids checked on the device and raised by check(), as in
    # capacity mode, instead of one host read per forward (for ids from route() or an HF
    # router's top-k: always valid)
    device_checks: bool = False
    # built on an ElasticGroup: only backends that can be built again on a re-formed group
    elastic: bool = False

    @classmethod
    def of(
        cls,
        config: MoEConfig,
        device: torch.device,
        *,
        dispatcher: str = AUTO,
        experts: str = AUTO,
        layout: TopkLayout | str = AUTO,
        mode: DispatchMode | str = "exact",
        max_tokens_per_rank: int | None = None,
        poison: bool = False,
        num_redundant_experts: int = 0,
        eplb_interval: int | None = None,
        device_checks: bool = False,
        elastic: bool = False,
    ) -> LayerSpec:
        """The spec of ``EPMoE``'s arguments on ``device``; ``EPInputError`` naming a bad one."""
        try:
            checked_mode = DispatchMode(mode)
        except ValueError:
            raise EPInputError("mode", "'exact' or 'capacity'", mode) from None
        try:
            requested_layout = None if layout == AUTO else TopkLayout(layout)
        except ValueError:
            raise EPInputError("layout", "'auto', 'standard' or 'expanded'", layout) from None
        if config.quantization is not None and (num_redundant_experts or eplb_interval):
            raise EPInputError(
                "num_redundant_experts",
                "0 and no eplb_interval with quantization='fp8_block' (rebalancing moves "
                "unquantized weights only, for now)",
                f"{num_redundant_experts} (eplb_interval={eplb_interval})",
            )
        if elastic and config.quantization is not None:
            raise EPInputError(
                "elastic",
                "a layer with unquantized weights (re-homing moves unquantized weights only)",
                config.quantization,
            )
        cap = config.max_tokens_per_rank if max_tokens_per_rank is None else max_tokens_per_rank
        check_token_bound(cap)
        if cap is None and checked_mode is DispatchMode.CAPACITY:
            cap = DEFAULT_MAX_TOKENS_PER_RANK
        resolved = dataclasses.replace(
            config, dtype=config.resolve_dtype(device), max_tokens_per_rank=cap
        )
        return cls(
            config=resolved,
            mode=checked_mode,
            layout=requested_layout,
            dispatcher=dispatcher,
            experts=experts,
            poison=poison,
            num_redundant_experts=num_redundant_experts,
            eplb_interval=eplb_interval,
            device_checks=bool(device_checks),
            elastic=bool(elastic),
        )

    @property
    def num_slots(self) -> int:
        """Physical expert slots over all ranks, ``E + R``: what dispatchers and experts see."""
        return self.config.num_experts + self.num_redundant_experts

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (resolved: never ``None``)."""
        assert self.config.dtype is not None
        return self.config.dtype

    @property
    def max_tokens_per_rank(self) -> int | None:
        """Capacity mode: the cap (never ``None``); exact mode: the user's tokens per round."""
        return self.config.max_tokens_per_rank

    def dispatch_setup(self, comm: Comm) -> DispatchSetup:
        return DispatchSetup(
            comm=comm,
            num_experts=self.num_slots,
            hidden_size=self.config.hidden_size,
            max_top_k=self.config.top_k,
            max_tokens_per_rank=self.max_tokens_per_rank,
            dtype=self.dtype,
            mode=self.mode,
            poison=self.poison,
            quantization=self.config.quantization,
            device_checks=self.device_checks,
            elastic=self.elastic,
        )

    def experts_setup(self, placement: ExpertPlacement, device: torch.device) -> ExpertsSetup:
        """Exact mode without a bound tells the experts ``EXACT_MODE_TOKENS_HINT`` tokens per
        rank (a prefill): what backends choosing by size go by."""
        slot_config = dataclasses.replace(self.config, num_experts=self.num_slots)
        tokens = self.max_tokens_per_rank or EXACT_MODE_TOKENS_HINT
        return ExpertsSetup(
            slot_config, placement, device, self.dtype, token_cap=tokens, mode=self.mode
        )

    def settings(self) -> dict[str, str]:
        """What every rank must agree on: each field as text, a nested dataclass's fields in its
        place (``hidden_size``, not ``config.hidden_size``), in field order."""
        return _settings_of(self)

    def fingerprint(self) -> int:
        """The 31-bit hash of ``settings()`` that each forward's header carries."""
        return fingerprint_of(self.settings())


def _settings_of(obj: object) -> dict[str, str]:
    settings: dict[str, str] = {}
    for spec_field in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, spec_field.name)
        nested = (
            _settings_of(value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type)
            else {spec_field.name: _as_text(value, spec_field.metadata.get(NONE_TEXT, "none"))}
        )
        clash = settings.keys() & nested.keys()
        if clash:
            raise TypeError(f"{type(obj).__name__}: setting names {sorted(clash)} appear twice")
        settings.update(nested)
    return settings


def _as_text(value: object, none_text: str) -> str:
    if value is None:
        return none_text
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def checked_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a ``torch.device`` this torch can use (a bare ``cuda``: the current one);
    ``None`` stays ``None`` (the group's default device)."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise EPInputError("device", "a torch device such as 'cpu' or 'cuda:0'", device) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EPInputError(
            "device",
            f"a device this torch can use (torch {torch.__version__} has no usable CUDA)",
            device,
        )
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
