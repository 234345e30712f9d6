"""``reference_moe``: the single-process oracle. Plain torch; imports nothing from dispatch/,
experts/ or the layer, so a bug there cannot hide in the oracle."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

GemmInput = Callable[[torch.Tensor], torch.Tensor]  # what a GEMM consumes, from its input rows


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(h)`` for GEMM1 outputs ``h [N, 2I]`` (``[gate | up]``, ``"silu"``) or ``[N, I]``."""
    if activation == "silu":
        intermediate = h.shape[1] // 2
        return F.silu(h[:, :intermediate]) * h[:, intermediate:]
    if activation == "relu2":
        return torch.relu(h).square()
    raise ValueError(f"activation: expected 'silu' or 'relu2', given {activation!r}")


def expert_ffn(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    gemm_input: GemmInput | None = None,
) -> torch.Tensor:
    """``w2 · act(w13 · x)`` for rows ``x [N, H]`` of one expert; ``w13`` is ``[gate; up]``.
    ``gemm_input`` maps each GEMM's input first (fp8: its activation quantization)."""
    given = gemm_input or (lambda v: v)
    return given(activate(given(x) @ w13.T, activation)) @ w2.T


def reference_moe(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] global ids, -1 = unused
    topk_weights: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [E, 2I, H] ("silu") or [E, I, H] ("relu2")
    w2: torch.Tensor,  # [E, H, I]
    activation: str = "silu",
    *,
    accumulate_dtype: torch.dtype = torch.float64,
    return_scale: bool = False,
    gemm_input: GemmInput | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out[t] = Σ_k w[t,k] · FFN_{ids[t,k]}(x[t])`` over slots with id ≠ -1, as float32.

    Everything is computed in ``accumulate_dtype`` from the given (already rounded) inputs.
    Weights on -1 slots are never read, so NaN there cannot leak. ``return_scale``: also
    ``[T]`` float64 ``Σ_k |w[t,k]| · ‖FFN_{ids[t,k]}(x[t])‖``, the size of the summed terms,
    which bounds the error of any computation of the sum (tolerance.py) even where it cancels.
    ``gemm_input``: applied to each GEMM's input, the result cast back to ``accumulate_dtype``
    (``quantization.fake_quantize_activations`` with dequantized weights: the fp8 contract).

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H]``, any float dtype: the tokens' hidden states.
    topk_ids : torch.Tensor
        ``[T, K]`` int: the global expert id of each slot, -1 for an unused slot.
    topk_weights : torch.Tensor
        ``[T, K]`` float: the router weight of each slot (never read on -1 slots).
    w13 : torch.Tensor
        ``[E, 2I, H]`` (``"silu"``: rows ``[gate; up]``) or ``[E, I, H]`` (``"relu2"``), any
        float dtype: each expert's first GEMM.
    w2 : torch.Tensor
        ``[E, H, I]``, any float dtype: each expert's second GEMM.
    activation : str, default ``"silu"``
        ``"silu"`` (``silu(gate) · up``) or ``"relu2"`` (``relu(h)²``); an ``Activation``
        member is taken by its value.
    accumulate_dtype : torch.dtype, default torch.float64
        The dtype every product and sum is computed in.
    return_scale : bool, default False
        Also return the size of the summed terms (above).
    gemm_input : callable, optional
        ``rows [N, D] → rows [N, D]``, applied to each GEMM's input rows; None: none.

    Returns
    -------
    out : torch.Tensor
        ``[T, H]`` float32, on ``x``'s device: each token's weighted sum of its experts'
        outputs (zero for a token with no used slot).
    scale : torch.Tensor
        ``[T]`` float64, only with ``return_scale``: ``Σ_k |w[t,k]| · ‖FFN_{ids[t,k]}(x[t])‖``.
    """
    activation = getattr(activation, "value", activation)
    acc = accumulate_dtype
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=acc, device=x.device)
    scale = torch.zeros(num_tokens, dtype=torch.float64, device=x.device)
    ids = topk_ids.to(torch.int64)
    given = None if gemm_input is None else (lambda v: gemm_input(v).to(acc))
    for expert in ids[ids >= 0].unique().tolist():
        token_idx, slot_idx = (ids == expert).nonzero(as_tuple=True)
        rows = x[token_idx].to(acc)
        y = expert_ffn(rows, w13[expert].to(acc), w2[expert].to(acc), activation, given)
        weights = topk_weights[token_idx, slot_idx].to(acc).unsqueeze(1)
        out.index_add_(0, token_idx, weights * y)
        scale.index_add_(0, token_idx, (weights * y).norm(dim=1).double())
    if return_scale:
        return out.to(torch.float32), scale
    return out.to(torch.float32)
