"""The ``triton`` experts backend: its kernels (``experts/gemm/expert_gemm.py``,
``experts/gemm/expert_rows.py``) against their torch specs over odd shapes, and the layer on them
against ``reference_moe``.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set in tests/conftest.py before triton is imported); with one, compiled on CUDA. Shapes are tiny
(the interpreter costs milliseconds per program) but odd: H and I not multiples of the tiles, an
expert with no rows, rows with every slot -1, K = 1, T = 0 and 1, int64 ids, NaN in padding.
The index kernels must match their spec bitwise; the GEMMs within a rounding flip of theirs (the
fp32 sums are added in another order); two runs bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig, reference_moe
from ep_runtime.experts.base import ExpertsSetup
from ep_runtime.experts.gemm import expert_gemm, expert_rows, expert_tiles
from ep_runtime.experts.gemm.expert_tiles import TileConfig
from ep_runtime.experts.triton import TritonExperts
from ep_runtime.placement import ExpertPlacement
from ep_runtime.tolerance import compare_per_token, tolerance_for

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BF16 = torch.bfloat16
# several tiles in every dimension, partial last tiles (H = 40, I = 24), plain and swapped
SMALL = TileConfig(16, 16, 16)
SWAPPED = TileConfig(16, 16, 32, swap=True)
# several column tiles per program, the last group of a row partial (GEMM2's 3 tiles in 2s,
# GEMM1's 2 in 3s: one tile past the columns)
TWO_COLUMN_TILES = TileConfig(16, 16, 16, tiles_n=2)
THREE_COLUMN_TILES = TileConfig(16, 16, 32, swap=True, tiles_n=3)


def routing(rows: int, top_k: int, num_experts: int, seed: int, skip_expert: int | None = 2):
    """``[R, K]`` int64 ids: distinct per row, an unused slot, a row with every slot -1, and
    (``skip_expert``) one expert nobody routes to."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, num_experts, generator=g)
    if skip_expert is not None:
        scores[:, skip_expert] = -1
    ids = scores.topk(top_k, dim=1).indices
    if rows > 2:
        ids[1] = -1
        ids[rows - 1, 0] = -1
    return ids


