"""Per-token acceptance tolerance, derived from the rounding steps on the compute path.

Path (docs/architecture.md, "Precision"): x and weights are given in the compute dtype; each
GEMM accumulates in fp32 and rounds its output once (w13·x, then w2·h), the activation rounds
once, the sum over a row's local slots rounds once, and the cross-rank combine rounds once: at
most 5 roundings, each a relative error ≤ u (the dtype's unit roundoff). We allow 8u, i.e. 5u
plus margin for the activation's own error growth. fp32 accumulation over a dot product of
length n adds about √n·u32 per GEMM in practice (2 GEMMs; we allow 8√n·u32).

That bounds the relative error of each term ``w_k · FFN_k(x_t)`` of a token's sum; the error of the
sum is then at most the tolerance times ``Σ_k |w_k| · ‖FFN_k(x_t)‖`` (plus one rounding), whatever
the sum itself is: where the terms cancel, ‖ref_t‖ can be thousands of times smaller than that,
and a bound relative to ‖ref_t‖ would fail an fp32 result as good as an fp32 oracle's. So the
error is measured per token as ‖out_t − ref_t‖ / Σ_k |w_k| ‖FFN_k(x_t)‖ against ``reference_moe``
computed in fp64 (``return_scale=True`` gives the denominator); without a scale, against ‖ref_t‖.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
ROUNDINGS_ALLOWED = 8


def tolerance_for(dtype: torch.dtype, reduction_length: int = 4096) -> float:
    """Allowed per-token relative error for ``dtype`` with dot products of ``reduction_length``."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {list(UNIT_ROUNDOFF)}, given {dtype}")
    accumulation = ROUNDINGS_ALLOWED * math.sqrt(reduction_length) * UNIT_ROUNDOFF[torch.float32]
    return ROUNDINGS_ALLOWED * UNIT_ROUNDOFF[dtype] + accumulation


@dataclass(frozen=True)
class Comparison:
    """Result of comparing an output to the oracle, per token."""

    max_relative_error: float
    worst_token: int
    max_abs_error: float
    tolerance: float
    num_tokens: int
    finite: bool

    @property
    def passed(self) -> bool:
        return self.finite and self.max_relative_error <= self.tolerance

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"{verdict}: max per-token relative error {self.max_relative_error:.3e} "
            f"(token {self.worst_token}, tolerance {self.tolerance:.3e}), "
            f"max abs error {self.max_abs_error:.3e}, {self.num_tokens} tokens"
            + ("" if self.finite else ", NON-FINITE output")
        )


def compare_per_token(
    out: torch.Tensor,
    ref: torch.Tensor,
    tolerance: float,
    scale: torch.Tensor | None = None,  # [T] Σ_k |w_k|·‖FFN_k(x_t)‖ (reference_moe's scale)
) -> Comparison:
    """‖out_t − ref_t‖ / scale_t per token (scale_t = ‖ref_t‖ when not given); a token with
    nothing to sum (scale 0) must come out exactly zero."""
    if out.shape != ref.shape:
        raise ValueError(f"out: expected shape {list(ref.shape)}, given {list(out.shape)}")
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    finite = bool(torch.isfinite(out64).all())
    diff = (out64 - ref64).norm(dim=1)
    ref_norm = ref64.norm(dim=1) if scale is None else scale.detach().double().cpu()
    relative = torch.where(ref_norm > 0, diff / ref_norm.clamp_min(1e-300), diff * math.inf)
    relative = torch.nan_to_num(relative, nan=math.inf)
    relative = torch.where((ref_norm == 0) & (diff == 0), torch.zeros_like(relative), relative)
    if out.size(0) == 0:
        return Comparison(0.0, -1, 0.0, tolerance, 0, True)
    worst = int(relative.argmax())
    return Comparison(
        max_relative_error=float(relative[worst]),
        worst_token=worst,
        max_abs_error=float((out64 - ref64).abs().max()),
        tolerance=tolerance,
        num_tokens=out.size(0),
        finite=finite,
    )
