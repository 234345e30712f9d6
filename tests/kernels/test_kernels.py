"""The Triton data-path ops (one file per op under ``kernels/``) against their torch twins (the
spec), over odd shapes; and whole layers run on the Triton ops against ``reference_moe``.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set in tests/conftest.py before triton is imported); with one, the same tests run compiled on
CUDA. Results must be bitwise equal (a NaN matches any NaN: CPU and GPU casts give different NaN
payloads), except silu: 2 ulp (bf16) or 8 ulp (fp32) of the result. Bytes and rows the twins'
docs call undefined (padding rows of grouped buffers, filler hidden outside poison mode) are not
compared.
"""

from __future__ import annotations

import pytest
import torch

from ep_runtime.kernels import TORCH_OPS as torch_ops
from ep_runtime.kernels import TRITON_OPS as triton_ops
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, chunk_starts, header_rows_for
from ep_runtime.kernels.wire import HEADER_INTS, Control, Field, HeaderFields
from tests.support.kernel_checks import (
    BF16,
    FP32,
    SILU_ULPS,
    ULP,
    assert_bitwise,
    generator,
    new_control,
    routing_ids,
)

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

# --------------------------------------------------------------------------- pack_rows
PACK_CASES = [
    # T, K, max_k, E, W, H, dtype, capacity (None: exact), poison, strided x / weights
    (0, 2, 3, 4, 2, 8, FP32, None, False, False),
    (1, 1, 1, 2, 1, 5, BF16, None, True, False),  # 10-byte rows: 7 header rows per chunk
    (9, 2, 4, 6, 3, 40, FP32, 12, True, True),
    (12, 3, 3, 8, 2, 2100, BF16, None, False, True),  # H over one block
    (7, 3, 4, 9, 3, 33, BF16, 7, False, False),
    (6, 2, 2, 4, 1, 16, FP32, 8, True, False),  # W = 1, capacity
]


def compare_send(got: torch.Tensor, want: torch.Tensor, row_format: RowFormat, starts) -> None:
    """Hidden NaN-aware, the headers exactly, every other byte exactly (both buffers started
    from the same bytes, and bytes neither writes must stay as they were)."""
    assert_bitwise(row_format.hidden(got), row_format.hidden(want), "hidden")
    assert_bitwise(row_format.header(got)[starts], row_format.header(want)[starts], "chunk headers")
    got_rest, want_rest = got.clone(), want.clone()
    hidden_bytes = row_format.hidden_size * row_format.dtype.itemsize
    got_rest[:, :hidden_bytes] = 0
    want_rest[:, :hidden_bytes] = 0
    assert_bitwise(got_rest, want_rest, "bytes outside the hidden state")


@pytest.mark.parametrize(
    ("T", "K", "max_k", "E", "W", "H", "dtype", "capacity", "poison", "strided"), PACK_CASES
)
def test_pack_rows(device, T, K, max_k, E, W, H, dtype, capacity, poison, strided) -> None:
    g = generator(T * 7 + H)
    x = torch.randn(T, H + 3 if strided else H, generator=g).to(dtype)
    weights = torch.rand(T, 2 * K, generator=g)
    x = x[:, :H] if strided else x
    weights = weights[:, ::2] if strided else weights[:, :K].to(BF16)
    x, weights = x.to(device), weights.to(device)
    ids = routing_ids(T, K, E, invalid=False, seed=T).to(device)
    control = new_control(device, [0])
    header = torch.empty(W, HEADER_INTS, dtype=torch.int32, device=device)
    route = torch_ops.route_tokens(
        ids,
        num_experts=E,
        experts_per_rank=E // W,
        world_size=W,
        drop_invalid=False,
        control=control,
        fields=HeaderFields(0, 77, 1, 1, K, 1),
        header_out=header,
    )
    row_format = RowFormat(H, dtype, max_k)
    chunks = ChunkLayout(header_rows_for(H, dtype), capacity)
    rows = route.header[:, Field.NUM_ROWS].tolist()
    total = chunks.total_rows(rows)
    initial = torch.randint(0, 256, (total, row_format.row_bytes), generator=g, dtype=torch.uint8)
    sends = {}
    for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
        send = initial.clone().to(device)
        ops.pack_rows(x, weights, route, send, row_format, chunks, poison=poison)
        sends[name] = send
    starts = chunk_starts(route.header[:, Field.NUM_ROWS], chunks)
    compare_send(sends["triton"], sends["torch"], row_format, starts)
    filler_rows = total - sum(rows) - W  # capacity padding, header rows past the first
    if poison and filler_rows:
        assert bool(row_format.hidden(sends["triton"]).isnan().any()), "filler should be NaN"


