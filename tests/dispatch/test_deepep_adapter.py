"""The DeepEP V2 adapter (ep_runtime/dispatch/deepep_v2.py) on CPU, against an IMITATION.

``ImitationElasticBuffer`` (tests/support/deepep_imitation.py) imitates DeepEP V2's documented
dispatch/combine semantics; it is not DeepEP. These tests show the adapter turns those semantics
into a correct layer; the real library runs the same rank-side bodies in
tests/multigpu/test_deepep_real.py, which skips (with the reason) where deep_ep V2 is absent.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from functools import partial

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.comm import Comm, PeerIdentity, SingleRankComm
from ep_runtime.dispatch import deepep_environment, deepep_v2
from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher
from ep_runtime.dispatch.deepep_environment import RankGin, must_disable_gin
from ep_runtime.dispatch.deepep_v2 import DeepEPV2Dispatcher
from ep_runtime.dispatch.nccl_probe import (
    GinQuery,
    NcclLibrary,
    _CommProperties,
    _decode_version,
    probe_library,
)
from ep_runtime.dispatch.protocol import LayerIdentity
from ep_runtime.dispatch.setup import DispatchSetup, PeerSetup
from ep_runtime.placement import LocalExperts
from ep_runtime.types import ClosedError, DispatchMode, EPInputError, TopkLayout
from tests.multigpu import checks, deepep_cases, dispatch_cases, fp8_cases
from tests.multigpu.deepep_cases import HIDDEN
from tests.multigpu.rank_inputs import CaseSpec
from tests.support.comms import comm_without_group
from tests.support.deepep_imitation import (
    INVALID_LOCAL_ID,
    ImitationBackedDeepEP,
    imitation_library,
    register_imitation,
)
from tests.support.imitation_suite import LAYOUTS, MODES, imitation_suite

IMITATION = ImitationBackedDeepEP.name


globals().update(
    imitation_suite(
        IMITATION,
        register_imitation,
        world_sizes=(1, 2),
        activations=("silu", "relu2"),
        skip_note="; the real library is tested in tests/multigpu/test_deepep_real.py",
    )
)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_exact(imitation_pool, world_size, mode, layout):
    spec = CaseSpec(dispatcher=IMITATION, layout=layout, mode=mode, top_k=4, num_experts=8)
    assert sum(imitation_pool(world_size).run_ok(dispatch_cases.check_round_trip, spec)) > 0


@pytest.mark.parametrize("quantization", [None, "fp8_block"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dispatch_is_bitwise(imitation_pool, world_size, mode, layout, quantization):
    """Rows arrive bit for bit; with fp8 weights as the sender's ``q(x)`` (e4m3 and scales)."""
    spec = CaseSpec(
        dispatcher=IMITATION,
        layout=layout,
        mode=mode,
        tokens=(9, 5)[:world_size],
        intermediate=128,
        quantization=quantization,
    )
    pool = imitation_pool(world_size)
    assert sum(pool.run_ok(deepep_cases.check_dispatch_bitwise_any_order, spec)) > 0


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_layer_matches_the_oracle(imitation_pool, world_size, mode, layout):
    """The fp8 layer over the adapter's fp8 dispatch against the fp64 oracle of the contract."""
    spec = CaseSpec(dispatcher=IMITATION, layout=layout, mode=mode, **fp8_cases.FP8_SHAPES)
    checks.assert_all_pass(imitation_pool(world_size).run_ok(fp8_cases.run_fp8_case, spec))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_poison_mode_matches_clean_run(imitation_pool, layout):
    """fp8 dispatch in poison mode: NaN scales in the rows that hold no token never leak."""
    pool = imitation_pool(2)
    spec = CaseSpec(dispatcher=IMITATION, layout=layout, mode="capacity", **fp8_cases.FP8_SHAPES)
    checks.assert_poison_matches_clean(partial(pool.run_ok, fp8_cases.run_fp8_case), spec)


