"""The torch_symm_mem adapter (ep_runtime/dispatch/torch_symm_mem.py) on CPU.

The real op needs >= 2 GPUs with NVSHMEM and has never run; here the adapter runs against
``ImitationSymmTransport`` (tests/support/symm_mem_imitation.py), an imitation of the op's
semantics, on
gloo ranks. Passing says the adapter's packing, splits, stale-row handling, expansion and reduction
are right for those semantics, not that the real op behaves so: the multi-rank suite on GPUs
(tools/gpu/multigpu_bench.sh) is what tests the real one.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from ep_runtime.comm import PeerIdentity
from ep_runtime.dispatch.base import Dispatcher
from ep_runtime.dispatch.protocol import LayerIdentity, Phase
from ep_runtime.dispatch.setup import DispatchSetup, PeerSetup
from ep_runtime.dispatch.torch_a2a import TorchAllToAll
from ep_runtime.dispatch.torch_symm_mem import TorchSymmMemDispatcher
from ep_runtime.types import Dispatched, DispatchMode, EPInputError, TopkLayout
from tests.conftest import EXPECTED_SKIPS_WITH_CUDA
from tests.multigpu import dispatch_cases, rank_inputs
from tests.multigpu.expectations import expected_refusal
from tests.multigpu.rank_inputs import CaseSpec
from tests.support.comms import comm_without_group
from tests.support.imitation_suite import LAYOUTS, MODES, imitation_suite
from tests.support.symm_mem_imitation import (
    ImitationBackedSymmMem,
    imitation_all_to_all_vdev_2d,
    register_imitation,
)

IMITATION = ImitationBackedSymmMem.name
LAYER = LayerIdentity(fingerprint=1, index=0)


def _setup(
    device: str = "cpu",
    world_size: int = 1,
    mode: DispatchMode = DispatchMode.CAPACITY,
    cap: int = 6,
) -> DispatchSetup:
    return DispatchSetup(
        comm=comm_without_group(world_size, torch.device(device)),
        num_experts=8 * world_size,
        hidden_size=32,
        max_top_k=3,
        max_tokens_per_rank=cap,
        dtype=torch.bfloat16,
        mode=mode,
    )


def _build(cls: type[Dispatcher], setup: DispatchSetup) -> Dispatcher:
    """A dispatcher for a world of one (no process group, so no peers to watch)."""
    return cls(setup, PeerSetup("test", [PeerIdentity.of_this_process()]))


def _dispatch(dispatcher: Dispatcher, x, ids, weights, layout: TopkLayout) -> Dispatched:
    dispatched, _ = dispatcher.dispatch(x, ids, weights, layout, layer=LAYER)
    return dispatched


def _inputs(num_tokens: int, num_experts: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 32, generator=generator).to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:3] for _ in range(num_tokens)]
    )
    ids[0, 1] = -1
    weights = 0.25 + torch.rand(num_tokens, 3, generator=generator)
    return x, ids, weights


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaN compares equal to the same NaN."""
    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


# ------------------------------------------------------------------ refusals
def _timed_refusal(setup: DispatchSetup) -> str:
    start = time.perf_counter()
    reason = TorchSymmMemDispatcher.refusal(setup, TopkLayout.EXPANDED)
    assert time.perf_counter() - start < 0.5, "a refusal must be quick"
    assert reason is not None
    return reason


def test_refuses_cpu_ranks_naming_the_device():
    reason = _timed_refusal(_setup("cpu", world_size=2))
    assert reason == "runs on ['cuda'], not cpu"
    assert re.search(expected_refusal("torch_symm_mem", "cpu", torch.bfloat16, 2), reason)


def test_refusal_on_one_gpu_is_an_expected_cuda_skip():
    """A group of one on CUDA (a single-GPU machine) is refused with the plain reason; the
    suite's expectation for that machine matches it, and so does the session's skip list."""
    reason = _timed_refusal(_setup("cuda", world_size=1))
    assert reason == "needs a group of >= 2 ranks, got 1"
    assert re.search(expected_refusal("torch_symm_mem", "cuda", torch.bfloat16, 1), reason)
    skip = f"expected refusal: {reason}"
    assert any(re.search(pattern, skip, re.DOTALL) for pattern in EXPECTED_SKIPS_WITH_CUDA)


def _nvshmem_available() -> bool:
    from torch.distributed import _symmetric_memory as symm_mem

    return bool(symm_mem.is_nvshmem_available())


