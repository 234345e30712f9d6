"""FP8 block-scaled experts on CPU against the fp64 oracle of the contract
(tests/support/fp8_oracle.py,
written from the formulas): the e4m3 rounding, the activation and weight quantizers, the layer
(world size 1 in-process; W = 2–4 in tests/multigpu/test_fp8_layer.py), the distance to the
unquantized layer on the same weights, and bad fp8 inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_runtime import BackendUnavailableError, EPInputError, EPMoE, MoEConfig
from ep_runtime.quantization import (
    FP8_DTYPE,
    dequantize_activations,
    dequantize_weight_blocks,
    quantize_activations,
    quantize_weight_blocks,
)
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support import fp8_oracle

E, K, H, I = 8, 3, 256, 128  # noqa: E741


def all_e4m3_values() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).double()
    return values[torch.isfinite(values)].unique()  # 253: ±0 merge, two NaNs dropped


# --- the e4m3 rounding and the quantizers -------------------------------------------------------


def test_oracle_rounding_is_torch_cast():
    """The oracle's hand-written round-to-nearest-even equals torch's own cast, on every e4m3
    value, on every midpoint between neighbours (ties) and on random values over the range."""
    values = all_e4m3_values()
    assert values.numel() == 253 and values.max() == 448 and values[values > 0].min() == 2**-9
    assert torch.equal(fp8_oracle.round_to_e4m3(values), values)
    midpoints = (values[1:] + values[:-1]) / 2
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.exp2(torch.randint(-12, 9, (20000,), generator=generator).double())
    random = (2 * torch.rand(20000, generator=generator, dtype=torch.float64) - 1) * magnitudes
    for v in (midpoints, random.clamp(-448, 448)):
        assert torch.equal(fp8_oracle.round_to_e4m3(v), v.to(FP8_DTYPE).double())
    # a tie goes to the even mantissa: 1 + 1/16 lies between 1 and 1.125
    assert fp8_oracle.round_to_e4m3(torch.tensor([1 + 1 / 16, 1 + 3 / 16])).tolist() == [1, 1.25]


def activation_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows with ordinary, large, tiny (subnormal after scaling), all-zero and saturating
    groups."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4 * 128, generator=generator)
    x[1] *= 1e4
    x[2, :128] *= 1e-6
    x[3, 128:256] = 0
    x[4, 256:384] = torch.linspace(-3, 3, 128)  # a group whose amax is at its ends
    x[5, :128] = 0
    x[5, 5] = 1e-12  # amax below the 1e-10 floor
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_activation_quantizer_is_the_formula(dtype):
    x = activation_rows(dtype)
    q, s = quantize_activations(x)
    q_oracle, s_oracle = fp8_oracle.quantize_groups(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (6, 4)
    assert torch.equal(s.double(), s_oracle)
    assert torch.equal(q.double(), q_oracle)
    assert not q[3, 128:256].double().any() and s[3, 1] == torch.tensor(1e-10 / 448)
    assert (q.double().abs().amax(dim=1) == 448).all()  # each row's amax maps to ±448
    deq = dequantize_activations(q, s)
    assert deq.dtype == torch.float32
    assert torch.equal(deq.double(), fp8_oracle.fake_quantize(x).float().double())


def test_weight_quantizer_round_trip():
    """Production weight quantizer bitwise equal to the oracle's formula; dequantization is
    ``w.float()·scale_inv`` (one fp32 rounding of the exact product); every value within half
    an e4m3 spacing of the original."""
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(3, 256, 384, generator=generator)
    w[0, :128, :128] *= 1e-3  # blocks with very different scales
    w[1, 128:, 256:] = 0  # an all-zero block: scale from the 1e-10 floor, zeros
    w = w.to(torch.bfloat16)
    q, scale_inv = quantize_weight_blocks(w)
    q_oracle, s_oracle = fp8_oracle.quantize_blocks(w)
    assert q.dtype == FP8_DTYPE and scale_inv.shape == (3, 2, 3)
    assert scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv.double(), s_oracle) and torch.equal(q.double(), q_oracle)
    assert not q[1, 128:, 256:].double().any()
    deq = dequantize_weight_blocks(q, scale_inv)
    exact = fp8_oracle.dequantize_blocks(q, scale_inv)
    assert torch.equal(deq, exact.float())
    full_scale = scale_inv.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    spacing = torch.exp2(torch.floor(torch.log2((w.double() / full_scale).abs().clamp_min(2**-6))))
    bound = spacing / 16 * full_scale + 2**-22 * w.double().abs()  # half of 2^(e-3), + fp32
    assert ((deq.double() - w.double()).abs() <= bound).all()


# --- the layer at world size 1 -------------------------------------------------------------------


def fp8_inputs(
    activation: str,
    dtype: torch.dtype,
    tokens: int = 40,
    seed: int = 0,
    hidden: int = H,
    intermediate: int = I,
    experts_with_rows: int = E,
):
    """Weights generated in bf16 and quantized per block (the launcher's recipe); ids with -1
    slots and a token served by nobody; NaN weights on -1 slots. ``experts_with_rows``: the ids
    name only every ``E / experts_with_rows``-th expert (the others get no rows)."""
    generator = torch.Generator().manual_seed(seed)
    rows = 2 * intermediate if activation == "silu" else intermediate
    w13 = (torch.randn(E, rows, hidden, generator=generator) / hidden**0.5).to(torch.bfloat16)
    w2 = torch.randn(E, hidden, intermediate, generator=generator) / intermediate**0.5
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2.to(torch.bfloat16))
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    every = E // experts_with_rows
    ids = torch.rand(tokens, experts_with_rows, generator=generator).topk(K, dim=1).indices * every
    ids = torch.where(torch.rand(tokens, K, generator=generator) < 0.15, -1, ids)
    ids[tokens // 2] = -1
    weights = 0.25 + 1.5 * torch.rand(tokens, K, generator=generator)
    weights = torch.where(ids >= 0, weights, float("nan"))
    return x, ids, weights, (q13, s13, q2, s2)


def fp8_layer(activation: str, dtype: torch.dtype, **options) -> EPMoE:
    config = MoEConfig(E, K, H, I, activation=activation, dtype=dtype, quantization="fp8_block")
    return EPMoE(config, max_tokens_per_rank=16, **{"device": "cpu", **options})  # CPU twin


def load(layer: EPMoE, weights) -> None:
    q13, s13, q2, s2 = weights
    layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)


def judge(out, x, ids, topk_weights, weights, activation, **oracle_options):
    ref, scale = fp8_moe_oracle(x, ids, topk_weights, weights, activation, **oracle_options)
    # The fp8 contract is judged at the bf16 tolerance whatever the compute dtype (issue 21):
    # fp32 and fp64 evaluations of q() may land on neighbouring e4m3 values for a few elements.
    return compare_per_token(out, ref, tolerance_for(torch.bfloat16, max(H, I)), scale)


def fp8_moe_oracle(x, ids, topk_weights, weights, activation, **options):
    q13, s13, q2, s2 = weights
    return fp8_oracle.fp8_moe_oracle(x, ids, topk_weights, q13, s13, q2, s2, activation, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_layer_matches_the_fp64_oracle(layout, mode, activation, dtype):
    x, ids, topk_weights, weights = fp8_inputs(
        activation, dtype, tokens=16 if mode == "capacity" else 40
    )
    layer = fp8_layer(activation, dtype, layout=layout, mode=mode)
    try:
        assert layer.choice.experts == "reference"  # "auto": the one fp8 backend on CPU
        assert "supports quantizations ['None'], not fp8_block" in layer.choice.describe()
        load(layer, weights)
        out = layer(x, ids, topk_weights)
    finally:
        layer.close()
    assert out.dtype == dtype
    comparison = judge(out, x, ids, topk_weights, weights, activation)
    assert comparison.passed, comparison.describe()
    assert not out[ids.size(0) // 2].any()  # served by nobody: an exact zero row


def test_exact_mode_chunks_past_the_cap():
    x, ids, topk_weights, weights = fp8_inputs("silu", torch.bfloat16, tokens=37)
    layer = fp8_layer("silu", torch.bfloat16, mode="exact")
    load(layer, weights)
    comparison = judge(layer(x, ids, topk_weights), x, ids, topk_weights, weights, "silu")
    layer.close()
    assert comparison.passed, comparison.describe()


def test_checker_fails_scales_of_the_wrong_experts():
    """Negative control: the same fp8 weights with each expert given its neighbour's scales."""
    x, ids, topk_weights, (q13, s13, q2, s2) = fp8_inputs("silu", torch.bfloat16)
    layer = fp8_layer("silu", torch.bfloat16)
    load(layer, (q13, s13.roll(1, dims=0), q2, s2.roll(1, dims=0)))
    out = layer(x, ids, topk_weights)
    layer.close()
    comparison = judge(out, x, ids, topk_weights, (q13, s13, q2, s2), "silu")
    assert not comparison.passed, comparison.describe()


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_distance_to_the_unquantized_layer(activation, capsys):
    """The bf16 layer on the same (dequantized) weights differs from the fp8 layer by the
    activation quantization alone: it matches the oracle without activation quantization, is
    farther from the fp8 oracle than the fp8 layer, and the distance is printed."""
    dtype = torch.bfloat16
    x, ids, topk_weights, weights = fp8_inputs(activation, dtype, tokens=64, seed=3)
    q13, s13, q2, s2 = weights
    fp8 = fp8_layer(activation, dtype)
    load(fp8, weights)
    out_fp8 = fp8(x, ids, topk_weights)
    fp8.close()
    bf16 = EPMoE(
        MoEConfig(E, K, H, I, activation=activation, dtype=dtype),
        experts="reference",
        device="cpu",
    )
    bf16.load_weights(dequantize_weight_blocks(q13, s13), dequantize_weight_blocks(q2, s2))
    out_bf16 = bf16(x, ids, topk_weights)
    bf16.close()

    unquantized = judge(
        out_bf16, x, ids, topk_weights, weights, activation, quantize_activations=False
    )
    assert unquantized.passed, unquantized.describe()
    fp8_error = judge(out_fp8, x, ids, topk_weights, weights, activation)
    bf16_distance = judge(out_bf16, x, ids, topk_weights, weights, activation)
    assert fp8_error.passed, fp8_error.describe()
    assert bf16_distance.max_relative_error > 2 * fp8_error.max_relative_error
    served = (ids >= 0).any(dim=1)
    diff = (out_fp8.double() - out_bf16.double()).norm(dim=1)[served]
    relative = diff / out_bf16.double().norm(dim=1)[served]
    with capsys.disabled():
        print(
            f"\n[fp8 vs bf16 layer, {activation}, H={H}, I={I}, same dequantized weights] "
            f"per-token relative distance: median {relative.median():.3e}, "
            f"max {relative.max():.3e}; fp8 layer vs fp8 oracle max "
            f"{fp8_error.max_relative_error:.3e}, bf16 layer vs fp8 oracle max "
            f"{bf16_distance.max_relative_error:.3e}"
        )


# --- bad fp8 inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        (dict(hidden_size=200), "hidden_size"),
        (dict(intermediate_size=96), "intermediate_size"),
        (dict(quantization="int4"), "quantization"),
    ],
)
def test_bad_config_is_named(changes, argument):
    settings = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    settings["quantization"] = "fp8_block"
    with pytest.raises(EPInputError) as raised:
        MoEConfig(**{**settings, **changes})
    assert raised.value.argument == argument