# ------------------------------------------------------------------ the adapter, one process
def _config(**changes) -> MoEConfig:
    fields = dict(
        num_experts=8,
        top_k=3,
        hidden_size=HIDDEN,
        intermediate_size=16,
        dtype=torch.bfloat16,
        max_tokens_per_rank=6,
    )
    return MoEConfig(**{**fields, **changes})


LAYER = LayerIdentity(fingerprint=1, index=0)


def _setup(mode: DispatchMode, cap: int = 6, world_size: int = 1) -> DispatchSetup:
    return DispatchSetup(
        comm=comm_without_group(world_size, torch.device("cpu")),
        num_experts=8,
        hidden_size=HIDDEN,
        max_top_k=3,
        max_tokens_per_rank=cap,
        dtype=torch.bfloat16,
        mode=mode,
    )


def _build(cls: type[Dispatcher], setup: DispatchSetup) -> Dispatcher:
    """A dispatcher for a world of one (no process group, so no peers to watch)."""
    return cls(setup, PeerSetup("test", [PeerIdentity.of_this_process()]))


def _dispatch(dispatcher: Dispatcher, x, ids, weights, layout: TopkLayout):
    dispatched, num_chunks = dispatcher.dispatch(x, ids, weights, layout, layer=LAYER)
    assert num_chunks == 1
    return dispatched


def _inputs(num_tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=generator)[:3] for _ in range(num_tokens)])
    ids[0, 1] = -1
    weights = 0.25 + torch.rand(num_tokens, 3, generator=generator)
    return x, ids, weights


@pytest.mark.parametrize("mode", list(DispatchMode))
def test_buffer_is_built_as_the_design_says(mode):
    dispatcher = _build(ImitationBackedDeepEP, _setup(mode, cap=6))
    try:
        kwargs = dispatcher.buffer.constructor_kwargs
        assert kwargs["allow_hybrid_mode"] is False
        assert kwargs["allow_multiple_reduction"] is False
        assert kwargs["explicitly_destroy"] is True
        assert kwargs["num_cpu_timeout_secs"] >= 1800 and kwargs["num_gpu_timeout_secs"] >= 1800
        assert (kwargs["hidden"], kwargs["num_topk"]) == (HIDDEN, 3)
        # capacity: one JIT variant per power of two; exact: the cap itself
        assert kwargs["num_max_tokens_per_rank"] == (6 if mode is DispatchMode.EXACT else 8)
        assert kwargs["deterministic"] is (mode is DispatchMode.EXACT)
        assert dispatcher.num_sms == deepep_environment.DEFAULT_NUM_SMS > 0
    finally:
        dispatcher.close()


def test_capacity_checks_the_users_cap_not_the_buffers(monkeypatch):
    """7 rows fit DeepEP's 8-row buffer, not the user's cap of 6: the layer refuses them."""
    monkeypatch.setitem(DISPATCHERS._classes, IMITATION, ImitationBackedDeepEP)  # this test only
    layer = EPMoE(
        _config(), dispatcher=IMITATION, experts="reference", mode="capacity", device="cpu"
    )
    try:
        assert layer.dispatcher.buffer.constructor_kwargs["num_max_tokens_per_rank"] == 8
        layer.load_weights(
            torch.zeros(8, 32, HIDDEN, dtype=torch.bfloat16), torch.zeros(8, HIDDEN, 16)
        )
        x, ids, weights = _inputs(7)
        with pytest.raises(EPInputError, match="at most max_tokens_per_rank=6 rows"):
            layer(x, ids, weights)
        x, ids, weights = _inputs(6)
        assert layer(x, ids, weights).shape == (6, HIDDEN)
    finally:
        layer.close()


def test_close_destroys_the_buffer_and_use_after_close_fails():
    dispatcher = _build(ImitationBackedDeepEP, _setup(DispatchMode.EXACT))
    buffer = dispatcher.buffer
    dispatcher.close()
    assert buffer.destroyed and dispatcher.buffer is None
    with pytest.raises(ClosedError):
        _dispatch(dispatcher, *_inputs(2), TopkLayout.STANDARD)


