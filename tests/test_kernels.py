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

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case conftest did not run first
pytest.importorskip("triton", reason="triton is not installed")

from ep_runtime import EPMoE, MoEConfig, reference_moe
from ep_runtime.kernels import TORCH_OPS as torch_ops
from ep_runtime.kernels import TRITON_OPS as triton_ops
from ep_runtime.kernels import route as route_op
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, chunk_starts, header_rows_for
from ep_runtime.kernels.ops import KERNELS_ENV
from ep_runtime.kernels.wire import CONTROL_INTS, HEADER_INTS, Control, Field, HeaderFields
from ep_runtime.tolerance import compare_per_token, tolerance_for

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]  # the interpreter runs on CPU tensors; no GPU, no cuda
BF16, FP32 = torch.bfloat16, torch.float32
# silu vs torch's: bf16 results differ by at most one rounding flip; fp32 results carry the
# different exp() and the products' roundings (several ulp)
SILU_ULPS = {BF16: 2, FP32: 8}
ULP = {BF16: 2.0**-7, FP32: 2.0**-23}  # bound on one ulp relative to |x| (normal numbers)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit; a NaN matches any NaN."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        same = (a.view(bits) == e.view(bits)) | (a.isnan() & e.isnan())
    else:
        same = a == e
    if not bool(same.all()):
        where = (~same).nonzero()[:5].tolist()
        values = [(a[tuple(i)].item(), e[tuple(i)].item()) for i in where]
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {same.numel()} differ; first at {where}: "
            f"(triton, torch) = {values}"
        )


def new_control(device: torch.device, values: list[int]) -> torch.Tensor:
    return torch.tensor(values + [0] * (CONTROL_INTS - len(values)), dtype=torch.int32).to(device)


# --------------------------------------------------------------------------- route_tokens
def routing_ids(
    num_tokens: int, top_k: int, num_experts: int, *, invalid: bool, seed: int
) -> torch.Tensor:
    """``[T, K]`` ids, -1 sprinkled in; ``invalid``: also out-of-range and repeated ids."""
    g = generator(seed)
    if invalid:
        ids = torch.randint(-3, num_experts + 3, (num_tokens, top_k), generator=g)
        if num_tokens and top_k > 1:
            ids[::3, 1] = ids[::3, 0]  # repeats in every third row
    else:
        ids = torch.randint(-1, num_experts, (num_tokens, top_k), generator=g)
    return ids


ROUTE_CASES = [
    # T, K, E, W, drop_invalid, ids dtype, strided ids
    (0, 3, 8, 2, False, torch.int32, False),
    (1, 1, 4, 1, False, torch.int64, False),
    (5, 2, 6, 3, False, torch.int32, True),
    (300, 3, 12, 3, True, torch.int64, False),  # several token blocks; drops
    (40, 4, 8, 2, True, torch.int32, True),
    (33, 8, 64, 8, False, torch.int64, False),
    (21, 5, 5, 5, True, torch.int32, False),  # one expert per rank
    (1500, 8, 32, 2, True, torch.int32, False),  # twelve programs (look-back, totals)
]


