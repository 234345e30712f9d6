"""Rank-side checks for the DeepEP V2 adapter, run the same way against the imitation (CPU) and
the real ``deep_ep`` (GPU). DeepEP promises no row order and pads EXPANDED groups to
``expert_alignment``, so "arrives bit for bit" is checked as equal multisets of rows."""

from __future__ import annotations

import torch

from ep_runtime.dispatch.deepep_v2 import COMBINE_HIDDEN_MULTIPLE
from tests.multigpu import dispatch_cases
from tests.multigpu.rank_inputs import CaseSpec

HIDDEN = COMBINE_HIDDEN_MULTIPLE  # the smallest H DeepEP V2's combine compiles for


def _row_keys(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> list[tuple[tuple, ...]]:
    """One sortable key per row: (ids, weights on served slots, hidden bits)."""
    served = ids >= 0
    weights = torch.where(served, weights, torch.zeros_like(weights))
    bits = hidden.contiguous().view(torch.int16) if hidden.dtype == torch.bfloat16 else hidden
    return sorted(
        (tuple(i), tuple(w), tuple(h))
        for i, w, h in zip(ids.tolist(), weights.tolist(), bits.tolist(), strict=True)
    )


def check_dispatch_bitwise_any_order(spec: CaseSpec) -> int:
    """Rows, global int32 ids (-1 where not served here) and weights arrive exactly, in any
    order; every other row is padding (all ids -1). Returns the number of valid rows."""
    inputs, dispatched, (low, high) = dispatch_cases.dispatch_dyadic_inputs(spec)
    num_local = high - low
    rows, row_ids, row_weights = [], [], []
    for src_x, src_ids, src_w in inputs:
        for token in range(src_x.size(0)):
            served = (src_ids[token] >= low) & (src_ids[token] < high)
            if spec.layout == "standard" and served.any():
                rows.append(src_x[token])
                row_ids.append(torch.where(served, src_ids[token], -1))
                row_weights.append(src_w[token])
            elif spec.layout == "expanded":
                for slot in served.nonzero().flatten().tolist():
                    rows.append(src_x[token])
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
            torch.stack(rows), torch.stack(row_ids).to(torch.int32), torch.stack(row_weights)
        )
        got = _row_keys(
            dispatched.hidden_states.cpu()[valid],
            got_ids[valid],
            dispatched.topk_weights.cpu()[valid],
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