@pytest.mark.parametrize("layout", list(TopkLayout))
@pytest.mark.parametrize("mode", list(DispatchMode))
def test_rank_without_tokens_gets_an_empty_result(layout, mode):
    """DeepEP is handed one row routed nowhere; the caller still gets ``[0, H]`` back."""
    dispatcher = _build(ImitationBackedDeepEP, _setup(mode))
    try:
        x, ids, weights = (t[:0] for t in _inputs(1))
        dispatched = _dispatch(dispatcher, x, ids, weights, layout)
        assert not bool((dispatched.topk_ids >= 0).any())
        out = dispatcher.combine(dispatch_cases.weighted_identity(dispatched), dispatched)
        assert out.shape == (0, HIDDEN)
    finally:
        dispatcher.close()


def test_standard_capacity_masks_uninitialised_rows_and_globalises_ids():
    """The imitation leaves id 0 (a valid-looking local id) and NaN in rows past the valid
    count; the adapter must turn them into padding (all ids -1)."""
    dispatcher = _build(ImitationBackedDeepEP, _setup(DispatchMode.CAPACITY, cap=6))
    try:
        x, ids, weights = _inputs(5)
        dispatched = _dispatch(dispatcher, x, ids, weights, TopkLayout.STANDARD)
        assert dispatched.hidden_states.size(0) == 8  # W · pow2(cap) rows
        assert (dispatched.topk_ids[5:] == -1).all()
        assert torch.isnan(dispatched.hidden_states[5:].float()).all()
        assert dispatched.topk_ids.dtype == torch.int32
        sent = torch.sort(ids.flatten()).values
        got = torch.sort(dispatched.topk_ids[:5].flatten().to(torch.int64)).values
        assert torch.equal(got, sent), "global ids (rank 0 of 1: local == global)"
    finally:
        dispatcher.close()


def test_local_ids_become_global_on_rank_one_of_two():
    """Rank 1 of 2: local id 2 is global 6. Hand the adapter a DeepEP-shaped answer."""
    dispatcher = ImitationBackedDeepEP.__new__(ImitationBackedDeepEP)  # no buffer: _standard only
    dispatcher.setup = DispatchSetup(
        comm=comm_without_group(2, torch.device("cpu"), rank=1),
        num_experts=8,
        hidden_size=HIDDEN,
        max_top_k=3,
        max_tokens_per_rank=4,
        dtype=torch.bfloat16,
        mode=DispatchMode.CAPACITY,
    )
    dispatcher.placement = dispatcher.setup.placement
    dispatcher.local = LocalExperts(offset=4, count=4)
    handle = types.SimpleNamespace(
        psum_num_recv_tokens_per_scaleup_rank=torch.tensor([1, 2], dtype=torch.int32)
    )
    local = torch.tensor([[2, -1, 0], [-1, 3, -1], [INVALID_LOCAL_ID] * 3])
    weights = torch.tensor([[0.5, float("nan"), 0.25], [float("nan"), 1.0, 2.0], [9.0] * 3])
    ids, weights, valid_rows = dispatcher._standard(local, weights, handle)
    assert valid_rows.tolist() == [True, True, False]
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[6, -1, 4], [-1, 7, -1], [-1, -1, -1]]
    assert weights[0, 0] == 0.5 and weights[1, 1] == 1.0 and weights[0, 2] == 0.25
    assert (weights[ids < 0] == 0).all()  # unused slots: the filler, not DeepEP's values


