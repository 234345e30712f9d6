"""FP8 block-scaled expert weights (the DeepSeek-V3 format) and dynamic activation quantization.

The contract (docs/fp8.md):

- Weights: e4m3 (``torch.float8_e4m3fn``) with one fp32 ``scale_inv`` per 128×128 block; the
  weight a block stands for is ``w.float() * scale_inv[block]``. ``w13 [E|L, 2I|I, H]`` goes with
  ``w13_scale_inv [E|L, 2I/128|I/128, H/128]``, ``w2 [E|L, H, I]`` with ``w2_scale_inv
  [E|L, H/128, I/128]``. H and I are multiples of 128.
- Activations, dynamically per token and per 128 consecutive columns:
  ``s = max(amax(|x_group|), 1e-10) / 448`` (fp32), ``q = (x_group / s).clamp(-448, 448)`` cast to
  e4m3 (round to nearest even). GEMM1 consumes ``q(x)``, GEMM2 ``q(act(GEMM1))``.

Plain torch on any device: this module is the specification the fp8 kernels match.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

from ep_runtime.types import EPInputError

BLOCK = 128  # weight blocks are BLOCK × BLOCK, activation groups 1 × BLOCK
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_FLOOR = 1e-10  # an all-zero group gets this amax: its scale stays finite, its values 0


class Quantization(str, enum.Enum):
    """How expert weights are stored; ``None`` in ``MoEConfig`` means the compute dtype."""

    FP8_BLOCK = "fp8_block"


def parse_quantization(value: Quantization | str | None) -> Quantization | None:
    """``None``, ``"fp8_block"`` or the enum → the enum (or None); else ``EPInputError``."""
    if value is None:
        return None
    try:
        return Quantization(value)
    except ValueError:
        expected = f"None or one of {[q.value for q in Quantization]}"
        raise EPInputError("quantization", expected, value) from None


def check_block_shapes(hidden_size: int, intermediate_size: int) -> None:
    """fp8 blocks tile H and I exactly."""
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if size % BLOCK:
            raise EPInputError(name, f"a multiple of {BLOCK} (quantization='fp8_block')", size)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-10) / 448``, correctly rounded: the divisor is a tensor on amax's device,
    since torch on CUDA multiplies by the reciprocal of a Python-number divisor (off by an ulp)."""
    return amax.clamp_min(AMAX_FLOOR) / amax.new_full((), FP8_MAX)


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    """fp32 → e4m3, round to nearest even, saturated at ±448 (the cast alone would give NaN)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, K]`` (K a multiple of 128) → ``(q [N, K] e4m3, s [N, K/128] fp32)``."""
    rows, cols = x.shape
    groups = x.float().view(rows, cols // BLOCK, BLOCK)
    scale = _scale_of(groups.abs().amax(dim=2))  # [N, K/128]
    return _to_fp8(groups / scale.unsqueeze(2)).view(rows, cols), scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` e4m3, ``s [N, K/128]`` → ``[N, K]`` fp32 ``q·s``."""
    return q.float() * scale.repeat_interleave(BLOCK, dim=1)


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [N, K]`` → ``[N, K]`` fp32 ``q(x)·s``: what a GEMM that consumes ``q(x)`` sees (an
    oracle applies it to each GEMM's input, ``reference_moe(..., gemm_input=...)``)."""
    return dequantize_activations(*quantize_activations(x))


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., M, K]`` (M, K multiples of 128) → ``(q e4m3 [..., M, K], scale_inv fp32
    [..., M/128, K/128])`` with ``scale_inv = max(amax(|block|), 1e-10) / 448``."""
    *lead, rows, cols = w.shape
    blocks = w.float().reshape(*lead, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = _scale_of(blocks.abs().amax(dim=(-3, -1)))  # [..., M/128, K/128]
    q = _to_fp8(blocks / scale.unsqueeze(-1).unsqueeze(-3))
    return q.reshape(w.shape), scale


def dequantize_weight_blocks(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``q [..., M, K]`` e4m3, ``scale_inv [..., M/128, K/128]`` → fp32 ``q.float()·scale_inv``."""
    full = scale_inv.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return q.float() * full


@dataclass(frozen=True)
class Fp8BlockWeights:
    """One rank's fp8 expert shard as an experts backend receives it (on its device)."""

    w13: torch.Tensor  # [L, 2I | I, H] e4m3, rows [gate; up] when gated
    w13_scale_inv: torch.Tensor  # [L, 2I/128 | I/128, H/128] fp32
    w2: torch.Tensor  # [L, H, I] e4m3
    w2_scale_inv: torch.Tensor  # [L, H/128, I/128] fp32

    def to(self, device: torch.device) -> Fp8BlockWeights:
        moved = {f.name: getattr(self, f.name).detach().to(device) for f in fields(self)}
        return Fp8BlockWeights(**{name: t.contiguous() for name, t in moved.items()})


def check_weight_quantization(
    quantization: Quantization | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
) -> None:
    """Weights and scales fit ``quantization`` (shapes of ``w13``/``w2`` already checked):
    ``EPInputError`` naming ``w13``, ``w2``, ``w13_scale_inv`` or ``w2_scale_inv``."""
    pairs = (("w13", w13, w13_scale_inv), ("w2", w2, w2_scale_inv))
    if quantization is None:
        for name, weight, scale in pairs:
            if scale is not None:
                raise EPInputError(
                    f"{name}_scale_inv", "None (the layer's quantization is None)", "a tensor"
                )
            if weight.dtype == FP8_DTYPE:
                raise EPInputError(
                    name,
                    "weights in a float dtype (fp8 weights need "
                    "MoEConfig(quantization='fp8_block') and their scales)",
                    weight.dtype,
                )
        return
    for name, weight, scale in pairs:
        if weight.dtype != FP8_DTYPE:
            raise EPInputError(name, f"dtype {FP8_DTYPE} (quantization='fp8_block')", weight.dtype)
        *lead, rows, cols = weight.shape
        expected = [*lead, rows // BLOCK, cols // BLOCK]
        what = f"fp32 block scales of shape {expected} (one per {BLOCK}×{BLOCK} block of {name})"
        if scale is None:
            raise EPInputError(f"{name}_scale_inv", what, None)
        if not isinstance(scale, torch.Tensor):
            raise EPInputError(f"{name}_scale_inv", what, type(scale).__name__)
        if list(scale.shape) != expected or scale.dtype != torch.float32:
            raise EPInputError(
                f"{name}_scale_inv", what, f"shape {list(scale.shape)}, dtype {scale.dtype}"
            )
