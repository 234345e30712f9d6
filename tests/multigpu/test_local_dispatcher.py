"""The world-of-one transport (``dispatcher="local"``): ``"auto"``'s pick alone, refused in a
group of two, and the packed-row transport's results bit for bit (the same route, checks and
reductions, nothing packed): layer outputs of every unquantized experts backend and of the fp8
layer, the round trip, poison, and what arrives. The registry-driven suite (test_suite.py) runs
it against ``reference_moe`` at world size 1 like every dispatcher; the fp8 case here also
against the fp64 oracle of the contract."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.dispatch import DISPATCHERS
from ep_runtime.dispatch.local import LocalDispatcher
from ep_runtime.dispatch.setup import DEVICE_CHECKS_ENV, DispatchSetup
from ep_runtime.kernels import TORCH_OPS, TRITON_OPS, KernelOps
from ep_runtime.kernels.triton_common import HAS_TRITON
from ep_runtime.quantization import quantize_weight_blocks
from ep_runtime.selection import _dispatcher_refusal
from ep_runtime.types import DispatchMode, TopkLayout
from tests.multigpu import checks, dispatch_cases, fp8_cases, rank_inputs
from tests.multigpu.layer_cases import run_layer_case
from tests.multigpu.pool import RankFailure
from tests.multigpu.rank_inputs import CaseSpec, build_layer, device, make_inputs
from tests.multigpu.test_suite import run_checked

LOCAL, ROWS = "local", "torch_a2a"
LAYOUTS = ["standard", "expanded"]
MODES = ["exact", "capacity"]


def layer_output(spec: CaseSpec) -> torch.Tensor:
    """Rank side: this rank's layer output on the suite's inputs (odd T, NaN weights on -1
    slots, a token served by nobody), with the caller's ``x`` checked untouched."""
    x, ids, weights = make_inputs(spec, dist.get_rank())
    layer = build_layer(spec)
    try:
        dev = device()
        x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
        given = x.clone()
        out = layer(x, ids, weights)
        assert torch.equal(x, given), "the layer wrote into its input"
        assert layer.choice.dispatcher == spec.dispatcher
        return out.cpu()
    finally:
        layer.close()


def outputs_of(pool, spec: CaseSpec) -> list[torch.Tensor]:
    return pool.run_ok(layer_output, spec)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("experts", ["reference", "grouped_mm", "triton"])