# --------------------------------------------------------------------------- local_ids
@pytest.mark.parametrize(("R", "K", "offset", "L"), [(0, 2, 0, 2), (1, 1, 3, 1), (13, 3, 2, 3)])
def test_local_ids(device, R, K, offset, L) -> None:
    row_format = RowFormat(8, FP32, K + 1)
    rows = torch.zeros(R, row_format.row_bytes, dtype=torch.uint8)
    row_format.ids(rows, K).copy_(routing_ids(R, K, 8, invalid=True, seed=R).to(torch.int32))
    ids = row_format.ids(rows.to(device), K)  # strided view into packed rows
    got = triton_ops.local_ids(ids, local_offset=offset, num_local=L)
    want = torch_ops.local_ids(ids, local_offset=offset, num_local=L)
    assert_bitwise(got, want, "local ids")


# --------------------------------------------------------------------------- group_rows
GROUP_CASES = [
    # R, K, E, local offset, L, H, dtype, grouped rows ("exact" / "bound" / "short"), poison,
    # ids pattern
    (0, 2, 8, 0, 4, 16, FP32, "exact", False, "random"),
    (1, 1, 4, 2, 2, 7, BF16, "exact", True, "random"),
    (40, 3, 12, 4, 4, 24, BF16, "bound", True, "random"),
    (150, 4, 16, 0, 5, 9, FP32, "exact", False, "random"),  # several blocks of pairs
    (30, 3, 8, 4, 4, 2100, BF16, "exact", False, "no_rows_for_expert_5"),
    (10, 2, 6, 0, 3, 8, FP32, "short", True, "random"),  # grouped rows run out: pairs dropped
    (8, 2, 6, 0, 3, 8, FP32, "bound", False, "all_unused"),
    (20, 2, 4, 3, 1, 16, FP32, "bound", True, "random"),  # one local expert
]


def grouped_inputs(R, K, E, H, dtype, pattern, device, seed):
    """``hidden``, ``ids``, ``weights`` as strided views into packed rows (as received)."""
    g = generator(seed)
    row_format = RowFormat(H, dtype, K)
    rows = torch.zeros(R, row_format.row_bytes, dtype=torch.uint8)
    ids = routing_ids(R, K, E, invalid=False, seed=seed).to(torch.int32)
    if pattern == "all_unused":
        ids.fill_(-1)
    elif pattern.startswith("no_rows_for_expert_"):
        ids[ids == int(pattern.rsplit("_", 1)[1])] = -1
    row_format.hidden(rows).copy_(torch.randn(R, H, generator=g).to(dtype))
    row_format.ids(rows, K).copy_(ids)
    row_format.weights(rows, K).copy_(torch.rand(R, K, generator=g))
    rows = rows.to(device)
    return row_format.hidden(rows), row_format.ids(rows, K), row_format.weights(rows, K)


