"""The route op (``kernels/route.py``) against its torch twin over odd shapes, bitwise: ids of
either dtype, strided, invalid and dropped ids, many programs (replayed as a CUDA graph where
there is a GPU), every slot unused. Devices and comparison as in tests/kernels/test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from ep_runtime.kernels import TORCH_OPS as torch_ops
from ep_runtime.kernels import TRITON_OPS as triton_ops
from ep_runtime.kernels import route as route_op
from ep_runtime.kernels.wire import HEADER_INTS, Control, Field, HeaderFields
from tests.support.kernel_checks import (
    CUDA,
    assert_bitwise,
    generator,
    new_control,
    routing_ids,
)

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

# --------------------------------------------------------------------------- route_tokens
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


def route_both_ways(ids, control_values, world_size, slot_load=None, **options):
    """``route_tokens`` by the Triton op and by its torch twin, each on fresh control words,
    a fresh header (filled with -5: every entry must be written) and its own copy of
    ``slot_load``; asserts the two bitwise equal (ids, slots, tokens, header, control) and
    returns ``(route, control, slot_load)`` of each, Triton's first."""
    results = []
    for ops in (triton_ops, torch_ops):
        control = new_control(ids.device, control_values)
        header = torch.full((world_size, HEADER_INTS), -5, dtype=torch.int32, device=ids.device)
        load = None if slot_load is None else slot_load.clone()
        route = ops.route_tokens(
            ids,
            world_size=world_size,
            control=control,
            header_out=header,
            slot_load=load,
            **options,
        )
        assert route.header is header
        results.append((route, control, load))
    (got, got_control, _), (want, want_control, _) = results
    for field in ("ids", "dest_slot", "token_of", "header"):
        assert_bitwise(getattr(got, field), getattr(want, field), field)
    assert_bitwise(got_control, want_control, "control")
    return results


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
    (_, _, got_load), (want, want_control, want_load) = route_both_ways(
        ids,
        [7, 3, 0, 0, 0, 1],  # SEQ 7, BAD_IDS 3, FORWARD_FAILED 1
        W,
        slot_load=torch.arange(E, dtype=torch.int64, device=device),  # counts so far: added to
        num_experts=E,
        experts_per_rank=E // W,
        drop_invalid=drop,
        fields=fields,
    )
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
        (got, got_control, _), _ = route_both_ways(
            ids,
            [4, 3],
            2,
            num_experts=8,
            experts_per_rank=4,
            drop_invalid=True,
            fields=fields,
            invalid_status=1,
        )
        expected = status or (1 if invalid else 0)
        assert got.header[:, Field.STATUS].tolist() == [expected] * 2
        assert int(got_control[Control.BAD_IDS]) == 3  # reported by the status, not counted


def test_route_tokens_all_unused(device) -> None:
    ids = torch.full((9, 3), -1, dtype=torch.int64, device=device)
    fields = HeaderFields(0, 1, 0, 1, 3, 1)
    (got, _, _), _ = route_both_ways(
        ids, [1], 2, num_experts=4, experts_per_rank=2, drop_invalid=True, fields=fields
    )
    assert int(got.header[:, Field.NUM_ROWS].abs().sum()) == 0