def test_expanded_groups_are_aligned_and_padding_marked():
    dispatcher = _build(ImitationBackedDeepEP, _setup(DispatchMode.EXACT, cap=6))
    try:
        x, ids, weights = _inputs(6, seed=3)
        dispatched = _dispatch(dispatcher, x, ids, weights, TopkLayout.EXPANDED)
        offsets = dispatched.expert_offsets.tolist()
        assert all(start % 4 == 0 for start in offsets[:-1]), offsets  # expert_alignment = 4
        counts = torch.bincount(ids[ids >= 0], minlength=8).tolist()
        assert dispatched.topk_ids.shape == (dispatched.hidden_states.size(0), 1)
        for expert in range(8):
            group = dispatched.topk_ids[offsets[expert] : offsets[expert + 1], 0]
            assert group[: counts[expert]].eq(expert).all() and group[counts[expert] :].eq(-1).all()
        padding = dispatched.topk_ids[:, 0] < 0
        assert torch.isnan(dispatched.hidden_states[padding].float()).all()  # NaN gaps stay
        assert offsets[-1] == offsets[-2] + counts[-1]  # the valid bound: psum[-1]
    finally:
        dispatcher.close()


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("layout", list(TopkLayout))
@pytest.mark.parametrize("mode", list(DispatchMode))
def test_ids_reach_deepep_in_its_topk_idx_t(id_dtype, layout, mode):
    """A deep_ep built with 32-bit ids gets int32 (the imitation asserts the width it was
    built with); the round trip with small integers and dyadic weights is exact."""

    class Narrow(ImitationBackedDeepEP):
        @classmethod
        def load_library(cls):
            return imitation_library(id_dtype)

    dispatcher = _build(Narrow, _setup(mode))
    try:
        x, ids, _ = _inputs(5)
        x = torch.randint(-15, 16, x.shape).to(torch.bfloat16)
        weights = torch.randint(1, 5, ids.shape).float() / 8
        dispatched = _dispatch(dispatcher, x, ids, weights, layout)
        out = dispatcher.combine(dispatch_cases.weighted_identity(dispatched), dispatched)
        total = torch.where(ids >= 0, weights, torch.zeros_like(weights)).sum(1, keepdim=True)
        assert torch.equal(out, (total * x.float()).to(torch.bfloat16))
    finally:
        dispatcher.close()


# ------------------------------------------------------------------ refusals and GIN
def test_auto_on_cpu_alone_moves_nothing_and_says_why_not_deepep():
    layer = EPMoE(_config(), dispatcher="auto", experts="reference", device="cpu")
    try:
        assert layer.choice.dispatcher == "local"
        assert "runs here too" in layer.choice.passed_over["dispatcher:torch_a2a"]
        assert "cuda" in layer.choice.refused["dispatcher:deepep_v2"]
    finally:
        layer.close()


@pytest.fixture
def fresh_problems():
    deepep_v2.deep_ep_problems.cache_clear()
    yield
    deepep_v2.deep_ep_problems.cache_clear()


def _cuda_setup(world_size: int) -> DispatchSetup:
    return DispatchSetup(
        comm=comm_without_group(world_size, torch.device("cuda", 0)),
        num_experts=8,
        hidden_size=HIDDEN,
        max_top_k=3,
        max_tokens_per_rank=4,
        dtype=torch.bfloat16,
        mode=DispatchMode.EXACT,
    )


def test_refusal_on_the_h200_test_machine(monkeypatch, fresh_problems):
    """NCCL 2.28.9 and no deep_ep (DEVICE.md): both reasons, in one line."""
    old = NcclLibrary(True, ("/site/nvidia/nccl/lib/libnccl.so.2",), (2, 28, 9), False)
    monkeypatch.setattr(deepep_v2, "probe_library", lambda: old)
    monkeypatch.setattr(deepep_v2, "mapped_libnccl_paths", lambda: old.paths)
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ModuleNotFoundError
    reason = DeepEPV2Dispatcher.unavailable_reason(_cuda_setup(1))
    assert "deep_ep is not installed" in reason
    assert "NCCL 2.28.9" in reason and "needs NCCL >= 2.30.4" in reason
    assert "ncclCommQueryProperties" in reason and "\n" not in reason


