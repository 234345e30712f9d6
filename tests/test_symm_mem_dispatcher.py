"""The torch_symm_mem adapter (ep_runtime/dispatch/torch_symm_mem.py) on CPU.

The real ops need >= 2 GPUs with NVSHMEM and have never run; here the adapter runs against
``ImitationSymmTransport`` (tests/symm_mem_imitation.py), an imitation of the two ops' documented
semantics, on gloo ranks. Passing says the adapter's packing, offsets, expansion and reduction
are right for those semantics, not that the real ops behave so: the multi-rank suite on GPUs
(scripts/multigpu_bench.sh) is what tests the real ones.
"""

from __future__ import annotations

import re
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.dispatch.base import DispatchSetup
from ep_runtime.dispatch.rows import Route
from ep_runtime.dispatch.torch_a2a import TorchAllToAll
from ep_runtime.dispatch.torch_symm_mem import (
    TorchSymmMemDispatcher,
    first_token_rows,
    send_row_sources,
    split_table,
)
from ep_runtime.types import DispatchMode, EPInputError, TopkLayout
from tests.conftest import EXPECTED_SKIPS_WITH_CUDA
from tests.multigpu import cases, checks
from tests.multigpu.cases import CaseSpec
from tests.multigpu.conftest import get_pool
from tests.symm_mem_imitation import (
    ImitationBackedSymmMem,
    ImitationSymmTransport,
    imitation_all_to_all_vdev_2d,
    imitation_all_to_all_vdev_2d_offset,
    register_imitation,
)

IMITATION = ImitationBackedSymmMem.name
LAYOUTS = ("standard", "expanded")
MODES = ("exact", "capacity")


def _setup(
    device: str = "cpu",
    world_size: int = 1,
    mode: DispatchMode = DispatchMode.CAPACITY,
    cap: int = 6,
) -> DispatchSetup:
    return DispatchSetup(
        comm=Comm(None, 0, world_size, torch.device(device)),
        num_experts=8 * world_size,
        hidden_size=32,
        max_top_k=3,
        max_tokens_per_rank=cap,
        dtype=torch.bfloat16,
        mode=mode,
    )


def _inputs(num_tokens: int, num_experts: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 32, generator=generator).to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:3] for _ in range(num_tokens)]
    )
    ids[0, 1] = -1
    weights = 0.25 + torch.rand(num_tokens, 3, generator=generator)
    return x, ids, weights


# ------------------------------------------------------------------ refusals
def _timed_refusal(setup: DispatchSetup) -> str:
    start = time.perf_counter()
    reason = TorchSymmMemDispatcher.refusal(setup, TopkLayout.EXPANDED)
    assert time.perf_counter() - start < 0.5, "a refusal must be quick"
    assert reason is not None
    return reason


def test_refuses_cpu_ranks_naming_the_device():
    reason = _timed_refusal(_setup("cpu", world_size=2))
    assert reason == "torch symmetric memory: runs on ['cuda'], not cpu"


def test_refusal_on_one_gpu_matches_the_expected_cuda_skips():
    """A group of one on CUDA (the single-H200 machine) is refused with a reason that the
    session's expected-skip list for CUDA machines accepts."""
    reason = _timed_refusal(_setup("cuda", world_size=1))
    assert "needs a group of >= 2 ranks, got 1" in reason
    assert any(re.search(pattern, reason) for pattern in EXPECTED_SKIPS_WITH_CUDA)


def _nvshmem_available() -> bool:
    from torch.distributed import _symmetric_memory as symm_mem

    return bool(symm_mem.is_nvshmem_available())


def test_refusal_names_missing_nvshmem_and_group():
    """Without NVSHMEM (CPU builds) that is named; a Comm without a group is refused too."""
    reason = _timed_refusal(_setup("cuda", world_size=2))
    assert ("NVSHMEM is not available" in reason) == (not _nvshmem_available())
    assert "needs an initialised process group" in reason
    assert "lacks torch.ops.symm_mem" not in reason  # both ops exist in torch 2.11+ builds