def test_unquantized_config_keeps_its_shapes():
    assert MoEConfig(E, K, 200, 96).quantization is None  # no block constraint without fp8


def bad_weight_cases():
    _, _, _, (q13, s13, q2, s2) = fp8_inputs("silu", torch.float32)
    good = dict(w13=q13, w2=q2, w13_scale_inv=s13, w2_scale_inv=s2)
    cases = {
        "missing_w13_scale": ({**good, "w13_scale_inv": None}, "w13_scale_inv"),
        "missing_w2_scale": ({**good, "w2_scale_inv": None}, "w2_scale_inv"),
        "w13_scale_shape": ({**good, "w13_scale_inv": s13[:, :-1]}, "w13_scale_inv"),
        "w2_scale_transposed": ({**good, "w2_scale_inv": s2.transpose(1, 2)}, "w2_scale_inv"),
        "w13_scale_bf16": ({**good, "w13_scale_inv": s13.bfloat16()}, "w13_scale_inv"),
        "w13_bf16": ({**good, "w13": q13.to(torch.bfloat16)}, "w13"),
        "w2_fp32": ({**good, "w2": q2.float()}, "w2"),
        "w13_e5m2": ({**good, "w13": q13.to(torch.float8_e5m2)}, "w13"),
    }
    return [pytest.param(kwargs, argument, id=name) for name, (kwargs, argument) in cases.items()]


