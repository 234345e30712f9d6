"""The fp8 path of the ``triton`` experts backend: the activation quantizer kernel
(``kernels/fp8_quant.py``) bitwise against the contract's quantizer and the fp64 oracle, the
fp8 GEMMs (``experts/gemm/expert_gemm_fp8.py``) against their torch specs, and the layer against the
fp64 oracle of the contract (tests/support/fp8_oracle.py) and the fp8 twin
(``experts="reference"``).

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``;
its fp8 loads and ``dot`` are exact, its fp32 → e4m3 cast is not, so the kernels round on the
bits there); with a GPU, compiled on CUDA. The GEMMs' fp32 sums run in another order than the
spec's, so their quantized results may land on the neighbouring e4m3 value for a few elements.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.experts.gemm import expert_gemm_fp8, expert_rows
from ep_runtime.experts.gemm.expert_tiles import TileConfig
from ep_runtime.kernels import fp8_quant
from ep_runtime.quantization import (
    FP8_DTYPE,
    dequantize_activations,
    quantize_activations,
    quantize_weight_blocks,
)
from tests.support import fp8_oracle
from tests.test_fp8 import activation_rows, all_e4m3_values, fp8_inputs, judge

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
E, K, H, I = 8, 3, 256, 128  # noqa: E741 (tests/test_fp8.py's shapes)
PLAIN = TileConfig(16, 128, 128, num_stages=1)
SWAPPED = TileConfig(16, 128, 128, num_stages=1, swap=True)
NARROW = TileConfig(16, 64, 128, num_stages=1, swap=True)  # GEMM2 only: 2 tiles per block
# several column tiles per program: GEMM1's one tile in 2s (one past the columns), GEMM2's
# 2 in 2s, its 4 narrow ones in 3s (the second group partial)
TWO_COLUMN_TILES = TileConfig(16, 128, 128, num_stages=1, tiles_n=2)
THREE_NARROW_TILES = TileConfig(16, 64, 128, num_stages=1, swap=True, tiles_n=3)
# two 128-deep blocks (each its own scales) per loop iteration (GEMM2 tests take I = 256)
TWO_BLOCKS_A_STEP = TileConfig(16, 128, 256, num_stages=1, swap=True)
TWO_BLOCKS_ONE_DEEP = TileConfig(16, 64, 256, num_stages=1)  # I = 128: one block a step


def tma(config: TileConfig) -> TileConfig:
    """``config`` with its weights (and contiguous rows) loaded through TMA descriptors."""
    return dataclasses.replace(config, tma=True)


def quantize_on_device(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(DEVICE)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=DEVICE)
    s = torch.empty(x.size(0), x.size(1) // 128, dtype=torch.float32, device=DEVICE)
    fp8_quant.triton_quantize_rows(x, q, s)
    return q.cpu(), s.cpu()


def tie_rows() -> torch.Tensor:
    """Groups whose amax is 448 (scale exactly 1): every e4m3 value, every midpoint between
    neighbours (ties to even) and the subnormal range."""
    values = all_e4m3_values().float()
    midpoints = (values[1:] + values[:-1]) / 2
    body = torch.cat([values, midpoints]).clamp(-448, 448)
    groups = -(-body.numel() // 127)
    padded = torch.cat([body, body.new_zeros(groups * 127 - body.numel())]).view(groups, 127)
    rows = torch.cat([torch.full((groups, 1), 448.0), padded], dim=1)  # [G, 128]
    return rows.reshape(1, -1)[:, : 128 * (rows.numel() // 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantize_kernel_is_the_contract_bitwise(dtype):
    x = activation_rows(dtype)
    q, s = quantize_on_device(x)
    q_spec, s_spec = quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), q_spec.view(torch.uint8))
    assert torch.equal(s, s_spec)
    q_oracle, s_oracle = fp8_oracle.quantize_groups(x)
    assert torch.equal(q.double(), q_oracle) and torch.equal(s.double(), s_oracle)


def test_quantize_kernel_rounds_ties_to_even_and_keeps_subnormals():
    x = tie_rows()
    q, s = quantize_on_device(x)
    assert (s == 1).all()
    assert torch.equal(q.view(torch.uint8), quantize_activations(x)[0].view(torch.uint8))
    assert torch.equal(q.double(), fp8_oracle.round_to_e4m3(x.double()))


def test_quantize_kernel_on_strided_rows():
    """Rows with a stride (as they arrive from the row transport): wide rows, several programs."""
    base = torch.randn(5, 4096 + 64, generator=torch.Generator().manual_seed(4))
    x = base.to(torch.bfloat16)[:, 32 : 32 + 2304]  # 18 groups: two programs per row
    q, s = quantize_on_device(x)
    q_spec, s_spec = quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), q_spec.view(torch.uint8)) and torch.equal(s, s_spec)


# --------------------------------------------------------------------------- GEMMs vs specs
def gemm_problem(gated: bool, layout: str, seed: int = 0, intermediate: int = I):
    """Local experts 0..3 of a rank, each with fewer rows than a tile; rows with unused slots,
    a row served by nobody, NaN in that row (never read)."""
    g = torch.Generator().manual_seed(seed)
    rows, top_k, num_local = 11, 2, 4
    w13 = torch.randn(num_local, (2 if gated else 1) * intermediate, H, generator=g) / H**0.5
    w2 = torch.randn(num_local, H, intermediate, generator=g) / intermediate**0.5
    w13[1, :128] *= 30  # blocks of very different scales
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2)
    x = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(rows, 6, generator=g).topk(top_k, dim=1).indices  # ids ≥ 4: not local
    ids[:, 0] = torch.where(ids[:, 0] == 2, 3, ids[:, 0])  # expert 2 gets no rows
    ids[4] = -1
    x[4] = float("nan")
    weights = 0.25 + torch.rand(rows, top_k, generator=g)
    x_q, x_s = quantize_activations(x)
    if layout == "standard":
        pairs, offsets = expert_rows.sort_pairs_spec(ids, local_offset=0, num_local=num_local)
    else:  # EXPANDED: the served (row, slot) pairs as grouped rows, then two padding rows
        pairs, offsets = expert_rows.sort_pairs_spec(ids, local_offset=0, num_local=num_local)
        served = int(offsets[-1])
        source = pairs[:served].long() // top_k
        x_q = torch.cat([x_q[source], x_q[:2]])
        x_s = torch.cat([x_s[source], torch.full((2, H // 128), float("nan"))])
        weights = torch.cat([weights.reshape(-1)[pairs[:served].long()], torch.ones(2)])[:, None]
        pairs = None
    weights = torch.where(torch.isfinite(weights), weights, 0.0)
    return (x_q, x_s, q13, s13, q2, s2, offsets, pairs, weights, top_k, rows)


def on_device(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


# Relative bound on the scales' distance to the spec's: fp32 sums in another order (interpreter,
# Ampere-style MMA) stay within 1e-5; Hopper's fp8 wgmma (the swapped decode tile) accumulates
# each 128-deep step with fewer mantissa bits (the DeepSeek-V3 report: about 14), measured 1e-4.
SCALE_BOUND = 2.0**-11 if CUDA else 1e-5


def assert_neighbouring_codes(got_q, got_s, want_q, want_s, valid_rows: int) -> None:
    """Scales within the accumulation's rounding of the spec's and each element on the spec's
    e4m3 value or a neighbour (another summation order), few of them off. Beyond the neighbour a
    code may also move by the accumulation's error, which is relative to the row's range (448
    codes), not to the code: on the H200 one code of 3328 near 0.018 landed 3 spacings (0.006
    codes) from the spec's at two column tiles."""
    got_q, want_q = got_q[:valid_rows].float(), want_q[:valid_rows].float()
    got_s, want_s = got_s[:valid_rows], want_s[:valid_rows]
    assert torch.isfinite(got_s).all()
    distance = (got_s - want_s).abs() / want_s
    assert (distance <= SCALE_BOUND).all(), distance.max()
    spacing = torch.exp2(torch.floor(torch.log2(want_q.abs().clamp_min(2**-6))) - 3)
    excess = (got_q - want_q).abs() - spacing * 1.0001
    assert (excess <= 448 * SCALE_BOUND).all(), excess.max()
    assert (got_q != want_q).float().mean() < 0.05