def test_refusal_for_v1_deep_ep_two_libncc_and_one_gpu(monkeypatch, fresh_problems):
    new = NcclLibrary(True, ("/a/libnccl.so.2",), (2, 30, 7), True)
    monkeypatch.setattr(deepep_v2, "probe_library", lambda: new)
    monkeypatch.setattr(
        deepep_v2, "mapped_libnccl_paths", lambda: ("/a/libnccl.so.2", "/b/libnccl.so.2")
    )
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(__version__="1.0.0"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    reason = DeepEPV2Dispatcher.unavailable_reason(_cuda_setup(2))
    assert "deep_ep 1.0.0 has no ElasticBuffer" in reason
    assert "different libnccl files: /a/libnccl.so.2, /b/libnccl.so.2" in reason
    assert "needs >= 2 GPUs, this host has 1" in reason
    assert "NCCL process group" in reason
    assert "2.30.7" not in reason  # a new-enough NCCL is not a reason


def _rank(host: str, gin_type: int | None, env: str | None = None) -> RankGin:
    return RankGin(host, GinQuery(gin_type, gin_type), env)


def test_gin_decision():
    assert must_disable_gin([_rank("a", 3), _rank("a", 3)]) is False  # GDAKI everywhere
    assert must_disable_gin([_rank("a", 3), _rank("b", 2)]) is False  # GIN across nodes
    assert must_disable_gin([_rank("a", 0), _rank("a", 0)]) is True  # one NVLink node
    assert must_disable_gin([_rank("a", None)]) is True  # unknown on one node
    assert must_disable_gin([_rank("a", 3, "1"), _rank("a", 3, "1")]) is True
    with pytest.raises(RuntimeError, match=r"across 2 hosts needs NCCL GIN.*rank 1 \(b\)"):
        must_disable_gin([_rank("a", 3), _rank("b", 0)])
    with pytest.raises(RuntimeError, match="differs across ranks"):
        must_disable_gin([_rank("a", 0, "1"), _rank("a", 0)])
    with pytest.raises(RuntimeError, match="spans 2 hosts"):
        must_disable_gin([_rank("a", 0, "1"), _rank("b", 0, "1")])


def test_nccl_probe_on_this_machine():
    library = probe_library()
    if torch.cuda.is_available():
        assert library.version is not None, library.describe()
    else:
        assert library.describe().startswith("no CUDA device")
        assert not library.meets_deepep_minimum


def test_probe_struct_matches_the_c_layout():
    """ncclCommProperties (nccl.h, 2.31.2) laid out with C alignment: size_t, 2 uint, 4 int,
    2 bool, int ginType at 36, nLsaTeams 40, bool 44, railedGinType 48, uint64 commHash 56."""
    assert _CommProperties.ginType.offset == 36
    assert _CommProperties.railedGinType.offset == 48
    assert _CommProperties.commHash.offset == 56
    assert _decode_version(22809) == (2, 28, 9) and _decode_version(23004) == (2, 30, 4)


def test_imitation_is_adversarial_where_deepep_is_unspecified():
    """Guard the guard: the imitation must keep the traps the adapter is tested against."""
    buffer = imitation_library().buffer_class(
        None,
        num_max_tokens_per_rank=8,
        hidden=HIDDEN,
        num_topk=3,
        allow_multiple_reduction=False,
        explicitly_destroy=True,
    )
    x, ids, weights = _inputs(5)
    recv_x, recv_ids, recv_w, handle, _ = buffer.dispatch(
        x, ids, weights, num_experts=8, num_sms=24, do_cpu_sync=False
    )
    assert recv_x.size(0) == 8 and int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == 5
    assert torch.isnan(recv_x[5:].float()).all() and (recv_ids[5:] == INVALID_LOCAL_ID).all()
    assert torch.isnan(recv_w[:5][recv_ids[:5] < 0]).all()  # weights on -1 slots: unspecified
    recv_x, recv_ids, recv_w, handle, _ = buffer.dispatch(
        x, ids, weights, num_experts=8, num_sms=24, do_expand=True, expert_alignment=4
    )
    assert recv_ids is None and recv_w.dim() == 1
    assert torch.isnan(recv_x.float()).any(), "alignment gaps must hold NaN"
    with pytest.raises(AssertionError):
        buffer.dispatch(x[:0], ids[:0], weights[:0], num_experts=8, num_sms=24)
    with pytest.raises(AssertionError):
        buffer.dispatch(x, ids.to(torch.int32), weights, num_experts=8, num_sms=24)


# ------------------------------------------------------------------ the first-dispatch probe
@pytest.fixture
def fresh_probe():
    deepep_v2.first_dispatch_problem.cache_clear()
    yield
    deepep_v2.first_dispatch_problem.cache_clear()


@pytest.fixture
def installed_setup(monkeypatch) -> DispatchSetup:
    """A world of one on "cuda:0" whose group claims NCCL and whose deep_ep claims to be
    installed: everything but the probe (and the setup's own values) passes."""
    monkeypatch.setattr(deepep_v2, "deep_ep_problems", lambda: ())
    monkeypatch.setattr(Comm, "backend", property(lambda self: "nccl"))
    return dataclasses.replace(
        _cuda_setup(1), comm=SingleRankComm(torch.device("cuda", 0), object())
    )


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
            "killed a probe process with SIGSEGV (a known cause: deep_ep built with a compiler",
        ),
        (
            "import sys; sys.exit('no GIN for you')",
            "failed in a probe process (exit 1: no GIN for you)",
        ),
        ("print('dispatched')", None),
    ],
)
def test_first_dispatch_probe_refuses_a_crashing_deepep(
    monkeypatch, fresh_probe, installed_setup, script, expected
):
    """The probe's verdict (a stand-in script plays DeepEP's first dispatch): a crash or an
    error refuses the backend, naming what happened; a clean run does not."""
    monkeypatch.setattr(deepep_v2, "PROBE_COMMAND", [sys.executable, "-c", script])
    reason = deepep_v2.DeepEPV2Dispatcher.unavailable_reason(installed_setup)
    if expected is None:
        assert reason is None
    else:
        assert expected in reason and "docs/deepep.md" in reason


