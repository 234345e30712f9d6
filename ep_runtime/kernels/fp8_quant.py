"""Dynamic fp8 activation quantization on the device: the contract's quantizer
(``ep_runtime/quantization.py``, ``quantize_activations`` is the torch spec) as Triton code.

Per token and per 128 consecutive columns: ``s = max(amax, 1e-10) / 448`` (fp32, correctly
rounded division), ``q = clamp(x / s, ±448)`` rounded to e4m3 (nearest even). The device
helpers here are shared by the fp8 pack kernel (``kernels/pack.py``) and GEMM1's epilogue
(``experts/gemm/expert_gemm_fp8.py``); ``triton_quantize_rows`` is the standalone kernel (rows that
arrive unquantized, and the rows a dispatcher sends as ``q(x)``), ``torch_quantize_rows`` its
twin. Bitwise equal to the spec: the divisions are ``div_rn`` and the cast is
round-to-nearest-even, done on the bits under the interpreter (whose cast rounds ties up and
flushes subnormals).
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.triton_common import INTERPRET, cdiv, jit, kernel, pow2, tl
from ep_runtime.quantization import AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX, quantize_activations

MAX_GROUPS = 16  # groups of 128 columns one program quantizes (2048 columns)


@jit
def to_e4m3(v):
    """fp32 ``v`` (|v| ≤ 448) → e4m3, round to nearest even. Under the interpreter on the bits:
    a normal value keeps 3 of fp32's 23 mantissa bits (ties to even), its exponent rebiased
    127 → 7; below 2^-6 the subnormal code is ``rint(|v|·2^9)`` (the fp32 ``+2^23`` trick)."""
    if INTERPRET:
        magnitude = tl.abs(v)
        sign = (v.to(tl.uint32, bitcast=True) >> 24) & 0x80
        bits = magnitude.to(tl.uint32, bitcast=True)
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) >> 20) - ((127 - 7) << 3)
        subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
        code = tl.where(magnitude < 0.015625, subnormal, normal) | sign
        y = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        y = v.to(tl.float8e4nv)
    return y


@jit
def quantize_groups(values, axis: tl.constexpr):
    """fp32 ``values`` whose ``axis`` is one 128-column group → ``(q e4m3, s fp32)`` with ``s``
    reduced over ``axis``."""
    amax = tl.max(tl.abs(values), axis=axis)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
    ratio = tl.math.div_rn(values, tl.expand_dims(scale, axis))
    ratio = tl.minimum(tl.maximum(ratio, -448.0), 448.0)
    return to_e4m3(ratio), scale


@kernel
def _quantize_kernel(
    x,  # [N, K] compute dtype
    stride_x,
    q,  # [N, K] e4m3
    stride_q,
    s,  # [N, K/128] fp32
    stride_s,
    num_groups,  # K / 128
    GP: tl.constexpr,  # groups per program (a power of two)
    GROUP: tl.constexpr,
):
    """Program (row, block of GP groups)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GP + tl.arange(0, GP)
    c = tl.arange(0, GROUP)
    ok = g < num_groups
    cols = g[:, None] * GROUP + c[None, :]  # [GP, GROUP]
    values = tl.load(x + row * stride_x + cols, mask=ok[:, None], other=0.0).to(tl.float32)
    codes, scale = quantize_groups(values, 1)
    tl.store(q + row * stride_q + cols, codes, mask=ok[:, None])
    tl.store(s + row * stride_s + g, scale, mask=ok)


def torch_quantize_rows(
    x: torch.Tensor,  # [N, K] compute dtype, K a multiple of 128
    q: torch.Tensor,  # [N, K] e4m3 out
    s: torch.Tensor,  # [N, K/128] fp32 out
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: ``quantize_activations(x)`` written into ``(q, s)``."""
    if x.size(0):
        values, scales = quantize_activations(x)
        q.copy_(values)
        s.copy_(scales)
    return q, s


def triton_quantize_rows(
    x: torch.Tensor,  # [N, K] compute dtype (rows may be strided), K a multiple of 128
    q: torch.Tensor,  # [N, K] e4m3 out
    s: torch.Tensor,  # [N, K/128] fp32 out
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_quantize_rows`` as one launch, bitwise equal."""
    rows, cols = x.shape
    assert cols % BLOCK == 0 and x.stride(1) == 1 and q.dtype == FP8_DTYPE
    num_groups = cols // BLOCK
    if rows == 0 or num_groups == 0:
        return q, s
    per_program = min(pow2(num_groups), MAX_GROUPS)
    grid = (rows, cdiv(num_groups, per_program))
    _quantize_kernel[grid](
        x,
        x.stride(0),
        q,
        q.stride(0),
        s,
        s.stride(0),
        num_groups,
        GP=per_program,
        GROUP=BLOCK,
        num_warps=4,
    )
    return q, s


assert (AMAX_FLOOR, FP8_MAX) == (1e-10, 448.0)  # the constants the kernels spell out