def test_layer_output_is_the_packed_row_transports_bitwise(pool_factory, experts, layout, mode):
    pool = pool_factory(1)
    spec = CaseSpec(experts=experts, layout=layout, mode=mode, activation="silu")
    (local,), (rows,) = (
        outputs_of(pool, rank_inputs.with_spec(spec, dispatcher=d)) for d in (LOCAL, ROWS)
    )
    assert torch.isfinite(local).all() and local.abs().sum() > 0
    assert torch.equal(local, rows)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_layer_sends_q_of_x_as_the_packed_rows_do(pool_factory, layout, mode):
    """fp8 experts read ``q(x)`` and its scales: the same bits as the packed rows carry, so the
    same output; and the layer passes against the fp64 oracle of the contract."""
    pool = pool_factory(1)
    spec = CaseSpec(**fp8_cases.FP8_SHAPES, layout=layout, mode=mode, quantization="fp8_block")
    (local,), (rows,) = (
        outputs_of(pool, rank_inputs.with_spec(spec, dispatcher=d)) for d in (LOCAL, ROWS)
    )
    assert torch.equal(local, rows)
    checks.assert_all_pass(
        pool.run_ok(fp8_cases.run_fp8_case, rank_inputs.with_spec(spec, dispatcher=LOCAL))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_exact(pool_factory, dtype, mode, layout) -> None:
    spec = CaseSpec(dispatcher=LOCAL, layout=layout, mode=mode, dtype=dtype, top_k=4)
    rows = pool_factory(1).run_ok(dispatch_cases.check_round_trip, spec)
    assert sum(rows) > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_arrives_is_what_was_sent(pool_factory, mode, layout) -> None:
    spec = CaseSpec(dispatcher=LOCAL, layout=layout, mode=mode, top_k=3, tokens=(9,))
    assert sum(pool_factory(1).run_ok(dispatch_cases.check_dispatch_bitwise, spec)) > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_poison_mode_matches_clean_run(pool_factory, mode, layout) -> None:
    pool = pool_factory(1)
    spec = CaseSpec(dispatcher=LOCAL, experts="grouped_mm", layout=layout, mode=mode)
    checks.assert_poison_matches_clean(lambda s: run_checked(pool, s), spec)


@pytest.mark.parametrize(("fault", "mode"), checks.BAD_INPUTS)
def test_bad_input_is_named(pool_factory, fault, mode) -> None:
    pool = pool_factory(1)
    spec = CaseSpec(dispatcher=LOCAL, experts="grouped_mm")
    checks.assert_bad_input_fails_every_rank(
        pool, lambda s: run_checked(pool, s), spec, fault, mode
    )


def test_refused_in_a_group_of_two_on_every_rank(pool_factory) -> None:
    results = pool_factory(2).run(run_layer_case, CaseSpec(dispatcher=LOCAL))
    assert all(isinstance(r, RankFailure) for r in results), results
    for failure in results:
        assert failure.type_name == "BackendUnavailableError", failure
        assert "local (standard): runs in a group of <= 1 ranks, got 2" in failure.message


class CountingOps:
    """An op set (torch's, or the Triton kernels, interpreted on CPU) counting each op a
    forward calls: the launches a GPU forward makes."""

    def __init__(self, ops: KernelOps) -> None:
        self.ops = ops
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        op = getattr(self.ops, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return op(*args, **kwargs)

        return counted


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("device_checks", [False, True], ids=["host_checks", "device_checks"])
@pytest.mark.parametrize("ops", [TORCH_OPS, TRITON_OPS], ids=["torch_ops", "triton_ops"])
@pytest.mark.parametrize(
    ("layout", "saved"),
    [("standard", ["pack_rows", "local_ids"]), ("expanded", ["pack_rows", "sum_rows"])],
)
def test_alone_it_skips_the_pack_and_one_more_op(
    monkeypatch, layout, saved, ops, device_checks, quantized
):
    """Hand count of the transport's ops in one forward against the packed-row transport's
    (fp8: ``q(x)`` is the one op where the pack was), outputs bitwise equal; with the ids'
    verdict read on the host or (the CUDA path, forced on here) on the device; through the torch
    ops and through the Triton kernels (compiled on a GPU, else interpreted on CPU)."""
    if ops is TRITON_OPS and not HAS_TRITON:
        pytest.skip("triton is not installed")
    on = "cuda" if ops is TRITON_OPS and torch.cuda.is_available() else "cpu"
    if device_checks:
        monkeypatch.setenv(DEVICE_CHECKS_ENV, "1")
    hidden = 128 if quantized else 32
    config = MoEConfig(
        8, 2, hidden, hidden // 2 if not quantized else 128, dtype=torch.bfloat16,
        quantization="fp8_block" if quantized else None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(8, 2 * config.intermediate_size, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(8, hidden, config.intermediate_size, generator=g) / hidden**0.5
    x = torch.randn(5, hidden, generator=g).bfloat16()
    ids, weights = torch.tensor([[0, 3], [1, -1], [-1, -1], [7, 2], [3, 0]]), torch.rand(5, 2)
    x, ids, weights = x.to(on), ids.to(on), weights.to(on)
    calls, outputs = {}, {}
    for name in (LOCAL, ROWS):
        layer = EPMoE(
            config,
            dispatcher=name,
            experts="reference",
            layout=layout,
            device=on,
            device_checks=device_checks,
        )
        try:
            if quantized:
                (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
                layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
            else:
                layer.load_weights(w13, w2)
            counting = layer.dispatcher.ops = CountingOps(ops)
            outputs[name] = layer(x, ids, weights)
            calls[name] = counting.calls
        finally:
            layer.close()
    assert torch.isfinite(outputs[LOCAL]).all() and outputs[LOCAL].abs().sum() > 0
    assert torch.equal(outputs[LOCAL], outputs[ROWS])
    remaining = list(calls[ROWS]) + (["quantize_rows"] if quantized else [])
    for op in saved:
        remaining.remove(op)
    assert sorted(calls[LOCAL]) == sorted(remaining), calls


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("layout", list(TopkLayout), ids=lambda layout: layout.value)
def test_auto_tries_it_first_in_a_world_of_one(device_type: str, layout: TopkLayout) -> None:
    """``"auto"`` tries it before every other dispatcher (DeepEP V2 included) and takes it, on
    CPU and on CUDA (where its Triton path ran compiled: BENCHMARKS.md, 2026-12-04)."""
    setup = DispatchSetup(
        comm=SimpleNamespace(device=torch.device(device_type), world_size=1),  # type: ignore[arg-type]
        num_experts=8,
        hidden_size=32,
        max_top_k=2,
        max_tokens_per_rank=None,
        dtype=torch.bfloat16,
        mode=DispatchMode.EXACT,
    )
    candidates = DISPATCHERS.candidates("auto")
    assert candidates[0] is LocalDispatcher, [c.name for c in candidates]
    assert _dispatcher_refusal(LocalDispatcher, "auto", setup, layout) is None


@pytest.mark.parametrize("device_checks", [False, True], ids=["host_checks", "device_checks"])
def test_a_token_sent_nowhere_is_zero_whatever_its_expert_row_holds(monkeypatch, device_checks):
    """STANDARD: rows of tokens with no served slot may hold anything after the experts (the
    ``Dispatched`` contract); combine must not read them. A stand-in for the experts writes NaN
    there (and each served row's weighted identity): the output is exact zeros for those tokens
    and the weighted sum elsewhere, as with the packed-row transport."""
    if device_checks:
        monkeypatch.setenv(DEVICE_CHECKS_ENV, "1")
    config = MoEConfig(8, 2, 32, 16, dtype=torch.float32)
    x = torch.randint(-8, 9, (6, 32)).float()
    ids = torch.tensor([[0, 3], [-1, -1], [5, -1], [-1, -1], [9, -1], [1, 2]])  # 9: invalid
    weights = torch.full((6, 2), 0.5)
    layer = EPMoE(
        config, dispatcher=LOCAL, layout="standard", device="cpu", device_checks=device_checks
    )
    try:
        if not device_checks:  # else the bad id is dropped, not raised (check() names it)
            ids[4, 0] = -1
        dispatched, _ = layer.dispatcher.dispatch(
            x, ids, weights, layer.layout, layer=layer.identity
        )
        served = dispatched.topk_ids >= 0  # [T, K]
        results = torch.where(served, dispatched.topk_weights, 0.0).sum(1, keepdim=True) * x
        results[~served.any(1)] = float("nan")
        out = layer.dispatcher.combine(results, dispatched)
    finally:
        layer.close()
    nowhere = torch.tensor([False, True, False, True, True, False])
    assert torch.equal(out[nowhere], torch.zeros(3, 32))
    assert torch.equal(out[~nowhere], x[~nowhere] * torch.tensor([[1.0], [0.5], [1.0]]))
