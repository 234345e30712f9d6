"""``weighted_activation``: the experts' activation and router weight, in fp32, rounded once.

The torch function is the spec (and the CPU path); the Triton one equals it but for silu,
which may differ in the last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ep_runtime.kernels.triton_common import (
    cdiv,
    exp_fp32,
    kernel,
    rounded,
    row_block,
    stride_units,
    tl,
)


def torch_weighted_activation(
    h: torch.Tensor,  # [N, 2I] gated ([gate | up]) or [N, I], compute dtype
    weights: torch.Tensor,  # [N] fp32 router weight per row
    *,
    gated: bool,
) -> torch.Tensor:
    """``[N, I]``: ``silu(gate)·up·w`` or ``relu(h)²·w``, in fp32, rounded once to h's dtype."""
    h32 = h.float()
    if gated:
        half = h32.size(1) // 2
        activated = F.silu(h32[:, :half]) * h32[:, half:]
    else:
        activated = torch.relu(h32).square()
    return (activated * weights.unsqueeze(1)).to(h.dtype)


# --------------------------------------------------------------------------- Triton
@kernel
def _activation_kernel(
    h,  # [N, 2I] ([gate | up]) or [N, I]
    h_rows,  # row stride in units of H_UNIT elements
    h_stride_i,
    weights,  # [N] fp32
    out,  # [N, I], contiguous
    width_units,  # I in units of W_UNIT elements
    GATED: tl.constexpr,
    H_UNIT: tl.constexpr,
    W_UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, block of I): fp32 math, one rounding."""
    row = tl.program_id(0).to(tl.int64)
    width = width_units * W_UNIT
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < width
    first = h + row * h_rows * H_UNIT + i * h_stride_i
    weight = tl.load(weights + row)
    if GATED:
        gate = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(first + width * h_stride_i, mask=ok, other=0.0).to(tl.float32)
        activated = tl.math.div_rn(gate, 1.0 + exp_fp32(-gate)) * up  # silu(gate)·up, as torch
    else:
        value = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        relu = tl.where(value < 0.0, 0.0, value)  # NaN stays NaN, as torch.relu
        activated = relu * relu
    result = activated * weight
    tl.store(out + row * width + i, rounded(result, out.dtype.element_ty), mask=ok)


def triton_weighted_activation(
    h: torch.Tensor,  # [N, 2I] gated ([gate | up]) or [N, I], compute dtype
    weights: torch.Tensor,  # [N] fp32 router weight per row
    *,
    gated: bool,
) -> torch.Tensor:
    """``[N, I]``: ``silu(gate)·up·w`` or ``relu(h)²·w``, in fp32, rounded once to h's dtype
    (one launch). silu may differ from torch's in the last bits."""
    num_rows = h.size(0)
    width = h.size(1) // 2 if gated else h.size(1)
    out = torch.empty(num_rows, width, dtype=h.dtype, device=h.device)
    if num_rows and width:
        block, warps = row_block(width, h.element_size())
        h_rows, h_unit = stride_units(h.stride(0), h.element_size())
        width_units, w_unit = stride_units(width, h.element_size())
        _activation_kernel[(num_rows, cdiv(width, block))](
            h,
            h_rows,
            h.stride(1),
            weights,
            out,
            width_units,
            GATED=gated,
            H_UNIT=h_unit,
            W_UNIT=w_unit,
            BLOCK=block,
            num_warps=warps,
        )
    return out
