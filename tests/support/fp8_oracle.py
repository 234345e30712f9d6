"""An fp64 oracle of the fp8 block-scale contract, written here from its formulas and importing
nothing from ep_runtime (not the production twin):

- the weight a block stands for is ``w.float() * scale_inv[block]`` (128×128 blocks);
- activations per token and per 128 columns: ``s = max(amax(|x_group|), 1e-10) / 448`` in fp32,
  ``q = (x_group / s).clamp(-448, 448)`` rounded to e4m3 (nearest even);
- ``out[t] = Σ_k w[t,k] · W2_e · q(act(W13_e · q(x_t)))``.

e4m3fn (bias 7): normal numbers ``1.mmm · 2^e`` for e in [-6, 8] (largest 448 = 1.75·2^8),
subnormals ``0.mmm · 2^-6``; the spacing of representable values at |v| is ``2^(e - 3)`` with
``e = max(floor(log2 |v|), -6)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 128
E4M3_MAX = 448.0
E4M3_MIN_EXPONENT = -6
E4M3_MANTISSA_BITS = 3
AMAX_FLOOR = 1e-10


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp64 → the nearest e4m3 value (ties to even mantissa), as fp64; |v| must be ≤ 448."""
    v = v.double()
    magnitude = v.abs()
    exponent = torch.floor(torch.log2(torch.where(magnitude > 0, magnitude, 1.0)))
    exponent = exponent.clamp_min(E4M3_MIN_EXPONENT)
    spacing = torch.exp2(exponent - E4M3_MANTISSA_BITS)
    return torch.round(v / spacing) * spacing  # torch.round: half to even


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The contract's fp32 scale, ``max(amax, 1e-10) / 448``, computed in fp64 and rounded once to
    fp32 (a correctly rounded fp32 division gives the same value)."""
    return (amax.double().clamp_min(AMAX_FLOOR) / E4M3_MAX).float().double()


def quantize_groups(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [N, K]`` → ``(q [N, K] fp64 e4m3 values, s [N, K/128] fp64 of fp32 scales)``."""
    rows, cols = v.shape
    groups = v.double().view(rows, cols // GROUP, GROUP)
    s = scale_of(groups.abs().amax(dim=2))
    ratio = (groups / s.unsqueeze(2)).float().double()  # x / s in fp32, as the contract says
    q = round_to_e4m3(ratio.clamp(-E4M3_MAX, E4M3_MAX))
    return q.view(rows, cols), s


def fake_quantize(v: torch.Tensor) -> torch.Tensor:
    """``q(v)·s`` in fp64: what a GEMM that consumes ``q(v)`` sees."""
    q, s = quantize_groups(v)
    return q * s.repeat_interleave(GROUP, dim=1)


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``[..., M, K]`` e4m3 and ``[..., M/128, K/128]`` fp32 → fp64 ``w·scale_inv``."""
    full = scale_inv.double().repeat_interleave(GROUP, -2).repeat_interleave(GROUP, -1)
    return w.double() * full


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., M, K]`` → ``(e4m3 values in fp64, fp32 scale_inv [..., M/128, K/128] in fp64)``:
    ``scale_inv = max(amax(|block|), 1e-10) / 448``, values ``w / scale_inv`` to nearest e4m3."""
    *lead, rows, cols = w.shape
    blocks = w.double().reshape(*lead, rows // GROUP, GROUP, cols // GROUP, GROUP)
    s = scale_of(blocks.abs().amax(dim=(-3, -1)))
    ratio = (blocks.float() / s.float().unsqueeze(-1).unsqueeze(-3)).double()
    return round_to_e4m3(ratio.clamp(-E4M3_MAX, E4M3_MAX)).reshape(w.shape), s


def act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        gate, up = h.chunk(2, dim=1)
        return F.silu(gate) * up
    assert activation == "relu2", activation
    return torch.relu(h) ** 2


def fp8_moe_oracle(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] global ids, -1 unused
    topk_weights: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [E, 2I | I, H] e4m3
    w13_scale_inv: torch.Tensor,  # [E, 2I/128 | I/128, H/128]
    w2: torch.Tensor,  # [E, H, I] e4m3
    w2_scale_inv: torch.Tensor,  # [E, H/128, I/128]
    activation: str,
    quantize_activations: bool = True,  # False: the same weights, activations unquantized
    gemm1_output_dtype: torch.dtype | None = None,  # GEMM1's sums rounded to it (a backend's)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H] fp64, scale [T] = Σ_k |w_k|·‖term_k‖)`` for ep_runtime.tolerance. With
    ``gemm1_output_dtype``, the variant of a backend that stores GEMM1's output in that dtype
    before the activation (the activation then runs on the rounded values)."""
    maybe_q = fake_quantize if quantize_activations else (lambda v: v.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    scale = torch.zeros(x.size(0), dtype=torch.float64)
    ids = topk_ids.long()
    for expert in ids[ids >= 0].unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        h = maybe_q(x[tokens]) @ dequantize_blocks(w13[expert], w13_scale_inv[expert]).T
        if gemm1_output_dtype is not None:
            h = h.to(gemm1_output_dtype).double()
        y = maybe_q(act(h, activation)) @ dequantize_blocks(w2[expert], w2_scale_inv[expert]).T
        term = topk_weights[tokens, slots].double().unsqueeze(1) * y
        out.index_add_(0, tokens, term)
        scale.index_add_(0, tokens, term.norm(dim=1))
    return out, scale