@pytest.mark.parametrize(
    ("R", "K", "E", "offset", "L", "H", "dtype", "size", "poison", "pattern"), GROUP_CASES
)
def test_group_rows(device, R, K, E, offset, L, H, dtype, size, poison, pattern) -> None:
    hidden, ids, weights = grouped_inputs(R, K, E, H, dtype, pattern, device, seed=R + H)
    local = (ids >= offset) & (ids < offset + L)
    served = int(local.sum())
    num_rows = {"exact": served, "bound": R * min(K, L), "short": served // 2}[size]
    kwargs = dict(local_offset=offset, num_local=L, num_rows=num_rows, poison=poison)
    got = triton_ops.group_rows(hidden, ids, weights, **kwargs)
    want = torch_ops.group_rows(hidden, ids, weights, **kwargs)
    for field in ("positions", "offsets", "ids", "weights"):
        assert_bitwise(getattr(got, field), getattr(want, field), field)
    valid = int(want.offsets[-1])
    assert valid == min(served, num_rows)
    assert_bitwise(got.hidden[:valid], want.hidden[:valid], "grouped hidden")
    if poison:
        assert bool(got.hidden[valid:].isnan().all()), "padding rows are NaN in poison mode"


# --------------------------------------------------------------------------- weighted_activation
ACTIVATION_CASES = [
    # N, I, gated, dtype, strided h
    (0, 4, True, BF16, False),
    (1, 3, False, FP32, False),
    (17, 300, True, BF16, True),
    (9, 2100, False, BF16, False),
    (6, 40, True, FP32, True),
    (5, 24, False, BF16, True),
]


@pytest.mark.parametrize(("N", "I", "gated", "dtype", "strided"), ACTIVATION_CASES)
def test_weighted_activation(device, N, I, gated, dtype, strided) -> None:  # noqa: E741
    g = generator(N + I)
    width = 2 * I if gated else I
    h = (4 * torch.randn(N, width + 5, generator=g)).to(dtype)
    if N > 2:
        h[2, 1] = float("nan")
    h = h.to(device)[:, :width] if strided else h[:, :width].contiguous().to(device)
    weights = torch.rand(N, generator=g).to(device)
    got = triton_ops.weighted_activation(h, weights, gated=gated)
    want = torch_ops.weighted_activation(h, weights, gated=gated)
    if not gated:  # relu²·w: no transcendental, bitwise
        assert_bitwise(got, want, "relu2")
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    a, e = got.float().cpu(), want.float().cpu()
    assert bool((a.isnan() == e.isnan()).all()), "NaN in different places"
    bound = SILU_ULPS[dtype] * ULP[dtype] * e.abs() + torch.finfo(dtype).tiny
    within = e.isnan() | ((a - e).abs() <= bound)
    if not bool(within.all()):
        worst = float(((a - e).abs() / bound)[~e.isnan()].max())
        raise AssertionError(f"silu: error up to {worst:.2f}× the bound of {SILU_ULPS[dtype]} ulp")


# --------------------------------------------------------------------------- sum_rows
SUM_CASES = [
    # T, J, S, H, dtype, out ("new" / "strided"), chunks (None / "exact" / "capacity"), failed
    (0, 2, 5, 8, FP32, "new", None, None),
    (1, 1, 3, 5, BF16, "strided", None, 0),
    (23, 4, 40, 2100, BF16, "strided", None, None),
    (12, 3, None, 33, FP32, "new", "exact", 0),
    (10, 2, None, 16, BF16, "strided", "capacity", 1),
    (9, 3, None, 12, BF16, "new", "exact", 3),
    (6, 3, 0, 8, FP32, "new", None, None),  # nothing to add: rows are exactly zero
]


def sum_inputs(T, J, S, H, dtype, chunk_kind, seed):
    """(source, positions, chunk_counts, chunks), positions -1 in about a third of places."""
    g = generator(seed)
    chunks = counts = None
    if chunk_kind is None:
        positions = torch.randint(-1, max(S, 1), (T, J), generator=g)
        positions[torch.rand(T, J, generator=g) < 0.3] = -1
        if S == 0:
            positions.fill_(-1)
    else:
        header_rows = header_rows_for(H, dtype)
        counts_list = torch.randint(0, T + 1, (J,), generator=g).tolist()
        chunks = ChunkLayout(header_rows, T if chunk_kind == "capacity" else None)
        S = chunks.total_rows(counts_list)
        positions = torch.stack(
            [
                torch.randint(-1, max(c, 1), (T,), generator=g) if c else torch.full((T,), -1)
                for c in counts_list
            ],
            dim=1,
        )
        headers = torch.zeros(J, HEADER_INTS, dtype=torch.int32)
        headers[:, Field.NUM_ROWS] = torch.tensor(counts_list, dtype=torch.int32)
        counts = headers[:, Field.NUM_ROWS]  # strided, as the dispatcher passes it
    source = (torch.randn(S, H, generator=g) * 3).to(dtype)
    referenced = torch.zeros(S, dtype=torch.bool)
    if chunks is None:
        referenced[positions[positions >= 0]] = True
        source[~referenced] = float("nan")  # never read
    return source, positions.to(torch.int32), counts, chunks


@pytest.mark.parametrize(
    ("T", "J", "S", "H", "dtype", "out_kind", "chunk_kind", "failed"), SUM_CASES
)
def test_sum_rows(device, T, J, S, H, dtype, out_kind, chunk_kind, failed) -> None:
    source, positions, counts, chunks = sum_inputs(T, J, S, H, dtype, chunk_kind, seed=T + H)
    source, positions = source.to(device), positions.to(device)
    counts = None if counts is None else counts.to(device)
    flag = None
    if failed is not None:  # a 0-d view into a control block, as the protocol passes it
        control = new_control(device, [0] * Control.FORWARD_FAILED + [failed])
        flag = control[Control.FORWARD_FAILED]
    results = {}
    for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
        out = None
        if out_kind == "strided":  # columns 1..H of a wider buffer, the rest must stay
            wide = torch.full((T, H + 2), 7.0, dtype=dtype, device=device)
            out = wide[:, 1 : H + 1]
        result = ops.sum_rows(
            source, positions, out, chunk_counts=counts, chunks=chunks, failed=flag
        )
        if out is not None:
            assert result is out
            result = wide
        results[name] = result
    assert_bitwise(results["triton"], results["torch"], "sums")
    if failed:
        assert bool(results["triton"].isnan().any())


@pytest.mark.parametrize("failed", [None, 0, 2])
@pytest.mark.parametrize(("T", "H", "dtype"), [(0, 8, FP32), (1, 5, BF16), (17, 300, BF16)])
def test_sum_rows_of_own_rows(device, T, H, dtype, failed) -> None:
    """``own_rows``: a position ≥ 0 stands for the output's own row of the source (a world of
    one); rows of tokens sent nowhere hold NaN and must come out exactly zero (hand oracle)."""
    g = generator(T + H)
    source = (torch.randn(T, H, generator=g) * 3).to(dtype)
    sent = torch.randint(0, 5, (T, 1), generator=g).to(torch.int32)  # a chunk row, or -1
    sent[torch.rand(T, 1, generator=g) < 0.4] = -1
    source[sent[:, 0] < 0] = float("nan")
    expected = torch.where(sent >= 0, source.float(), 0.0).to(dtype)
    flag = None
    if failed is not None:
        control = new_control(device, [0] * Control.FORWARD_FAILED + [failed])
        flag = control[Control.FORWARD_FAILED]
        if failed:
            expected = torch.full_like(expected, float("nan"))
    for ops in (triton_ops, torch_ops):
        got = ops.sum_rows(source.to(device), sent.to(device), failed=flag, own_rows=True)
        assert_bitwise(got.cpu(), expected, f"{ops.name} own rows")


# --------------------------------------------------------------------------- headers
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("phase", [1, 2])
def test_record_headers(device, seed, phase) -> None:
    g = generator(seed)
    world = [1, 2, 3, 5][seed % 4]
    rank = seed % world
    top_k = [0, 2][seed % 2]
    received = torch.zeros(world, HEADER_INTS, dtype=torch.int32)
    received[:, Field.SEQ] = 11
    received[:, Field.FINGERPRINT] = 0x5EED
    received[:, Field.LAYER] = 2
    received[:, Field.PHASE] = phase
    received[:, Field.TOP_K] = 2
    for peer in range(world):  # perturb some peers (own row too: it must be ignored)
        change = int(torch.randint(0, 8, (1,), generator=g))
        column = [
            Field.STATUS,
            Field.SEQ,
            Field.FINGERPRINT,
            Field.LAYER,
            Field.PHASE,
            Field.TOP_K,
            None,
            None,
        ][change]
        if column is not None:
            received[peer, column] += int(torch.randint(1, 3, (1,), generator=g))
        if change == 5 and seed % 3 == 0:
            received[peer, Field.TOP_K] = 0  # a rank with no tokens agrees with any K
    prior = [[9, 0, 0, 0, 0, 0], [9, 0, 1, 4, 6, 0]][seed % 2]  # an earlier failure recorded
    controls = []
    for ops in (triton_ops, torch_ops):
        control = new_control(device, prior)
        ops.record_headers(
            received.to(device), control, rank=rank, phase=phase, top_k=top_k, mismatch_status=4
        )
        controls.append(control)
    assert_bitwise(controls[0], controls[1], "control")


CHUNK_HEADER_CASES = [(1, 7, BF16, None), (3, 5, BF16, 4), (2, 40, FP32, None), (4, 9, BF16, None)]


@pytest.mark.parametrize(("W", "H", "dtype", "capacity"), CHUNK_HEADER_CASES)
def test_chunk_headers(device, W, H, dtype, capacity) -> None:
    """Odd H in bf16: chunks start at byte offsets that are not multiples of 4."""
    g = generator(W + H)
    chunks = ChunkLayout(header_rows_for(H, dtype), capacity)
    counts_list = torch.randint(0, 4, (W,), generator=g).tolist()
    headers = torch.zeros(W, HEADER_INTS, dtype=torch.int32)
    headers[:, Field.NUM_ROWS] = torch.tensor(counts_list, dtype=torch.int32)
    counts = headers.to(device)[:, Field.NUM_ROWS]
    total = chunks.total_rows(counts_list)
    initial = torch.randint(0, 256, (total * H * dtype.itemsize,), generator=g, dtype=torch.uint8)
    status = torch.arange(HEADER_INTS, dtype=torch.int32).mul(0x01030507).to(device)
    buffers = []
    for ops in (triton_ops, torch_ops):
        buffer = initial.clone().to(device).view(dtype).view(total, H)
        ops.write_chunk_headers(buffer, status, counts, chunks)
        buffers.append(buffer)
    assert_bitwise(
        buffers[0].view(-1).view(torch.uint8), buffers[1].view(-1).view(torch.uint8), "written"
    )
    scrambled = initial.to(device).view(dtype).view(total, H)
    for buffer in (buffers[0], scrambled):
        got = triton_ops.read_chunk_headers(buffer, counts, chunks)
        want = torch_ops.read_chunk_headers(buffer, counts, chunks)
        assert_bitwise(got, want, "read headers")
    assert_bitwise(
        triton_ops.read_chunk_headers(buffers[0], counts, chunks),
        status.expand(W, -1),
        "round trip",
    )