def weights_for(num_local: int, hidden: int, intermediate: int, gated: bool, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * intermediate if gated else intermediate
    w13 = torch.randn(num_local, rows, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_local, hidden, intermediate, generator=g) / intermediate**0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def assert_close_to_spec(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within two rounding steps of the spec, relative to each row's largest value."""
    got32, want32 = got.float().cpu(), want.float().cpu()
    assert torch.isfinite(got32).all(), f"{what}: non-finite values"
    ulp = 2.0**-7 if want.dtype == BF16 else 2.0**-16
    row_scale = want32.abs().amax(dim=1, keepdim=True)
    bound = 2 * ulp * (want32.abs() + 0.01 * row_scale)
    excess = (got32 - want32).abs() - bound
    assert excess.max() <= 0, f"{what}: off by {(got32 - want32).abs().max()} (bound {bound.max()})"


# --------------------------------------------------------------------------- index kernels
@pytest.mark.parametrize("top_k, rows, dtype", [(3, 7, torch.int64), (1, 5, torch.int32)])
def test_sort_pairs_and_sum_slots_match_spec_bitwise(top_k, rows, dtype) -> None:
    num_experts, local_offset, num_local = 8, 2, 4  # serves experts 2..5 of 8
    ids = routing(rows, top_k, num_experts, seed=rows).to(dtype).to(DEVICE)
    pairs = torch.full((rows * top_k,), -7, dtype=torch.int32, device=DEVICE)
    offsets = torch.full((num_local + 1,), -7, dtype=torch.int32, device=DEVICE)
    expert_rows.sort_pairs(ids, pairs, offsets, local_offset=local_offset, num_local=num_local)
    want_pairs, want_offsets = expert_rows.sort_pairs_spec(
        ids, local_offset=local_offset, num_local=num_local
    )
    assert torch.equal(offsets.cpu(), want_offsets.cpu())
    served = int(want_offsets[-1])
    assert torch.equal(pairs[:served].cpu(), want_pairs[:served].cpu())
    y = torch.randn(rows * top_k, 40).to(BF16).to(DEVICE)
    unserved = want_pairs.new_ones(rows * top_k, dtype=torch.bool)
    unserved[want_pairs[:served].long()] = False
    y[unserved.to(DEVICE)] = float("nan")  # never read
    out = torch.full((rows, 40), float("nan"), dtype=BF16, device=DEVICE)
    expert_rows.sum_slots(y, ids, out, local_offset=local_offset, num_local=num_local)
    want = expert_rows.sum_slots_spec(y, ids, local_offset=local_offset, num_local=num_local)
    assert torch.equal(out.cpu().view(torch.int16), want.cpu().view(torch.int16))


# --------------------------------------------------------------------------- GEMMs
@pytest.mark.parametrize(
    "gated, layout, config, dtype",
    [
        (True, "standard", SMALL, BF16),
        (False, "standard", SWAPPED, BF16),
        (True, "expanded", SWAPPED, BF16),
        (False, "expanded", SMALL, torch.float32),
        (True, "standard", TWO_COLUMN_TILES, BF16),
        (True, "expanded", THREE_COLUMN_TILES, BF16),
        (False, "expanded", TWO_COLUMN_TILES, BF16),
    ],
)
def test_gemms_match_spec(gated: bool, layout: str, config: TileConfig, dtype) -> None:
    rows, top_k, num_local, hidden, intermediate = 7, 3, 5, 40, 24
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    ids = routing(rows, top_k, num_local, seed=4)
    weights = torch.rand(rows, top_k, generator=torch.Generator().manual_seed(5))
    weights = torch.where(ids >= 0, weights, float("nan"))
    w13, w2 = weights_for(num_local, hidden, intermediate, gated, dtype, seed=6)
    pairs, offsets = expert_rows.sort_pairs_spec(ids, local_offset=0, num_local=num_local)
    served = int(offsets[-1])
    if layout == "expanded":  # the dispatcher's grouped rows, then padding rows of NaN
        source = pairs[:served].long() // top_k
        x = torch.cat([x[source], torch.full((3, hidden), float("nan"), dtype=dtype)])
        weights = torch.cat([weights.reshape(-1)[pairs[:served].long()], torch.ones(3)])[:, None]
        pairs = None
    x, weights, offsets = x.to(DEVICE), weights.to(DEVICE), offsets.to(DEVICE)
    pairs = None if pairs is None else pairs.to(DEVICE)
    k_used = 1 if pairs is None else top_k
    num_grouped = x.size(0) if pairs is None else pairs.numel()
    num_out = x.size(0) if pairs is None else rows * top_k
    results = []
    for _ in range(2):
        act = torch.full((num_grouped, intermediate), float("nan"), dtype=dtype, device=DEVICE)
        out = torch.full((num_out, hidden), float("nan"), dtype=dtype, device=DEVICE)
        expert_gemm.expert_up(x, w13, offsets, pairs, act, top_k=k_used, gated=gated, config=config)
        expert_gemm.expert_down(act, w2, offsets, pairs, weights, out, config=config)
        results.append((act, out))
    act, out = results[0]
    assert torch.equal(results[1][0][:served], act[:served]), "two runs differ (GEMM1)"
    assert torch.equal(results[1][1], out) or pairs is not None, "two runs differ (GEMM2)"
    want_act = expert_gemm.expert_up_spec(x, w13, offsets, pairs, top_k=k_used, gated=gated)
    assert_close_to_spec(act[:served], want_act[:served], "expert_up")
    want_out = expert_gemm.expert_down_spec(act, w2, offsets, pairs, weights, num_out=num_out)
    if pairs is None:  # every row written: results, then zeros for the NaN padding rows
        assert_close_to_spec(out, want_out, "expert_down")
        assert torch.equal(out[served:].cpu(), torch.zeros(3, hidden, dtype=dtype))
    else:
        written = pairs[:served].long()
        assert torch.equal(results[1][1][written], out[written]), "two runs differ (GEMM2)"
        assert_close_to_spec(out[written], want_out[written], "expert_down")


# --------------------------------------------------------------------------- the layer
def run_layer(layout: str, activation: str, mode: str, x, ids, weights, *, num_experts: int = 5):
    hidden, intermediate = x.size(1), 24
    config = MoEConfig(
        num_experts,
        max(ids.size(1), 1),
        hidden,
        intermediate,
        activation=activation,
        dtype=BF16,
        max_tokens_per_rank=8,
    )
    layer = EPMoE(config, experts="triton", layout=layout, mode=mode, device=DEVICE, poison=True)
    try:
        assert layer.choice.experts == "triton"
        w13, w2 = weights_for(num_experts, hidden, intermediate, activation == "silu", BF16, 7)
        layer.load_weights(w13, w2)
        device_inputs = (x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE))
        first, second = layer(*device_inputs), layer(*device_inputs)
    finally:
        layer.close()
    assert torch.equal(first, second), "two forwards differ"
    ref, scale = reference_moe(x, ids, weights, w13.cpu(), w2.cpu(), activation, return_scale=True)
    comparison = compare_per_token(first.cpu(), ref, tolerance_for(BF16, hidden), scale)
    assert comparison.passed, comparison.describe()
    return first


def layer_inputs(tokens: int, top_k: int, seed: int, *, every_slot_unused: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 40, generator=g).to(BF16)
    ids = routing(tokens, top_k, 5, seed) if tokens else torch.zeros(0, top_k, dtype=torch.int64)
    if every_slot_unused:
        ids[:] = -1
    weights = 0.25 + torch.rand(tokens, top_k, generator=g)
    return x, ids, torch.where(ids >= 0, weights, float("nan"))


@pytest.mark.parametrize(
    "layout, activation, mode",
    [
        ("standard", "silu", "capacity"),
        ("standard", "relu2", "exact"),
        ("expanded", "silu", "exact"),
        ("expanded", "relu2", "capacity"),
    ],
)
def test_layer_matches_reference(layout: str, activation: str, mode: str) -> None:
    x, ids, weights = layer_inputs(7, 3, seed=11)  # int64 ids, a row unused, an expert unused
    out = run_layer(layout, activation, mode, x, ids, weights)
    assert torch.equal(out[1].cpu(), torch.zeros(40, dtype=BF16)), "unused row not exact zero"


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_layer_edge_cases(layout: str) -> None:
    run_layer(layout, "silu", "exact", *layer_inputs(0, 2, seed=1))  # T = 0
    run_layer(layout, "silu", "capacity", *layer_inputs(1, 1, seed=2))  # T = 1, K = 1
    out = run_layer(layout, "relu2", "capacity", *layer_inputs(3, 2, 3, every_slot_unused=True))
    assert torch.equal(out.cpu(), torch.zeros(3, 40, dtype=BF16))


# --------------------------------------------------------------------------- selection
def test_auto_never_picks_the_interpreter_and_cpu_needs_it(monkeypatch) -> None:
    config = MoEConfig(4, 2, 40, 24, dtype=BF16)
    setup = ExpertsSetup(config, ExpertPlacement(4, 0, 1), torch.device("cpu"), BF16, token_cap=64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonExperts.refusal(setup, None) is None
    assert "interpreter" in TritonExperts.auto_refusal(setup)
    layer = EPMoE(config, device="cpu")
    try:
        assert layer.choice.experts != "triton"
        assert "interpreter" in layer.choice.refused["experts:triton"]
    finally:
        layer.close()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in TritonExperts.refusal(setup, None)


def test_rows_buckets_by_hand() -> None:
    from fractions import Fraction

    from ep_runtime.experts.gemm.expert_tiles import rows_bucket

    # (rows, local experts) -> the power of two at or above rows / experts
    cases = {
        (0, 8): Fraction(1, 8),  # no rows count as one
        (8, 8): 1,
        (9, 8): 2,
        (1024, 32): 32,
        (1025, 32): 64,
        (8, 128): Fraction(1, 16),  # Qwen3 T 1: 8 of 128 experts
        (64, 128): Fraction(1, 2),  # Qwen3 T 8
        (12, 128): Fraction(1, 8),
        (8, 32): Fraction(1, 4),  # DSV3 shard T 1
        (1, 128): Fraction(1, 128),
    }
    for (rows, experts), want in cases.items():
        assert rows_bucket(rows, experts) == want, (rows, experts)


def test_nearest_bucket_serves_shapes_without_their_own(monkeypatch) -> None:
    from fractions import Fraction

    few, many = TileConfig(16, 32, 256), TileConfig(64, 128, 64)
    table = {"up_L128_N768_K2048_gated": {Fraction(1, 16): few, Fraction(4): many}}
    monkeypatch.setattr(expert_tiles, "_table", lambda device_name: table)

    def pick(rows: int) -> TileConfig:
        return expert_tiles.select("GPU", "up", 128, 768, 2048, True, rows)

    # distances in powers of two from the rows' bucket to 1/16 and to 4
    assert pick(8) == few  # 1/16: its own entry
    assert pick(32) == few  # 1/4: 2 steps against 4
    assert pick(128) == many  # 1: 4 steps against 2
    assert pick(4096) == many  # 32: its nearest
    assert expert_tiles.select("GPU", "down", 128, 2048, 768, False, 8) == (
        expert_tiles.heuristic("down", Fraction(1, 16), 2048, 768, interpret=False)
    )


def test_shipped_tile_table_is_valid() -> None:
    import json

    from ep_runtime.experts.gemm.expert_tiles import parse_table, table_path

    document = json.loads(table_path().read_text())
    devices = parse_table(document)
    assert devices, "no tuned device in the shipped table"
    powers = {16, 32, 64, 128, 256}
    for shapes in devices.values():
        for key, buckets in shapes.items():
            assert key.startswith(("up_L", "down_L", "fp8_up_L", "fp8_down_L")), key
            for bucket, config in buckets.items():
                top, bottom = bucket.numerator, bucket.denominator
                assert 1 in (top, bottom) and top & (top - 1) == bottom & (bottom - 1) == 0, (
                    key,
                    bucket,
                )
                assert {config.block_m, config.block_n, config.block_k} <= powers, (key, config)
                if key.startswith("fp8_"):  # whole scale blocks per k-step; GEMM1 per tile
                    assert config.block_k in (128, 256), (key, config)
                    assert config.block_n == 128 or key.startswith("fp8_down"), (key, config)
    tuned_device = next(iter(devices))
    for fp8 in (False, True):
        key = next(k for k in devices[tuned_device] if k.startswith("fp8_") == fp8)
        gemm, num_local, n, k = key.removeprefix("fp8_").split("_")[:4]
        args = (tuned_device, gemm, int(num_local[1:]), int(n[1:]), int(k[1:]))
        picked = expert_tiles.select(*args, key.endswith("gated"), 8, fp8=fp8)
        assert picked in devices[tuned_device][key].values()
    unknown = expert_tiles.select("no such GPU", "up", 3, 24, 40, True, 8)
    assert unknown == expert_tiles.heuristic("up", 4, 24, 40, interpret=False)
    unknown_fp8 = expert_tiles.select("no such GPU", "down", 3, 256, 128, False, 8, fp8=True)
    assert unknown_fp8 == expert_tiles.heuristic_fp8("down", 4, interpret=False)


def test_auto_picks_it_only_where_measured_faster(monkeypatch) -> None:
    """SM90 (the H200 the benchmark ran on): caps up to 512 tokens per rank, any cap at hidden
    sizes up to 2048 (where it was as fast at prefill)."""
    import ep_runtime.experts.triton as module

    def setup(cap: int, hidden: int = 4096) -> ExpertsSetup:
        config = MoEConfig(4, 2, hidden, 24, dtype=BF16)
        placement = ExpertPlacement(4, 0, 1)
        return ExpertsSetup(config, placement, torch.device("cuda"), BF16, token_cap=cap)

    monkeypatch.setattr(module, "cuda_arch", lambda device: 90)
    assert TritonExperts.auto_refusal(setup(512)) is None
    assert "not at a cap of 4096 with hidden 4096" in TritonExperts.auto_refusal(setup(4096))
    assert TritonExperts.auto_refusal(setup(4096, hidden=2048)) is None
    assert TritonExperts.auto_refusal(setup(65536, hidden=40)) is None
    monkeypatch.setattr(module, "cuda_arch", lambda device: 100)
    assert "not on SM100" in TritonExperts.auto_refusal(setup(128))