@pytest.mark.parametrize(("kwargs", "argument"), bad_weight_cases())
def test_bad_fp8_weights_are_named(kwargs, argument):
    layer = fp8_layer("silu", torch.float32)
    with pytest.raises(EPInputError) as raised:
        layer.load_weights(**kwargs)
    layer.close()
    assert raised.value.argument == argument, str(raised.value)


def test_fp8_arguments_on_an_unquantized_layer_are_named():
    _, _, _, (q13, s13, q2, s2) = fp8_inputs("silu", torch.float32)
    layer = EPMoE(MoEConfig(E, K, H, I, dtype=torch.float32))
    w13 = dequantize_weight_blocks(q13, s13)
    w2 = dequantize_weight_blocks(q2, s2)
    for kwargs, argument in (
        (dict(w13=w13, w2=w2, w13_scale_inv=s13), "w13_scale_inv"),
        (dict(w13=w13, w2=w2, w2_scale_inv=s2), "w2_scale_inv"),
        (dict(w13=q13, w2=w2), "w13"),  # fp8 weights without the quantization: never upcast
    ):
        with pytest.raises(EPInputError) as raised:
            layer.load_weights(**kwargs)
        assert raised.value.argument == argument
    layer.close()


def test_a_backend_without_fp8_is_refused_with_its_reason():
    with pytest.raises(BackendUnavailableError, match=r"supports quantizations \['None'\]"):
        fp8_layer("silu", torch.float32, experts="grouped_mm")


def test_config_replace_keeps_the_enum():
    config = MoEConfig(E, K, H, I, quantization="fp8_block")
    assert dataclasses.replace(config, top_k=2).quantization is config.quantization
    assert config.quantization.value == "fp8_block"