def test_refuses_more_ranks_than_the_offset_op_takes():
    reason = _timed_refusal(_setup("cuda", world_size=32))
    assert "at most 16 ranks, got 32" in reason


def test_refuses_when_nvlink_multicast_is_switched_on(monkeypatch):
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    reason = _timed_refusal(_setup("cuda", world_size=2))
    assert "NVLink multicast must stay off, but NVSHMEM_DISABLE_NVLS=0" in reason


def test_auto_never_picks_it():
    assert TorchSymmMemDispatcher.auto_priority < TorchAllToAll.auto_priority


# ------------------------------------------------------------------ pure steps, hand counts
def test_split_table_is_rank_major_header_then_tokens():
    assert split_table(torch.tensor([3, 0, 2])).tolist() == [1, 3, 1, 0, 1, 2]


def test_first_token_rows_skip_each_header():
    # rank 0: header row 0, tokens 1-3; rank 1: header 4; rank 2: header 5, tokens 6-7
    assert first_token_rows(torch.tensor([3, 0, 2])).tolist() == [1, 5, 6]


def test_send_row_sources_pack_tokens_by_destination():
    """4 tokens, 2 ranks: token 0 goes to both, 1 to rank 1, 2 nowhere, 3 to rank 0."""
    mask = torch.tensor([[True, True], [False, True], [False, False], [True, False]])
    route = Route(mask, mask.to(torch.int64).cumsum(0) - 1, mask.sum(0), top_k=3)
    first = first_token_rows(route.send_counts)
    assert first.tolist() == [1, 4]
    sources = send_row_sources(route, first, num_rows=2 + 4 * 2)
    header_0, header_1, zero = 4, 5, 6  # rows of [tokens 0-3 | headers | zero row]
    assert sources.tolist() == [header_0, 0, 3, header_1, 0, 1, zero, zero, zero, zero]


# ------------------------------------------------------------------ the imitated ops
def test_imitation_matches_pytorchs_documented_alignment_example():
    """nvshmem_extension.cu: "if c0 has length 5 and d0 has length 7 ... major_align 16, the
    output offset of c1 will be 16"; an empty group still takes ``major_align`` rows."""
    c = torch.arange(100, 115)  # rank 0: c0 (5 rows) c1 (7) for rank 0, 3 rows for rank 1
    d = torch.arange(200, 207)  # rank 1: d0 (7 rows) for rank 0, nothing for rank 1
    in_splits = [torch.tensor([5, 7, 0, 3]), torch.tensor([7, 0, 0, 0])]
    pieces, splits_offsets = imitation_all_to_all_vdev_2d(0, [c, d], in_splits, major_align=16)
    assert splits_offsets.tolist() == [[5, 7, 7, 0], [0, 5, 16, 23]]
    assert [start for start, _ in pieces] == [0, 5, 16, 23]
    _, empty_first = imitation_all_to_all_vdev_2d(1, [c, d], in_splits, major_align=16)
    assert empty_first.tolist() == [[0, 0, 3, 0], [0, 0, 16, 19]]  # empty group: 16 rows


def test_imitated_offset_op_returns_rows_where_they_were_sent():
    """The reverse op fed the forward's ``out_splits_offsets`` (PyTorch's AllToAllVDev2d
    backward does this) puts every row back at its packed input position."""
    generator = torch.Generator().manual_seed(3)
    world, num_experts = 3, 2
    splits = [torch.randint(0, 4, (world * num_experts,), generator=generator) for _ in range(3)]
    inputs = [torch.arange(int(s.sum())) + 100 * rank for rank, s in enumerate(splits)]
    forward = [imitation_all_to_all_vdev_2d(r, inputs, splits) for r in range(world)]
    outputs = []
    for pieces, _ in forward:
        out = torch.full((64,), -1, dtype=torch.int64)
        for start, rows in pieces:
            out[start : start + rows.numel()] = rows
        outputs.append(out)
    for rank in range(world):
        pieces, back = imitation_all_to_all_vdev_2d_offset(
            rank, outputs, [splits_offsets for _, splits_offsets in forward]
        )
        returned = torch.cat([rows for _, rows in pieces])
        assert torch.equal(returned, inputs[rank])
        assert back[0].tolist() == splits[rank].tolist()