def test_refusal_names_missing_nvshmem_and_group():
    """Without NVSHMEM (CPU builds) that is named; a Comm without a group is refused too."""
    reason = _timed_refusal(_setup("cuda", world_size=2))
    assert ("NVSHMEM is not available" in reason) == (not _nvshmem_available())
    assert "needs an initialised process group" in reason
    assert "lacks torch.ops.symm_mem" not in reason  # the op exists in torch 2.11+ builds


def test_refuses_more_ranks_than_the_op_takes():
    assert "at most 32 ranks" not in _timed_refusal(_setup("cuda", world_size=32))
    assert "at most 32 ranks, got 64" in _timed_refusal(_setup("cuda", world_size=64))


def test_refuses_when_nvlink_multicast_is_switched_on(monkeypatch):
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    reason = _timed_refusal(_setup("cuda", world_size=2))
    assert "NVLink multicast must stay off, but NVSHMEM_DISABLE_NVLS=0" in reason


def test_auto_never_picks_it():
    assert TorchSymmMemDispatcher.auto_priority < TorchAllToAll.auto_priority


# ------------------------------------------------------------------ the imitated op
def test_imitation_matches_pytorchs_documented_alignment_example():
    """PyTorch's docstring of the op: "if c0 has length 5 and d0 has length 7 ... major_align
    16, the output offset of c1 will be 16"; an empty group still takes ``major_align`` rows."""
    c = torch.arange(100, 115)  # rank 0: c0 (5 rows) c1 (7) for rank 0, 3 rows for rank 1
    d = torch.arange(200, 207)  # rank 1: d0 (7 rows) for rank 0, nothing for rank 1
    in_splits = [torch.tensor([5, 7, 0, 3]), torch.tensor([7, 0, 0, 0])]
    pieces, splits_offsets = imitation_all_to_all_vdev_2d(0, [c, d], in_splits, major_align=16)
    assert splits_offsets.tolist() == [[5, 7, 7, 0], [0, 5, 16, 23]]
    assert [start for start, _ in pieces] == [0, 5, 16, 23]
    _, empty_first = imitation_all_to_all_vdev_2d(1, [c, d], in_splits, major_align=16)
    assert empty_first.tolist() == [[0, 0, 3, 0], [0, 0, 16, 19]]  # empty group: 16 rows


def test_one_bucket_per_rank_packs_chunks_by_source():
    """With one bucket per rank (how the adapter calls it) the op is an all-to-all-v: each
    source's chunk follows the previous one, whatever ``major_align``."""
    inputs = [torch.arange(10, 15), torch.arange(20, 23), torch.arange(30, 34)]
    in_splits = [torch.tensor([2, 3, 0]), torch.tensor([1, 0, 2]), torch.tensor([4, 0, 0])]
    for major_align in (1, 4):
        pieces, splits_offsets = imitation_all_to_all_vdev_2d(0, inputs, in_splits, major_align)
        assert splits_offsets.tolist() == [[2, 1, 4], [0, 2, 3]]
        assert torch.cat([rows for _, rows in pieces]).tolist() == [10, 11, 20, 30, 31, 32, 33]


# ------------------------------------------------------------------ one process, world of 1
@pytest.mark.parametrize("mode", list(DispatchMode))
@pytest.mark.parametrize("layout", list(TopkLayout))
def test_world_of_one_equals_torch_a2a(mode, layout):
    """Same inputs, the same Dispatched and the same combine output, bit for bit, for a
    forward and then a smaller one on the same buffers (rows an earlier forward left behind
    must read as filler)."""
    setup = _setup("cpu", world_size=1, mode=mode)
    reference = _build(TorchAllToAll, setup)
    adapter = _build(ImitationBackedSymmMem, setup)
    for num_tokens, seed in ((6, 0), (2, 1)):
        x, ids, weights = _inputs(num_tokens, seed=seed)
        expected = _dispatch(reference, x, ids, weights, layout)
        got = _dispatch(adapter, x, ids, weights, layout)
        for name in ("hidden_states", "topk_ids", "topk_weights", "expert_offsets"):
            a, b = getattr(expected, name), getattr(got, name)
            assert (a is None and b is None) or torch.equal(_bits(a), _bits(b)), name
        assert torch.equal(
            reference.combine(dispatch_cases.weighted_identity(expected), expected),
            adapter.combine(dispatch_cases.weighted_identity(got), got),
        )


