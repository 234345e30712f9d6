"""Rank-side checks for the DeepEP V2 adapter, run the same way against the imitation (CPU) and
the real ``deep_ep`` (GPU). DeepEP promises no row order and pads EXPANDED groups to
``expert_alignment``, so "arrives bit for bit" is checked as equal multisets of rows. With fp8
dispatch a row is the sender's ``q(x)`` (the contract's quantizer on the sender's bf16 row):
e4m3 bits and fp32 scales."""

from __future__ import annotations

import torch

from ep_runtime.dispatch.deepep_v2 import COMBINE_HIDDEN_MULTIPLE
from ep_runtime.quantization import FP8_DTYPE, quantize_activations
from tests.multigpu import dispatch_cases
from tests.multigpu.rank_inputs import CaseSpec

HIDDEN = COMBINE_HIDDEN_MULTIPLE  # the smallest H DeepEP V2's combine compiles for


def _row_keys(
    hidden: torch.Tensor,  # [R, H] bf16 or e4m3
    ids: torch.Tensor,
    weights: torch.Tensor,
    scale: torch.Tensor | None = None,  # [R, H/128] fp32 scales of e4m3 rows
) -> list[tuple[tuple, ...]]:
    """One sortable key per row: (ids, weights on served slots, hidden bits, scales)."""
    served = ids >= 0
    weights = torch.where(served, weights, torch.zeros_like(weights))
    bit_types = {torch.bfloat16: torch.int16, FP8_DTYPE: torch.uint8}
    bits = hidden.contiguous().view(bit_types.get(hidden.dtype, hidden.dtype))
    scales = [()] * hidden.size(0) if scale is None else scale.tolist()
    return sorted(
        (tuple(i), tuple(w), tuple(h), tuple(s))
        for i, w, h, s in zip(ids.tolist(), weights.tolist(), bits.tolist(), scales, strict=True)
    )


def _sent_rows(x: torch.Tensor, quantized: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each token's row as it travels: bf16, or its ``q(x)`` values and scales."""
    if not quantized:
        return [(row, None) for row in x]
    values, scales = quantize_activations(x)
    return list(zip(values, scales, strict=True))


def check_dispatch_bitwise_any_order(spec: CaseSpec) -> int:
    """Rows (``q(x)`` with fp8 dispatch), global int32 ids (-1 where not served here) and
    weights arrive exactly, in any order; every other row is padding (all ids -1). Returns the
    number of valid rows."""
    inputs, dispatched, (low, high) = dispatch_cases.dispatch_dyadic_inputs(spec)
    num_local = high - low
    quantized = spec.quantization is not None
    assert (dispatched.hidden_states_scale is not None) == quantized
    if quantized:
        assert dispatched.hidden_states.dtype == FP8_DTYPE, dispatched.hidden_states.dtype
    rows, row_ids, row_weights = [], [], []
    for src_x, src_ids, src_w in inputs:
        sent = _sent_rows(src_x, quantized)
        for token in range(src_x.size(0)):
            served = (src_ids[token] >= low) & (src_ids[token] < high)
            if spec.layout == "standard" and served.any():
                rows.append(sent[token])
                row_ids.append(torch.where(served, src_ids[token], -1))
                row_weights.append(src_w[token])
            elif spec.layout == "expanded":
                for slot in served.nonzero().flatten().tolist():
                    rows.append(sent[token])
                    row_ids.append(src_ids[token, slot : slot + 1])
                    row_weights.append(src_w[token, slot : slot + 1])
    got_ids = dispatched.topk_ids.cpu()
    assert got_ids.dtype == torch.int32, got_ids.dtype
    top_k = inputs[0][1].size(1)
    assert got_ids.size(1) == (top_k if spec.layout == "standard" else 1)
    valid = (got_ids >= 0).any(1)
    assert int(valid.sum()) == len(rows), (int(valid.sum()), len(rows))
    if rows:
        expected = _row_keys(
            torch.stack([values for values, _ in rows]),
            torch.stack(row_ids).to(torch.int32),
            torch.stack(row_weights),
            torch.stack([scales for _, scales in rows]) if quantized else None,
        )
        scale = dispatched.hidden_states_scale
        got = _row_keys(
            dispatched.hidden_states.cpu()[valid],
            got_ids[valid],
            dispatched.topk_weights.cpu()[valid],
            None if scale is None else scale.cpu()[valid],
        )
        assert got == expected, "dispatched rows differ from the rows sent"
    if spec.layout == "expanded":
        counts = torch.zeros(num_local, dtype=torch.int64)
        for expert_ids in row_ids:
            for expert in expert_ids[expert_ids >= 0].tolist():
                counts[expert - low] += 1
        offsets = dispatched.expert_offsets.cpu().to(torch.int64)
        for expert in range(num_local):  # each expert's rows sit in its group
            group = got_ids[offsets[expert] : offsets[expert + 1], 0]
            assert bool(((group == low + expert) | (group == -1)).all()), (expert, group)
            assert int((group == low + expert).sum()) == int(counts[expert])
    return len(rows)