# ------------------------------------------------------------------ one process, world of 1
@pytest.mark.parametrize("mode", list(DispatchMode))
@pytest.mark.parametrize("layout", list(TopkLayout))
def test_world_of_one_equals_torch_a2a(mode, layout):
    """Same inputs, same Dispatched fields and the same combine output, bit for bit."""
    setup = _setup("cpu", world_size=1, mode=mode)
    reference, adapter = TorchAllToAll(setup), ImitationBackedSymmMem(setup)
    x, ids, weights = _inputs(5)
    expected = reference.dispatch(x, ids, weights, layout)
    got = adapter.dispatch(x, ids, weights, layout)
    for name in (
        "hidden_states",
        "topk_ids",
        "topk_weights",
        "expert_offsets",
        "expert_num_tokens",
        "num_valid_rows",
    ):
        a, b = getattr(expected, name), getattr(got, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    assert expected.expert_num_tokens_cpu == got.expert_num_tokens_cpu
    assert torch.equal(
        reference.combine(expected.hidden_states, expected),
        adapter.combine(got.hidden_states, got),
    )


def test_two_dispatches_may_wait_a_third_is_refused_and_combine_runs_once():
    adapter = ImitationBackedSymmMem(_setup("cpu", world_size=1))
    x, ids, weights = _inputs(4)
    first = adapter.dispatch(x, ids, weights, TopkLayout.STANDARD)
    second = adapter.dispatch(x, ids, weights, TopkLayout.STANDARD)
    with pytest.raises(RuntimeError, match="2 dispatches are already waiting"):
        adapter.dispatch(x, ids, weights, TopkLayout.STANDARD)
    adapter._next_slot = 0  # the failed call advanced the shared order; rewind for this test
    assert torch.equal(
        adapter.combine(second.hidden_states, second), adapter.combine(first.hidden_states, first)
    )
    with pytest.raises(RuntimeError, match="already combined"):
        adapter.combine(first.hidden_states, first)


def test_a_call_past_the_cap_is_an_input_error():
    adapter = ImitationBackedSymmMem(_setup("cpu", world_size=1, mode=DispatchMode.EXACT, cap=2))
    with pytest.raises(EPInputError, match="at most max_tokens_per_rank=2 rows, given 3"):
        adapter.dispatch(*_inputs(3), TopkLayout.STANDARD)


def test_exact_mode_checks_where_the_op_put_the_token_rows():
    """If the real op laid rows out differently (here: headers aligned to 4 rows), exact mode
    says so instead of reading the wrong rows."""

    class AlignedTransport(ImitationSymmTransport):
        major_align = 4

    class Misaligned(ImitationBackedSymmMem):
        @classmethod
        def make_transport(cls, comm, heap_bytes):
            return AlignedTransport(comm)

    adapter = Misaligned(_setup("cpu", world_size=1, mode=DispatchMode.EXACT))
    with pytest.raises(RuntimeError, match="put token rows at row 4, expected 1"):
        adapter.dispatch(*_inputs(3), TopkLayout.STANDARD)


# ------------------------------------------------------------------ multi-rank, gloo
@pytest.fixture
def imitation_pool():
    def get(world_size: int):
        pool = get_pool(world_size)
        if pool.backend != "gloo":
            pytest.skip(f"the imitation runs on CPU (gloo) ranks, this pool is {pool.backend}")
        pool.run_ok(register_imitation)
        return pool

    return get


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("experts", ["reference", "grouped_mm"])
def test_layer_matches_reference(imitation_pool, world_size, mode, layout, experts):
    spec = CaseSpec(dispatcher=IMITATION, experts=experts, layout=layout, mode=mode)
    checks.run_layer_cases(imitation_pool(world_size), spec)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("edge", list(cases.EDGE_CASES))
def test_edge_cases(imitation_pool, edge, layout, mode):
    spec = CaseSpec(dispatcher=IMITATION, experts="grouped_mm", layout=layout, mode=mode)
    checks.run_layer_cases(imitation_pool(2), cases.with_spec(spec, **cases.EDGE_CASES[edge]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_mode_chunks_past_the_cap(imitation_pool, layout):
    spec = CaseSpec(dispatcher=IMITATION, layout=layout, **cases.CHUNKED_PAST_CAP)
    checks.run_layer_cases(imitation_pool(2), spec)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dispatch_is_bitwise_and_round_trip_exact(imitation_pool, world_size, mode, layout):
    pool = imitation_pool(world_size)
    spec = CaseSpec(
        dispatcher=IMITATION, layout=layout, mode=mode, tokens=(9, 0, 5, 12)[:world_size]
    )
    assert sum(pool.run_ok(cases.check_dispatch_bitwise, spec)) > 0
    spec = cases.with_spec(spec, top_k=4)
    assert sum(pool.run_ok(cases.check_round_trip, spec)) > 0


def compare_with_torch_a2a(spec: CaseSpec) -> int:
    """Rank side: torch_a2a and the adapter on the same inputs give the same received rows (in
    the same order; capacity mode compares the valid rows) and the same combine output, bitwise.
    Returns the rows compared."""
    rank = dist.get_rank()
    x, ids, weights = cases.dyadic_inputs(spec, rank)
    results = []
    for name in ("torch_a2a", IMITATION):
        layer = cases.build_layer(cases.with_spec(spec, dispatcher=name))
        try:
            dispatched = layer.dispatcher.dispatch(x, ids, weights, layer.layout)
            valid = (dispatched.topk_ids >= 0).any(1)
            out = layer.dispatcher.combine(cases.weighted_identity(dispatched), dispatched)
            results.append((dispatched, valid, out))
        finally:
            layer.close()
    (a, a_valid, a_out), (b, b_valid, b_out) = results
    for field in ("hidden_states", "topk_ids", "topk_weights"):
        assert torch.equal(getattr(a, field)[a_valid], getattr(b, field)[b_valid]), field
    assert torch.equal(a.expert_num_tokens, b.expert_num_tokens)
    if spec.layout == "expanded":
        assert torch.equal(a.expert_offsets, b.expert_offsets)
    assert torch.equal(a_out, b_out)
    return int(b_valid.sum())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_torch_a2a_on_the_same_inputs(imitation_pool, world_size, mode, layout):
    spec = CaseSpec(layout=layout, mode=mode, tokens=(9, 3, 0, 12)[:world_size])
    assert sum(imitation_pool(world_size).run_ok(compare_with_torch_a2a, spec)) > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_poison_mode_matches_clean_run(imitation_pool, mode, layout):
    pool = imitation_pool(2)
    spec = CaseSpec(dispatcher=IMITATION, experts="grouped_mm", layout=layout, mode=mode)
    checks.assert_poison_matches_clean(partial(checks.run_layer_cases, pool), spec)


@pytest.mark.parametrize(("fault", "mode"), checks.BAD_INPUTS)
def test_bad_input_on_one_rank_fails_every_rank(imitation_pool, fault, mode):
    pool = imitation_pool(2)
    spec = CaseSpec(dispatcher=IMITATION, experts="grouped_mm")
    run = partial(checks.run_layer_cases, pool)
    checks.assert_bad_input_fails_every_rank(pool, run, spec, fault, mode)
