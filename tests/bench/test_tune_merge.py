"""The tuning command's table merge: token counts that share one entry get one config
that serves them all (hand-computed winners over synthetic timings); the keys under which a
run finds the shipped entry it times beside its candidates."""

from __future__ import annotations

from fractions import Fraction

from ep_runtime.bench.tune_experts import SHAPES, gemm_key, merge, shared_best
from ep_runtime.experts.gemm.expert_tiles import TileConfig, parse_table

A = {"block_m": 16, "block_n": 64}
B = {"block_m": 16, "block_n": 128}
C = {"block_m": 32, "block_n": 64}


def timed(tried: list[tuple[dict, float]], key: str = "up:k") -> dict:
    best, best_ms = min(tried, key=lambda t: t[1])
    return {"key": key, "best": best, "best_ms": best_ms, "tried": [[c, ms] for c, ms in tried]}


def test_one_point_takes_its_fastest() -> None:
    assert shared_best([timed([(A, 2.0), (B, 1.0), (C, 3.0)])]) == B


def test_shared_entry_takes_the_lowest_sum_of_ratios() -> None:
    # T 1: A 1.0 (best), B 2.0; T 8: A 1.5, B 1.0 (best).
    # Ratios: A 1.0 + 1.5 = 2.5, B 2.0 + 1.0 = 3.0, so A, though T 8 alone picks B.
    t1 = timed([(A, 1.0), (B, 2.0)])
    t8 = timed([(A, 1.5), (B, 1.0)])
    assert shared_best([t1, t8]) == A
    assert shared_best([t8, t1]) == A


def test_config_missing_from_a_point_is_not_chosen() -> None:
    # C is the fastest at T 1 but failed (was not timed) at T 8.
    # Ratios: A 1.0/0.5 + 1.0/1.0 = 3.0, B 2.0/0.5 + 1.2/1.0 = 5.2: A, never C.
    t1 = timed([(C, 0.5), (A, 1.0), (B, 2.0)])
    t8 = timed([(A, 1.0), (B, 1.2)])
    assert shared_best([t1, t8]) == A


def test_merge_groups_points_by_key_and_bucket() -> None:
    def point(bucket: int, up: dict, down: dict) -> dict:
        return {"bucket": bucket, "up": up, "down": down}

    results = [
        point(1, timed([(A, 1.0), (B, 2.0)]), timed([(A, 1.0), (B, 1.1)], "down:k")),
        point(1, timed([(A, 1.5), (B, 1.0)]), timed([(A, 1.0), (B, 0.5)], "down:k")),
        point(16, timed([(C, 1.0), (A, 9.0)]), timed([(A, 3.0), (C, 1.0)], "down:k")),
    ]
    document = {"devices": {"GPU": {"up:k": {"64": B}}}}
    merged = merge(document, "GPU", results)["devices"]["GPU"]
    # bucket 1 up: A 2.5 vs B 3.0; down: A 1.0+2.0=3.0 vs B 1.1+1.0=2.1.
    assert merged["up:k"] == {"64": B, "1": A, "16": C}
    assert merged["down:k"] == {"1": B, "16": C}


def test_shipped_entry_is_the_exact_key_and_bucket_of_this_gpu() -> None:
    """What ``tune_point`` looks up: this GPU's parsed table, at the GEMM's key and bucket."""
    shape = SHAPES["deepseek-v3-ep8-shard"]
    up = TileConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=3)
    down = TileConfig(64, 128, 128, group_m=32, num_warps=4, num_stages=4, tma=True)
    document = {
        "devices": {
            "GPU": {
                "fp8_up_L32_N2048_K7168_gated": {"1024": up.to_json()},
                "fp8_down_L32_N7168_K2048": {"1024": down.to_json()},
                "up_L32_N2048_K7168_gated": {"1024": down.to_json()},
            }
        }
    }
    bucket = Fraction(1024)

    def shipped(gpu: str, gemm: str, at: Fraction, fp8: bool, table: dict = document):
        return parse_table(table).get(gpu, {}).get(gemm_key(gemm, shape, fp8), {}).get(at)

    assert shipped("GPU", "up", bucket, fp8=True) == up
    assert shipped("GPU", "down", bucket, fp8=True) == down
    assert shipped("GPU", "up", bucket, fp8=False) == down  # bf16 key
    # another bucket, another GPU, no table: nothing (the nearest bucket is not the shipped one)
    assert shipped("GPU", "up", Fraction(256), fp8=True) is None
    assert shipped("Other GPU", "up", bucket, fp8=True) is None
    assert shipped("GPU", "up", bucket, fp8=True, table={}) is None
