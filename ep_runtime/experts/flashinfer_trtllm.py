"""FlashInfer TRTLLM-gen routed MoE experts (``trtllm_bf16_routed_moe``), Blackwell SM100/103.

The kernel permutes rows itself (STANDARD is preferred; EXPANDED is the same call with top_k 1),
takes global ids with ``local_expert_offset = rank·L`` and ``local_num_experts = L``, skips -1
slots and ids of other ranks, and writes every row (a row without local slots gets zero).

Weights are converted once, at load: intermediate size padded to a multiple of 128 (gate and up
halves apart), ``[gate; up]`` → ``[up; gate]``, the gated-activation row interleave (gated only),
the 32-row shuffle of ``epilogue_tile_m = 128``, and the ``BlockMajorK`` layout (128-byte K
blocks). This is the recipe of FlashInfer 0.7.2.post1's ``prepare_trtllm_bf16_weights``, in
plain torch (one gather per tensor, any device); a test checks it bitwise against that helper.

TRTLLM variants with quantised weights (fp8 block scale, fp4) subclass this class: they set
``kernel_name``, return their weights and scale arguments in ``TrtllmWeights.kernel_args`` and
their quantised activations from ``activation_args``; the call in ``forward`` stays the one
below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
)
from ep_runtime.experts.flashinfer_common import (
    flashinfer_missing_reason,
    kernel_routing,
    pad_intermediate,
)
from ep_runtime.experts.self_check import self_check_refusal
from ep_runtime.types import Activation, Dispatched, TopkLayout

INTERMEDIATE_ALIGNMENT = (
    128  # launcher: "the second dimension of weights must be a multiple of 128"
)
HIDDEN_ALIGNMENT = 128  # BlockMajorK needs H % 64, the shuffle H % 32; FlashInfer uses 128
BLOCK_K_BYTES = 128  # BlockMajorK block along K
SHUFFLE_BLOCK_ROWS = 32  # row-shuffle block for epilogue_tile_m = 128


def trtllm_kernel(name: str) -> Callable[..., Any]:
    """The FlashInfer function ``name``; the one place the kernel is looked up (tests swap it)."""
    from flashinfer import fused_moe

    return getattr(fused_moe, name)


def shuffle_row_order(num_rows: int) -> torch.Tensor:
    """``[M]`` int64: source row of each row after the ``epilogue_tile_m = 128`` shuffle.

    Within each 32-row block, row ``8a + c`` takes row ``4c + a`` (a 8×4 → 4×8 transpose).
    """
    if num_rows % SHUFFLE_BLOCK_ROWS:
        raise ValueError(f"rows: expected a multiple of {SHUFFLE_BLOCK_ROWS}, given {num_rows}")
    return torch.arange(num_rows).view(-1, 8, 4).transpose(1, 2).reshape(-1)


def gemm1_row_order(num_rows: int, gated: bool) -> torch.Tensor:
    """``[M]`` int64: source row in our ``w13`` (``[gate; up]`` when gated) of each gemm1 row.

    Gated: swap to ``[up; gate]`` and interleave (up₀, gate₀, up₁, gate₁, …), then shuffle.
    Non-gated: shuffle only.
    """
    shuffle = shuffle_row_order(num_rows)
    if not gated:
        return shuffle
    up_gate_interleaved = torch.arange(num_rows).view(2, num_rows // 2).flip(0).t().reshape(-1)
    return up_gate_interleaved[shuffle]


def block_major_k(weights: torch.Tensor) -> torch.Tensor:
    """``[L, M, K]`` → ``[L, K / b, M, b]`` with ``b`` = 128 bytes of elements (64 for bf16)."""
    num_local, rows, depth = weights.shape
    block = BLOCK_K_BYTES // weights.element_size()
    return weights.view(num_local, rows, depth // block, block).permute(0, 2, 1, 3).contiguous()


@dataclass(frozen=True)
class TrtllmWeights:
    """Weights in the kernel's layout, plus the variant's extra kernel arguments (scales)."""

    gemm1: torch.Tensor  # [L, H/64, 2I' | I', 64] bf16, BlockMajorK, shuffled
    gemm2: torch.Tensor  # [L, I'/64, H, 64] bf16, BlockMajorK, shuffled
    intermediate_size: int  # I' = I padded to a multiple of 128
    kernel_args: dict[str, Any] = field(default_factory=dict)  # e.g. weight scales (fp8, fp4)


@EXPERTS.register
class FlashInferTrtllmExperts(Experts):
    """bf16 experts on ``flashinfer.fused_moe.trtllm_bf16_routed_moe`` (SM100/103)."""

    name = "flashinfer_trtllm"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        cuda_archs=frozenset({100, 103}),
        description="FlashInfer TRTLLM-gen routed MoE (bf16), Blackwell",
    )
    auto_priority = 30
    kernel_name: ClassVar[str] = "trtllm_bf16_routed_moe"

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        hidden = setup.config.hidden_size
        if hidden % HIDDEN_ALIGNMENT:
            return f"hidden_size={hidden} is not a multiple of {HIDDEN_ALIGNMENT}"
        return (
            flashinfer_missing_reason()
            or trtllm_cubins_missing_reason()
            or self_check_refusal(cls, setup.device, Activation(setup.config.activation))
        )

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        from flashinfer.tllm_enums import ActivationType, RoutingMethodType, WeightLayout

        self.weights = self.prepare_weights(w13, w2)
        activation = ActivationType.Swiglu if self.activation.is_gated else ActivationType.Relu2
        self._fixed_args = {
            "activation_type": int(activation),
            # Ids are precomputed: the routing stage only sorts them, the method picks no scoring.
            "routing_method_type": int(RoutingMethodType.TopK),
            "use_shuffled_weight": True,
            "weight_layout": int(WeightLayout.BlockMajorK),
        }

    def prepare_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> TrtllmWeights:
        """``w13 [L, 2I | I, H]`` (``[gate; up]``), ``w2 [L, H, I]`` → the kernel's layout."""
        gated = self.activation.is_gated
        w13, w2, intermediate = pad_intermediate(w13, w2, INTERMEDIATE_ALIGNMENT, gated)
        order1 = gemm1_row_order(w13.size(1), gated).to(w13.device)
        order2 = shuffle_row_order(w2.size(1)).to(w2.device)
        return TrtllmWeights(
            gemm1=block_major_k(w13.index_select(1, order1)),
            gemm2=block_major_k(w2.index_select(1, order2)),
            intermediate_size=intermediate,
        )

    def activation_args(
        self, hidden_states: torch.Tensor, scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The kernel's activation arguments for ``hidden_states [R, H]`` (R > 0); quantised
        variants return their quantised rows and scales (``scale [R, H/128]``: the rows arrived
        quantized, fp8 dispatch)."""
        return {"hidden_states": hidden_states}

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        hidden_states = dispatched.hidden_states.contiguous()  # [R, H]
        out = torch.empty(hidden_states.shape, dtype=self.setup.dtype, device=hidden_states.device)
        if hidden_states.size(0) == 0:
            return out
        ids, weights = kernel_routing(dispatched)  # [R, K'] int32, [R, K'] fp32
        placement = self.placement
        trtllm_kernel(self.kernel_name)(
            topk_ids=(ids, weights),
            **self.activation_args(hidden_states, dispatched.hidden_states_scale),
            gemm1_weights=self.weights.gemm1,
            gemm2_weights=self.weights.gemm2,
            num_experts=placement.num_experts,
            top_k=ids.size(1),
            n_group=None,
            topk_group=None,
            intermediate_size=self.weights.intermediate_size,
            local_expert_offset=placement.local_expert_offset,
            local_num_experts=placement.num_local_experts,
            output=out,
            **self._fixed_args,
            **self.weights.kernel_args,
        )
        return out


def trtllm_cubins_missing_reason() -> str | None:
    """Why the TRTLLM-gen batched-GEMM cubins are not all on disk, or None.

    FlashInfer fetches them at first use from NVIDIA's artifactory; offline that is about a
    minute of retries before an ``AssertionError``. Reads only the local manifest: no network.
    """
    from flashinfer.artifacts import ArtifactPath
    from flashinfer.jit import env as jit_env

    root = jit_env.FLASHINFER_CUBIN_DIR / ArtifactPath.TRTLLM_GEN_BMM
    manifest = root / "checksums.txt"
    hint = (
        f"fetch them once where the network allows (`python -m flashinfer download-cubin`), "
        f"then set FLASHINFER_CUBIN_DIR (before flashinfer is imported) to a directory holding "
        f"{ArtifactPath.TRTLLM_GEN_BMM}checksums.txt and the files it lists"
    )
    if not manifest.is_file():
        return f"TRTLLM-gen cubins are not on disk ({manifest} is missing); {hint}"
    listed = [line.split()[-1] for line in manifest.read_text().splitlines() if line.strip()]
    missing = [name for name in listed if not (root / name).is_file()]
    if missing:
        return (
            f"{len(missing)} of {len(listed)} TRTLLM-gen cubin files listed in {manifest} are "
            f"missing (first: {missing[0]}); {hint}"
        )
    return None