@pytest.mark.parametrize(("T", "K", "E", "W", "drop", "dtype", "strided"), ROUTE_CASES)
def test_route_tokens(device, T, K, E, W, drop, dtype, strided) -> None:
    ids = routing_ids(T, K, E, invalid=drop, seed=T + K).to(dtype)
    if strided:  # every other column of a wider tensor
        wide = torch.full((T, 2 * K), 99, dtype=dtype)
        wide[:, ::2] = ids
        ids = wide.to(device)[:, ::2]
    else:
        ids = ids.to(device)
    fields = HeaderFields(status=2, fingerprint=0x1234567, layer=3, phase=1, top_k=K, num_chunks=4)
    results = {}
    for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
        control = new_control(device, [7, 3, 0, 0, 0, 1])  # SEQ 7, BAD_IDS 3, FORWARD_FAILED 1
        header = torch.full((W, HEADER_INTS), -5, dtype=torch.int32, device=device)
        slot_load = torch.arange(E, dtype=torch.int64, device=device)  # counts so far: added to
        route = ops.route_tokens(
            ids,
            num_experts=E,
            experts_per_rank=E // W,
            world_size=W,
            drop_invalid=drop,
            control=control,
            fields=fields,
            header_out=header,
            slot_load=slot_load,
        )
        assert route.header is header
        results[name] = (route, control, slot_load)
    (got, got_control, got_load), (want, want_control, want_load) = (
        results["triton"],
        results["torch"],
    )
    for field in ("ids", "dest_slot", "token_of", "header"):
        assert_bitwise(getattr(got, field), getattr(want, field), field)
    assert_bitwise(got_control, want_control, "control")
    # by hand: one count per kept (token, slot) pair (dropped ids and repeats are not sent)
    kept = want.ids[want.ids >= 0].long().cpu()
    hand = torch.arange(E) + torch.bincount(kept, minlength=E)
    assert_bitwise(got_load.cpu(), hand, "slot_load (triton)")
    assert_bitwise(want_load.cpu(), hand, "slot_load (torch)")
    if drop and T:
        assert int(want_control[Control.BAD_IDS]) > 3, "the case should drop ids"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_route_tokens_many_programs_replayed() -> None:
    """The multi-program route (ticket order, look-back, the last program's totals) captured in a
    CUDA graph and replayed: every replay equals the torch twin, forward counter included, and
    the ticket and done counters are back at 0 after each launch."""
    device = torch.device("cuda")
    num_tokens, top_k, num_experts, world = 6000, 8, 64, 4
    ids = routing_ids(num_tokens, top_k, num_experts, invalid=True, seed=11).to(device)
    fields = HeaderFields(0, 5, 1, 1, top_k, 1)
    kw = dict(
        num_experts=num_experts,
        experts_per_rank=num_experts // world,
        world_size=world,
        drop_invalid=True,
        fields=fields,
    )
    control = new_control(device, [3])
    header = torch.empty(world, HEADER_INTS, dtype=torch.int32, device=device)
    scratch = route_op.new_route_scratch(device, world)
    triton_ops.route_tokens(ids, control=control, header_out=header, scratch=scratch, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_ops.route_tokens(
            ids, control=control, header_out=header, scratch=scratch, **kw
        )
    want_control = new_control(device, [3])
    torch_ops.route_tokens(  # the twin of the launch before the capture
        ids, control=want_control, header_out=torch.empty_like(header), **kw
    )
    for _ in range(5):
        graph.replay()
        want_header = torch.empty_like(header)
        want = torch_ops.route_tokens(ids, control=want_control, header_out=want_header, **kw)
        for field in ("ids", "dest_slot", "token_of", "header"):
            assert_bitwise(getattr(got, field), getattr(want, field), field)
    assert_bitwise(control, want_control, "control after 6 launches")


@pytest.mark.parametrize("status", [0, 2])
def test_route_tokens_invalid_ids_fail_the_header(device, status) -> None:
    """``invalid_status``: invalid ids set the header's status (where it was OK) instead of
    being counted; valid ids leave it OK."""
    fields = HeaderFields(status, 9, 0, 1, 3, 1)
    distinct = torch.rand(40, 8, generator=generator(5)).topk(3, dim=1).indices
    for invalid in (True, False):
        ids = routing_ids(40, 3, 8, invalid=True, seed=5) if invalid else distinct
        ids = ids.to(device)
        results = []
        for ops in (triton_ops, torch_ops):
            control = new_control(device, [4, 3])
            header = torch.empty(2, HEADER_INTS, dtype=torch.int32, device=device)
            route = ops.route_tokens(
                ids,
                num_experts=8,
                experts_per_rank=4,
                world_size=2,
                drop_invalid=True,
                control=control,
                fields=fields,
                header_out=header,
                invalid_status=1,
            )
            results.append((route, control))
        (got, got_control), (want, want_control) = results
        for field in ("ids", "dest_slot", "token_of", "header"):
            assert_bitwise(getattr(got, field), getattr(want, field), field)
        assert_bitwise(got_control, want_control, "control")
        expected = status or (1 if invalid else 0)
        assert got.header[:, Field.STATUS].tolist() == [expected] * 2
        assert int(got_control[Control.BAD_IDS]) == 3  # reported by the status, not counted


def test_route_tokens_all_unused(device) -> None:
    ids = torch.full((9, 3), -1, dtype=torch.int64, device=device)
    fields = HeaderFields(0, 1, 0, 1, 3, 1)
    results = []
    for ops in (triton_ops, torch_ops):
        control = new_control(device, [1])
        header = torch.empty(2, HEADER_INTS, dtype=torch.int32, device=device)
        route = ops.route_tokens(
            ids,
            num_experts=4,
            experts_per_rank=2,
            world_size=2,
            drop_invalid=True,
            control=control,
            fields=fields,
            header_out=header,
        )
        results.append((route, control))
    (got, got_control), (want, want_control) = results
    for field in ("ids", "dest_slot", "token_of", "header"):
        assert_bitwise(getattr(got, field), getattr(want, field), field)
    assert_bitwise(got_control, want_control, "control")
    assert int(got.header[:, Field.NUM_ROWS].abs().sum()) == 0


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


# --------------------------------------------------------------------------- whole layer
LAUNCHES_PER_FORWARD = {"standard": 9, "expanded": 8}  # Triton launches, world size 1


class LaunchCounter:
    """Counts Triton kernel launches (``kernel[grid](...)``, every kernel a ``LaunchedKernel``)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        kernel_class = type(route_op._route_kernel)
        original = kernel_class.launch

        def counting_launch(kernel, *args, **kwargs):
            self.count += 1
            return original(kernel, *args, **kwargs)

        monkeypatch.setattr(kernel_class, "launch", counting_launch)


def layer_case(device: torch.device, activation: str):
    dtype = BF16
    config = MoEConfig(6, 3, 32, 16, activation=activation, dtype=dtype, max_tokens_per_rank=16)
    g = generator(11)
    w13 = (torch.randn(6, config.w13_rows, 32, generator=g) / 32**0.5).to(dtype)
    w2 = (torch.randn(6, 32, 16, generator=g) / 16**0.5).to(dtype)
    x = torch.randn(13, 32, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(13)])
    ids[torch.rand(13, 3, generator=g) < 0.2] = -1
    ids[4] = -1  # a token with no experts
    weights = torch.rand(13, 3, generator=g)
    tensors = [t.to(device) for t in (x, ids, weights)]
    return config, w13, w2, tensors


def run_layer(config, w13, w2, tensors, device, layout, mode, poison):
    layer = EPMoE(
        config,
        dispatcher="torch_a2a",
        experts="grouped_mm",
        layout=layout,
        mode=mode,
        device=device,
        poison=poison,
    )
    try:
        layer.load_weights(w13, w2)
        return layer(*tensors)
    finally:
        layer.close()


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_layer_on_triton_ops(device, monkeypatch, layout, mode, activation) -> None:
    """World size 1, every data-path op from ``triton_ops`` (forced on CPU): matches
    ``reference_moe``; with relu², bitwise equal to the same layer on the torch twins."""
    config, w13, w2, tensors = layer_case(device, activation)
    poison = mode == "capacity"
    monkeypatch.setenv(KERNELS_ENV, "torch")  # resolved when the layer is built
    on_torch = run_layer(config, w13, w2, tensors, device, layout, mode, poison)
    monkeypatch.setenv(KERNELS_ENV, "triton")
    launches = LaunchCounter(monkeypatch)
    on_triton = run_layer(config, w13, w2, tensors, device, layout, mode, poison)
    assert launches.count == LAUNCHES_PER_FORWARD[layout]
    x, ids, weights = (t.cpu() for t in tensors)
    ref = reference_moe(x, ids, weights, w13, w2, activation)
    comparison = compare_per_token(on_triton.float(), ref, tolerance_for(config.dtype, 32))
    assert comparison.passed, comparison.describe()
    if activation == "relu2":
        assert_bitwise(on_triton, on_torch, "layer output, triton vs torch ops")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_capacity_forward_is_graph_capturable(layout) -> None:
    """Capacity mode on CUDA: no host sync (sync debug mode errors on one), and a forward
    captured in a CUDA graph replays to the eager result."""
    device = torch.device("cuda")
    config, w13, w2, (x, ids, weights) = layer_case(device, "silu")
    layer = EPMoE(
        config,
        dispatcher="torch_a2a",
        experts="grouped_mm",
        layout=layout,
        mode="capacity",
        device=device,
    )
    try:
        layer.load_weights(w13, w2)
        eager = layer(x, ids, weights)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x, ids, weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, ids, weights, out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, eager, "graph replay vs eager")
        layer.check()
    finally:
        layer.close()
