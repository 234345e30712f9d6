"""The row kernels around the block-scaled fp8 GEMMs (``experts/gemm/block_rows.py``) against their
torch specs and hand counts, in both block layouts (cuBLAS's per-block scales, DeepGEMM's one
scale matrix). On CPU they run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); on a GPU, compiled."""

from __future__ import annotations

import itertools

import pytest
import torch

from ep_runtime.experts.gemm import block_rows
from ep_runtime.quantization import BLOCK
from tests.experts.test_fp8_triton import H, I, assert_neighbouring_codes, gemm_problem, on_device

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUTS = ["standard", "expanded"]
BLOCK_LAYOUTS = {"cublas": block_rows.CUBLAS, "deepgemm": block_rows.DEEPGEMM}


def grouped_problem(layout: str, gated: bool = True):
    """gemm_problem's rows (an expert with no rows, a row served by nobody, NaN in it) on the
    device, with the group starts."""
    x_q, x_s, _, _, _, _, offsets, pairs, weights, top_k, rows = on_device(
        *gemm_problem(gated, layout)
    )
    num_slots = rows * top_k if pairs is not None else x_q.size(0)
    return x_q, x_s, pairs, offsets, weights, top_k if pairs is not None else 1, num_slots


@pytest.mark.parametrize("block_layout", BLOCK_LAYOUTS.values(), ids=BLOCK_LAYOUTS.keys())
@pytest.mark.parametrize("num_local", [1, 5, 40])
def test_pad_offsets_is_a_hand_count(num_local, block_layout):
    """Block starts and block ends for counts of 0, exact multiples of the alignment and others;
    a number of experts short of a power of two (the kernel's masked lanes)."""
    g = torch.Generator().manual_seed(num_local)
    align = block_layout.align
    counts = torch.randint(0, 3 * align, (num_local,), generator=g)
    counts[::3] = 0
    counts[1::4] = 2 * align
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    starts, ends, start = [0], [], 0
    for count in counts.tolist():
        ends.append(start + count)
        start += -(-count // align) * align
        starts.append(start)
    padded = torch.full((num_local + 1,), -5, dtype=torch.int32, device=DEVICE)
    got_ends = torch.full((num_local,), -5, dtype=torch.int32, device=DEVICE)
    block_rows.pad_offsets(offsets.to(DEVICE), padded, block_layout, got_ends)
    assert padded.tolist() == starts and got_ends.tolist() == ends
    assert block_rows.padded_offsets_spec(offsets, block_layout).tolist() == starts
    assert block_rows.block_ends_spec(offsets, block_layout).tolist() == ends
    assert starts[-1] <= block_rows.max_block_rows(int(counts.sum()), num_local, block_layout)


def test_scale_strides():
    """cuBLAS: each block's own row count; DeepGEMM: the rows rounded up to 4 floats."""
    assert block_rows.CUBLAS.scale_stride(37) == 37
    assert [block_rows.DEEPGEMM.scale_stride(n) for n in (1, 4, 37, 128)] == [4, 4, 40, 128]


@pytest.mark.parametrize("block_layout", BLOCK_LAYOUTS.values(), ids=BLOCK_LAYOUTS.keys())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_rows_is_its_spec_bitwise(layout, block_layout):
    x_q, x_s, pairs, offsets, _, top_k, num_slots = grouped_problem(layout)
    num_local = offsets.numel() - 1
    bound = block_rows.max_block_rows(num_slots, num_local, block_layout)  # the launch grid
    stale = torch.full_like(offsets, 99)
    padded = block_rows.pad_offsets(offsets, stale, block_layout)
    assert padded is stale
    assert torch.equal(padded, block_rows.padded_offsets_spec(offsets, block_layout).to(DEVICE))
    bounds = padded.tolist()
    align = block_layout.align
    counts = (offsets[1:] - offsets[:-1]).tolist()
    sizes = [end - start for start, end in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and sizes == [-(-count // align) * align for count in counts]
    total = bounds[-1]
    assert total <= bound
    groups = H // BLOCK
    stride = block_layout.scale_stride(bound)
    rows = torch.full((bound, H), 1.0, device=DEVICE).to(x_q.dtype)  # stale codes to overwrite
    scales = torch.full((groups * stride,), float("nan"), device=DEVICE)
    pair_of = torch.full((bound,), 7, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(num_slots, dtype=torch.int32, device=DEVICE)
    block_rows.group_rows(
        x_q, x_s, pairs, offsets, padded, rows, scales, pair_of, positions, block_layout,
        top_k=top_k,
    )  # fmt: skip
    want_rows, want_scales, want_pair_of, want_positions = block_rows.group_rows_spec(
        x_q, x_s, pairs, offsets, block_layout, top_k=top_k, num_slots=num_slots
    )
    assert torch.equal(rows[:total].view(torch.uint8), want_rows.view(torch.uint8))
    by_row = block_rows.scales_by_row(want_scales, bounds, groups, block_layout)
    assert torch.equal(block_rows.scales_by_row(scales, bounds, groups, block_layout), by_row)
    assert torch.equal(pair_of[:total], want_pair_of) and torch.equal(positions, want_positions)
    assert (pair_of[total:] == 7).all()  # past the block rows the grid's programs write nothing
    pair_of = pair_of[:total]
    # a hand count: every served slot has one block row, and that row holds its pair
    served = int(offsets[-1])
    assert int((positions >= 0).sum()) == served == int((pair_of >= 0).sum())
    placed = positions[positions >= 0].long()
    assert torch.equal(pair_of[placed].long(), (positions >= 0).nonzero().view(-1))
    assert not by_row[pair_of < 0].any()  # padding rows: zero scales


@pytest.mark.parametrize("block_layout", BLOCK_LAYOUTS.values(), ids=BLOCK_LAYOUTS.keys())
@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_activate_rows_matches_its_spec(layout, gated, block_layout):
    """GEMM1's output in fp32 (cuBLAS) or bf16 (DeepGEMM); DeepGEMM's grid is the bound on the
    block rows, whose rows past the last block are never written."""
    x_q, x_s, pairs, offsets, weights, top_k, num_slots = grouped_problem(layout, gated)
    _, _, pair_of, _ = block_rows.group_rows_spec(
        x_q, x_s, pairs, offsets, block_layout, top_k=top_k, num_slots=num_slots
    )
    padded = block_rows.padded_offsets_spec(offsets, block_layout).to(DEVICE)
    bounds = padded.tolist()
    total = bounds[-1]
    grid = total if block_layout.per_block_scales else total + 5
    dtype = torch.float32 if block_layout.per_block_scales else torch.bfloat16
    g = torch.Generator().manual_seed(2)
    y = (torch.randn(grid, (2 if gated else 1) * I, generator=g) * 4).to(DEVICE, dtype)
    y[:total][pair_of < 0] = float("nan")  # padding rows: never read
    y[total:] = float("nan")
    want_q, want_s = block_rows.activate_rows_spec(
        y[:total], pair_of, weights, bounds, block_layout, gated=gated,
        sorted_pairs=pairs is not None,
    )  # fmt: skip
    groups = I // BLOCK
    q = torch.full((grid, I), 3.0, device=DEVICE).to(want_q.dtype)  # stale codes
    s = torch.full((groups * block_layout.scale_stride(grid),), float("nan"), device=DEVICE)
    pair_of_grid = torch.cat([pair_of, pair_of.new_full((grid - total,), 7)])
    block_rows.activate_rows(
        y, pair_of_grid, weights, padded, q, s, block_layout, top_k=top_k,
        gated=gated, sorted_pairs=pairs is not None,
    )  # fmt: skip
    assert (q[total:].float() == 3.0).all()  # past the block rows: untouched
    # back to one row per block row to compare codes; padding rows: zero codes, zero scales
    per_row = block_rows.scales_by_row(s, bounds, groups, block_layout).cpu()
    per_row_want = block_rows.scales_by_row(want_s, bounds, groups, block_layout).cpu()
    served = (pair_of >= 0).cpu()
    q = q[:total].cpu()
    assert not q[~served].float().any() and not per_row[~served].any()
    order = served.nonzero().view(-1)
    assert_neighbouring_codes(
        q[order], per_row[order], want_q.cpu()[order], per_row_want[order], order.numel()
    )