@pytest.mark.parametrize("hidden", [128, 7168 + 128])
def test_hidden_off_the_combine_step_is_refused(hidden):
    """DeepEP V2's combine kernel does not compile for H % 256 != 0 (seen on the H200 with
    H = 128): refused up front, naming the setting, whatever else the machine has."""
    setup = dataclasses.replace(_setup(DispatchMode.EXACT), hidden_size=hidden)
    reason = ImitationBackedDeepEP.unavailable_reason(setup)
    assert reason == (
        f"hidden_size={hidden}: DeepEP V2's combine needs a multiple of 256 "
        "(32 lanes x 16 bytes of bf16 per step)"
    )
    assert ImitationBackedDeepEP.unavailable_reason(_setup(DispatchMode.EXACT)) is None


def test_hidden_off_the_combine_step_skips_the_probe(monkeypatch, installed_setup):
    """The probe can take minutes (it compiles DeepEP's kernels): a layer refused for its hidden
    size is refused without it."""
    monkeypatch.setattr(
        deepep_v2, "first_dispatch_problem", lambda index: pytest.fail("the probe ran")
    )
    setup = dataclasses.replace(installed_setup, hidden_size=128)
    reason = DeepEPV2Dispatcher.unavailable_reason(setup)
    assert reason.startswith("hidden_size=128: DeepEP V2's combine needs a multiple of 256")


def test_first_dispatch_probe_can_be_skipped(monkeypatch, fresh_probe):
    monkeypatch.setenv(deepep_v2.PROBE_ENV, "0")
    monkeypatch.setattr(deepep_v2, "PROBE_COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
    assert deepep_v2.first_dispatch_problem(0) is None