GEMM1_CONFIGS = [PLAIN, SWAPPED, TWO_COLUMN_TILES, TWO_BLOCKS_A_STEP]
GEMM1_IDS = ["plain", "swapped", "two-column-tiles", "two-blocks-a-step"]


def nan_codes_past(codes: torch.Tensor, valid: int) -> torch.Tensor:
    """``codes`` with every row from ``valid`` on an e4m3 NaN: rows no expert serves, which a
    TMA load of a last tile reads (each must meet only its own output row, never stored)."""
    codes = codes.clone()
    codes.view(torch.uint8)[valid:] = 0x7F
    return codes


@pytest.mark.parametrize(
    "config",
    GEMM1_CONFIGS + [tma(c) for c in GEMM1_CONFIGS],
    ids=GEMM1_IDS + [f"{name}-tma" for name in GEMM1_IDS],
)
@pytest.mark.parametrize("width", [I, 2 * I], ids=["one-column-tile", "two-column-tiles"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
def test_gemm1_fp8_matches_its_spec(gated, layout, width, config):
    x_q, x_s, q13, s13, _, _, offsets, pairs, _, top_k, _ = gemm_problem(
        gated, layout, intermediate=width
    )
    want_q, want_s = expert_gemm_fp8.expert_up_fp8_spec(
        x_q, x_s, q13, s13, offsets, pairs, top_k=top_k, gated=gated
    )
    if pairs is None:
        x_q = nan_codes_past(x_q, int(offsets[-1]))
    grouped = want_q.size(0)
    out_q = torch.full((grouped, width), float("nan"), device=DEVICE).to(FP8_DTYPE)
    out_s = torch.full((grouped, width // 128), float("nan"), device=DEVICE)
    args = on_device(x_q, x_s, q13, s13, offsets, pairs, out_q, out_s)
    expert_gemm_fp8.expert_up_fp8(*args, top_k=top_k, gated=gated, config=config)
    valid = int(offsets[-1])
    assert_neighbouring_codes(out_q.cpu(), out_s.cpu(), want_q, want_s, valid)
    again_q, again_s = torch.empty_like(out_q), torch.empty_like(out_s)
    expert_gemm_fp8.expert_up_fp8(
        *args[:6], again_q, again_s, top_k=top_k, gated=gated, config=config
    )
    bits = again_q[:valid].view(torch.uint8), out_q[:valid].view(torch.uint8)
    assert torch.equal(*bits) and torch.equal(again_s[:valid], out_s[:valid])  # deterministic


@pytest.mark.parametrize(
    "config",
    [
        PLAIN,
        SWAPPED,
        NARROW,
        TWO_COLUMN_TILES,
        THREE_NARROW_TILES,
        TWO_BLOCKS_A_STEP,
        TWO_BLOCKS_ONE_DEEP,
        tma(PLAIN),
        tma(SWAPPED),
        tma(THREE_NARROW_TILES),
        tma(TWO_BLOCKS_A_STEP),
    ],
    ids=[
        "plain",
        "swapped",
        "narrow",
        "two-column-tiles",
        "three-narrow-tiles",
        "two-blocks",
        "two-blocks-one-deep",
        "tma",
        "swapped-tma",
        "three-narrow-tiles-tma",
        "two-blocks-tma",
    ],
)
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_gemm2_fp8_matches_its_spec(layout, config):
    depth = I if config is TWO_BLOCKS_ONE_DEEP else 2 * I  # else two 128-deep blocks
    x_q, x_s, q13, s13, q2, s2, offsets, pairs, weights, top_k, rows = gemm_problem(
        True, layout, seed=1, intermediate=depth
    )
    a_q, a_s = expert_gemm_fp8.expert_up_fp8_spec(
        x_q, x_s, q13, s13, offsets, pairs, top_k=top_k, gated=True
    )
    a_q = nan_codes_past(a_q, int(offsets[-1]))
    num_out = rows * top_k if pairs is not None else a_q.size(0)
    want = expert_gemm_fp8.expert_down_fp8_spec(
        a_q, a_s, q2, s2, offsets, pairs, weights, num_out=num_out, dtype=torch.bfloat16
    )
    out = torch.full((num_out, H), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    args = on_device(a_q, a_s, q2, s2, offsets, pairs, weights)
    expert_gemm_fp8.expert_down_fp8(*args, out, config=config)
    written = torch.zeros(num_out, dtype=torch.bool)
    if pairs is not None:
        written[pairs[: int(offsets[-1])].long()] = True
    else:
        written[:] = True  # EXPANDED: every row, padding zero
        assert not out[int(offsets[-1]) :].float().any()
    got, ref = out.cpu()[written].float(), want[written].float()
    bound = 2 * 2.0**-7 * (ref.abs() + 0.01 * ref.abs().amax(dim=1, keepdim=True))
    assert torch.isfinite(got).all() and ((got - ref).abs() <= bound).all()
    again = torch.empty_like(out)
    expert_gemm_fp8.expert_down_fp8(*args, again, config=config)
    assert torch.equal(again[written.to(DEVICE)], out[written.to(DEVICE)])


def test_tma_descriptors_where_the_accelerator_can_read():
    """``tma``: descriptors for contiguous weights and rows; none for gathered rows, rows whose
    stride is off 16 bytes, overlapping rows, no rows or weights that are not contiguous (those
    load through pointers); no config, no descriptors."""
    weights = torch.zeros(2, 256, 128, dtype=FP8_DTYPE)
    rows = torch.zeros(8, 128, dtype=FP8_DTYPE)
    a_desc, w_desc, flags = expert_gemm_fp8._tma_options(tma(PLAIN), rows, weights)
    assert flags == {"TMA_A": True, "TMA_B": True}
    assert w_desc.shape == [512, 128] and w_desc.block_shape == [128, 128]
    assert a_desc.block_shape == [16, 128]
    unreadable_rows = [
        torch.zeros(8, 136, dtype=FP8_DTYPE)[:, :128],  # rows 136 bytes apart
        torch.zeros(1, 128, dtype=FP8_DTYPE).expand(8, 128),  # every row the same bytes
        torch.zeros(0, 128, dtype=FP8_DTYPE),
        None,  # gathered
    ]
    for unreadable in unreadable_rows:
        assert expert_gemm_fp8._tma_options(tma(PLAIN), unreadable, weights)[2]["TMA_A"] is False
    sliced = torch.zeros(2, 512, 128, dtype=FP8_DTYPE)[:, :256]  # not one [L·N, K] view
    assert expert_gemm_fp8._tma_options(tma(PLAIN), rows, sliced)[1:] == (
        None, {"TMA_A": True, "TMA_B": False}
    )  # fmt: skip
    assert expert_gemm_fp8._tma_options(PLAIN, rows, weights) == (
        None, None, {"TMA_A": False, "TMA_B": False}
    )  # fmt: skip


# --------------------------------------------------------------------------- the layer
def fp8_triton_layer(activation: str, dtype: torch.dtype, experts: str = "triton", **options):
    config = MoEConfig(E, K, H, I, activation=activation, dtype=dtype, quantization="fp8_block")
    return EPMoE(config, max_tokens_per_rank=16, experts=experts, device=DEVICE, **options)


def run_layer(layer: EPMoE, weights, x, ids, topk_weights) -> torch.Tensor:
    q13, s13, q2, s2 = weights
    try:
        layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        return layer(x.to(DEVICE), ids.to(DEVICE), topk_weights.to(DEVICE)).cpu()
    finally:
        layer.close()


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_layer_matches_the_oracle_and_the_twin(layout, mode, activation):
    dtype = torch.bfloat16
    x, ids, topk_weights, weights = fp8_inputs(activation, dtype, tokens=16)
    options = dict(layout=layout, mode=mode)
    layer = fp8_triton_layer(activation, dtype, **options)
    assert layer.choice.experts == "triton"
    out = run_layer(layer, weights, x, ids, topk_weights)
    assert out.dtype == dtype
    comparison = judge(out, x, ids, topk_weights, weights, activation)
    assert comparison.passed, comparison.describe()
    assert not out[ids.size(0) // 2].any()  # served by nobody: an exact zero row
    twin = run_layer(
        fp8_triton_layer(activation, dtype, experts="reference", **options),
        weights,
        x,
        ids,
        topk_weights,
    )
    served = (ids >= 0).any(dim=1)
    distance = (out.float() - twin.float()).norm(dim=1)[served] / twin.float().norm(dim=1)[served]
    assert distance.max() < 0.03, distance.max()  # a few neighbouring e4m3 codes, no more
    again = run_layer(fp8_triton_layer(activation, dtype, **options), weights, x, ids, topk_weights)
    assert torch.equal(again, out)  # bitwise deterministic


def test_fp32_layer_matches_the_oracle():
    x, ids, topk_weights, weights = fp8_inputs("silu", torch.float32, tokens=12, seed=5)
    out = run_layer(fp8_triton_layer("silu", torch.float32), weights, x, ids, topk_weights)
    assert out.dtype == torch.float32
    comparison = judge(out, x, ids, topk_weights, weights, "silu")
    assert comparison.passed, comparison.describe()


def test_checker_fails_swapped_scales():
    """Negative control: each expert given its neighbour's scales fails the oracle."""
    x, ids, topk_weights, (q13, s13, q2, s2) = fp8_inputs("silu", torch.bfloat16, tokens=16)
    wrong = (q13, s13.roll(1, dims=0), q2, s2.roll(1, dims=0))
    out = run_layer(fp8_triton_layer("silu", torch.bfloat16), wrong, x, ids, topk_weights)
    comparison = judge(out, x, ids, topk_weights, (q13, s13, q2, s2), "silu")
    assert not comparison.passed, comparison.describe()


def test_dequantized_rows_are_the_activation_quantization():
    """The layer's GEMM1 input is q(x): dequantized, within e4m3 spacing of x (sanity of the
    quantizer on the layer's own rows)."""
    x = fp8_inputs("silu", torch.bfloat16)[0]
    q, s = quantize_on_device(x)
    error = (dequantize_activations(q, s) - x.float()).abs()
    assert (error <= x.float().abs() / 16 + s.repeat_interleave(128, 1) / 512 * 1.001).all()
