"""The experts protocol: compute ``Σ_k w_k · FFN_k(x)`` over a rank's local slots.

Contract (docs/architecture.md, "The data contract"): take top_k from ``topk_ids.size(1)``,
read ids as int32, write every row that has a served slot (padding rows' results are never read,
and padding may hold NaN), apply router weights exactly once. Weight conversion happens once, in
``load_weights``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from ep_runtime.config import MoEConfig
from ep_runtime.kernels.fp8_quant import triton_quantize_rows
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import BLOCK, FP8_DTYPE, Fp8BlockWeights, Quantization
from ep_runtime.registry import Registry
from ep_runtime.types import Activation, Dispatched, DispatchMode, EPInputError, TopkLayout


@dataclass(frozen=True)
class ExpertsCapabilities:
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    activations: frozenset[Activation]
    layouts: frozenset[TopkLayout]
    preferred_layout: TopkLayout
    cuda_archs: frozenset[int] | None = None  # allowed SM majors*10+minor; None = any
    quantizations: frozenset[Quantization | None] = frozenset({None})  # None = compute dtype
    # a forward reads no device value on the host: the layer may replay it as a CUDA graph
    graph_capturable: bool = False
    # fp8 layers: the dtype GEMM1's fp32 sums are stored in before the activation (None: they
    # stay fp32, as the contract says; a backend that rounds them declares it, and is tested so)
    gemm1_output_dtype: torch.dtype | None = None
    # unquantized weights: it computes with the very tensors load_weights gets (no conversion,
    # no copy), so a placement change writes moved experts into them in place (eplb/transaction)
    serves_given_weights: bool = False
    description: str = ""


@dataclass(frozen=True)
class ExpertsSetup:
    config: MoEConfig
    placement: ExpertPlacement
    device: torch.device
    dtype: torch.dtype
    # tokens per rank per round the backend sizes for: capacity mode's cap; exact mode's bound, or
    # without one the layer's EXACT_MODE_TOKENS_HINT (a prefill)
    token_cap: int
    # capacity mode promises forwards without host reads (CUDA graphs); exact mode syncs anyway
    mode: DispatchMode = DispatchMode.EXACT


def cuda_arch(device: torch.device) -> int | None:
    """SM version as ``major*10 + minor`` (90 = Hopper, 100 = Blackwell), None off CUDA."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


class Experts(abc.ABC):
    """One expert-compute backend for a rank's shard of ``L`` local experts."""

    name: ClassVar[str]
    capabilities: ClassVar[ExpertsCapabilities]
    auto_priority: ClassVar[int] = 0

    def __init__(self, setup: ExpertsSetup) -> None:
        self.setup = setup
        self.config = setup.config
        self.placement = setup.placement
        self.activation = Activation(setup.config.activation)

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        """Why it cannot run for ``setup`` (package, cubins, shapes), beyond capabilities."""
        return None

    @classmethod
    def refusal(cls, setup: ExpertsSetup, layout: TopkLayout | None) -> str | None:
        caps = cls.capabilities
        if setup.device.type not in caps.device_types:
            return f"runs on {sorted(caps.device_types)}, not {setup.device.type}"
        arch = cuda_arch(setup.device)
        if caps.cuda_archs is not None and arch not in caps.cuda_archs:
            return f"needs SM {sorted(caps.cuda_archs)}, this device is SM{arch}"
        if setup.dtype not in caps.dtypes:
            return f"supports dtypes {sorted(map(str, caps.dtypes))}, not {setup.dtype}"
        activation = Activation(setup.config.activation)
        if activation not in caps.activations:
            supported = sorted(a.value for a in caps.activations)
            return f"supports activations {supported}, not {activation.value}"
        if setup.config.quantization not in caps.quantizations:
            supported = sorted(str(getattr(q, "value", q)) for q in caps.quantizations)
            given = getattr(setup.config.quantization, "value", None)
            return f"supports quantizations {supported}, not {given}"
        if layout is not None and layout not in caps.layouts:
            return f"supports layouts {sorted(x.value for x in caps.layouts)}, not {layout.value}"
        return cls.unavailable_reason(setup)

    @classmethod
    def auto_refusal(cls, setup: ExpertsSetup) -> str | None:
        """Why ``"auto"`` must not pick it although it can run (named explicitly, it runs)."""
        return None

    @abc.abstractmethod
    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take this rank's shard, ``w13 [L, 2I or I, H]`` and ``w2 [L, H, I]`` in the compute
        dtype, and convert once to whatever layout the kernel wants."""

    def load_quantized_weights(self, weights: Fp8BlockWeights) -> None:
        """Take this rank's fp8 block-scaled shard (on the device, checked). Only backends whose
        capabilities list the config's quantization are chosen, so only they implement it."""
        raise NotImplementedError(f"experts backend {self.name!r} takes no quantized weights")

    @abc.abstractmethod
    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        """``[R, H]`` in the compute dtype; row r = Σ over its non-(-1) slots of w·FFN(x_r)
        (rows without a served slot may hold anything: nothing reads them)."""

    def workspace_bytes(self, max_rows: int) -> int:
        """Scratch memory the backend needs for ``max_rows`` dispatched rows (allocated once)."""
        return 0

    def release_workspace(self) -> None:
        """Drop work buffers cached across forwards, so the next forward allocates its own: the
        layer calls it before capturing a CUDA graph, which then owns them (a buffer grown
        later cannot free memory the graph writes). Backends that cache none do nothing."""
        return None


def check_expert_weights(
    w13: torch.Tensor, w2: torch.Tensor, config: MoEConfig, num_experts: int
) -> None:
    """Shapes of ``w13 [E', 2I|I, H]`` and ``w2 [E', H, I]`` for ``E'`` experts."""
    H, I = config.hidden_size, config.intermediate_size  # noqa: E741
    expected13 = (num_experts, config.w13_rows, H)
    if tuple(w13.shape) != expected13:
        raise EPInputError("w13", f"shape {list(expected13)}", list(w13.shape))
    expected2 = (num_experts, H, I)
    if tuple(w2.shape) != expected2:
        raise EPInputError("w2", f"shape {list(expected2)}", list(w2.shape))


class WorkBuffers:
    """Named work buffers of one backend: each grows to the largest request and is reused
    across forwards (``clear`` drops them, so a CUDA graph captured next owns its own)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, width]`` view of buffer ``name``."""
        held = self._held.get(name)
        if held is None or held.size(0) < rows:
            held = torch.empty(max(rows, 1), width, dtype=dtype, device=self.device)
            self._held[name] = held
        return held[:rows]

    def clear(self) -> None:
        self._held.clear()


def quantized_rows(
    dispatched: Dispatched, buffers: WorkBuffers
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q(x)``: ``([R, H] e4m3, [R, H/128] fp32)``, as dispatched (fp8 dispatch) or quantized
    here into ``buffers`` (one launch of ``kernels/fp8_quant.py``)."""
    hidden = dispatched.hidden_states
    if dispatched.hidden_states_scale is not None:
        return hidden, dispatched.hidden_states_scale
    rows, width = hidden.shape
    q = buffers.get("x_q", rows, width, FP8_DTYPE)
    return triton_quantize_rows(hidden, q, buffers.get("x_s", rows, width // BLOCK, torch.float32))


EXPERTS: Registry[type[Experts]] = Registry("experts")