def test_the_op_gets_header_rows_plus_token_rows_per_peer():
    """3 tokens, one routed nowhere: the op is told header rows + 2 rows for rank 0."""
    adapter = _build(ImitationBackedSymmMem, _setup("cpu", world_size=1))
    x, ids, weights = _inputs(3)
    ids[1] = -1
    _dispatch(adapter, x, ids, weights, TopkLayout.STANDARD)
    header_rows = adapter.chunks.header_rows
    assert header_rows >= 1
    assert adapter.buffers[Phase.DISPATCH].in_splits.tolist() == [header_rows + 2]
    assert adapter.buffers[Phase.DISPATCH].splits_offsets.tolist() == [[header_rows + 2], [0]]


def test_a_second_dispatch_before_the_combine_is_refused():
    adapter = _build(ImitationBackedSymmMem, _setup("cpu", world_size=1))
    x, ids, weights = _inputs(4)
    first = _dispatch(adapter, x, ids, weights, TopkLayout.STANDARD)
    with pytest.raises(RuntimeError, match="before the previous dispatch was combined"):
        _dispatch(adapter, x, ids, weights, TopkLayout.STANDARD)
    adapter.combine(dispatch_cases.weighted_identity(first), first)
    _dispatch(adapter, x, ids, weights, TopkLayout.STANDARD)  # after the combine: fine


def test_a_call_past_the_cap_is_an_input_error():
    adapter = _build(
        ImitationBackedSymmMem, _setup("cpu", world_size=1, mode=DispatchMode.EXACT, cap=2)
    )
    with pytest.raises(EPInputError, match="at most max_tokens_per_rank=2 rows, given 3"):
        _dispatch(adapter, *_inputs(3), TopkLayout.STANDARD)


# ------------------------------------------------------------------ multi-rank, gloo
globals().update(imitation_suite(IMITATION, register_imitation, world_sizes=(2, 4)))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dispatch_is_bitwise_and_round_trip_exact(imitation_pool, world_size, mode, layout):
    pool = imitation_pool(world_size)
    spec = CaseSpec(
        dispatcher=IMITATION, layout=layout, mode=mode, tokens=(9, 0, 5, 12)[:world_size]
    )
    assert sum(pool.run_ok(dispatch_cases.check_dispatch_bitwise, spec)) > 0
    spec = rank_inputs.with_spec(spec, top_k=4)
    assert sum(pool.run_ok(dispatch_cases.check_round_trip, spec)) > 0


def compare_with_torch_a2a(spec: CaseSpec) -> int:
    """Rank side: torch_a2a and the adapter on the same inputs give the same received rows (in
    the same order; capacity mode lays chunks out differently, so the valid rows are compared)
    and the same combine output, bitwise; then again for fewer tokens on the same buffers.
    Returns the rows compared."""
    rank = dist.get_rank()
    rounds = [spec, rank_inputs.with_spec(spec, seed=spec.seed + 1, tokens=(1, 2, 0, 3))]
    layers = [
        rank_inputs.build_layer(rank_inputs.with_spec(spec, dispatcher=name))
        for name in ("torch_a2a", IMITATION)
    ]
    compared = 0
    try:
        for inputs_spec in rounds:
            x, ids, weights = rank_inputs.dyadic_inputs(inputs_spec, rank)
            results = []
            for layer in layers:
                dispatched = rank_inputs.dispatch_only(layer, x, ids, weights)
                valid = (dispatched.topk_ids >= 0).any(1)
                out = layer.dispatcher.combine(
                    dispatch_cases.weighted_identity(dispatched), dispatched
                )
                results.append((dispatched, valid, out))
            (a, a_valid, a_out), (b, b_valid, b_out) = results
            for field in ("hidden_states", "topk_ids", "topk_weights"):
                expected, got = getattr(a, field)[a_valid], getattr(b, field)[b_valid]
                assert torch.equal(_bits(expected), _bits(got)), field  # NaN on unused slots
            if spec.layout == "expanded":
                assert torch.equal(a.expert_offsets, b.expert_offsets)
            assert torch.equal(a_out, b_out)
            compared += int(b_valid.sum())
    finally:
        for layer in layers:
            layer.close()
    return compared


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_torch_a2a_on_the_same_inputs(imitation_pool, world_size, mode, layout):
    spec = CaseSpec(layout=layout, mode=mode, tokens=(9, 3, 0, 12)[:world_size])
    assert sum(imitation_pool(world_size).run_ok(compare_with_torch_a2a, spec)) > 0
