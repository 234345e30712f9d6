"""Tile configs of the expert GEMMs (``expert_gemm.py``): the tuned table shipped as JSON
in the package (``python -m ep_runtime.bench.tune_experts`` writes it), and a heuristic for shapes
the table lacks.

A table entry is keyed by the GEMM (``up``: ``[rows, H] · w13ᵀ`` → ``[rows, I]``, gated or not;
``down``: ``[rows, I] · w2ᵀ`` → ``[rows, H]``), the local expert count ``L``, the output width
``N``, the reduction depth ``K``, and the bucket of rows per expert (the power of two at or above
``rows / L``; below one row per expert a fraction such as ``1/16``, since Qwen3's T = 1 touches 8
of 128 experts and T = 8 about 50 and they want different tiles). A shape whose exact key is
missing takes the nearest bucket of the same ``(gemm, L, N, K)``, else the heuristic. Nothing
here imports Triton.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from fractions import Fraction
from importlib import resources
from pathlib import Path

TABLE_PACKAGE = "ep_runtime.experts.gemm"
TABLE_FILE = "expert_tiles.json"


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. ``swap``: compute the transposed tile ``wᵀ·xᵀ`` so the weight
    rows fill the matrix unit's M side (few rows per expert: decode). ``tiles_n``: column tiles
    one program computes, one after the other in one loop (few rows per expert: a program's
    set-up and pipeline fill are paid once for more weight bytes). ``tma`` (the fp8 GEMMs
    only): the weights, and rows that lie contiguous (GEMM2's; GEMM1's in EXPANDED), load
    through the Tensor Memory Accelerator instead of per-thread pointers. The tuner times
    GEMM1 in STANDARD (rows gathered, weights alone through TMA); in EXPANDED the same entry
    also loads its rows through TMA, which is tested but was not timed."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    tiles_n: int = 1
    tma: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(entry: dict) -> TileConfig:
        return TileConfig(**entry)


@dataclass(frozen=True)
class GemmTiles:
    """The configs of one forward's two GEMMs: ``up`` (GEMM1, ``w13``) and ``down`` (GEMM2,
    ``w2``)."""

    up: TileConfig
    down: TileConfig


def rows_bucket(rows: int, num_local: int) -> Fraction:
    """The power of two at or above the mean rows per expert ``rows / num_local`` (a fraction
    ``1/2^j`` when there are fewer rows than experts; no rows count as one)."""
    rows, num_local = max(1, rows), max(1, num_local)
    if rows >= num_local:
        return Fraction(1 << (-(-rows // num_local) - 1).bit_length())
    return Fraction(1, 1 << (num_local // rows).bit_length() - 1)


def bucket_exponent(bucket: Fraction) -> int:
    """``log2`` of a power-of-two bucket."""
    return bucket.numerator.bit_length() - bucket.denominator.bit_length()


def _pow2(n: int) -> int:
    """The power of two at or above ``n`` (at least 16, the smallest ``tl.dot`` side)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def shape_key(gemm: str, num_local: int, n: int, k: int, gated: bool, fp8: bool = False) -> str:
    """The table key; the fp8 block-scale GEMMs (``expert_gemm_fp8.py``) have their own
    entries (prefix ``fp8_``): other operand widths, BLOCK_K a multiple of 128."""
    suffix = "_gated" if gated and gemm == "up" else ""
    prefix = "fp8_" if fp8 else ""
    return f"{prefix}{gemm}_L{num_local}_N{n}_K{k}{suffix}"


@functools.cache
def _table(device_name: str) -> dict[str, dict[Fraction, TileConfig]]:
    """The shipped entries for ``device_name`` (empty when none were tuned on it)."""
    try:
        text = resources.files(TABLE_PACKAGE).joinpath(TABLE_FILE).read_text()
    except FileNotFoundError:
        return {}
    return parse_table(json.loads(text)).get(device_name, {})


def parse_table(document: dict) -> dict[str, dict[str, dict[Fraction, TileConfig]]]:
    """``{device: {shape key: {bucket: config}}}`` from the JSON document (buckets written as
    ``"4"`` or ``"1/16"``)."""
    return {
        device: {
            key: {Fraction(bucket): TileConfig.from_json(c) for bucket, c in buckets.items()}
            for key, buckets in shapes.items()
        }
        for device, shapes in document.get("devices", {}).items()
    }


def table_path() -> Path:
    """Where the shipped table lives in a source checkout (the tuning command writes it)."""
    return Path(__file__).with_name(TABLE_FILE)


def heuristic(gemm: str, bucket: Fraction, n: int, k: int, interpret: bool) -> TileConfig:
    """A config for shapes without a tuned entry. Under the interpreter, where every program
    and every step costs milliseconds: the fewest programs and steps for small test shapes."""
    if interpret:
        return TileConfig(16, min(128, _pow2(n)), min(64, _pow2(k)), num_stages=1)
    if bucket <= 16:  # decode: stream the weights, many programs, deep pipeline
        return TileConfig(16, 64, 128, num_stages=4)
    if bucket <= 64:  # the H200 tuning's winner at 32 rows per expert, both models
        return TileConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4)
    if bucket <= 256 or gemm == "up":  # and its winners for the gated GEMM1 at prefill
        return TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)
    return TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)


def heuristic_fp8(gemm: str, bucket: Fraction, interpret: bool) -> TileConfig:
    """A config of the fp8 block-scale GEMMs (``expert_gemm_fp8.py``): BLOCK_K = 128
    (one scale per k-step; the tuner also tries 256, two steps per loop iteration) and, for
    GEMM1, BLOCK_N = 128 (its epilogue quantizes one group per tile row). Decode swaps the
    tile (weight rows on the matrix unit's M side)."""
    if interpret:
        return TileConfig(16, 128, 128, num_stages=1)
    narrow = 64 if gemm == "down" else 128  # GEMM2's output tiles may be narrower
    if bucket <= 16:
        return TileConfig(16, narrow, 128, num_warps=4, num_stages=4, swap=True)
    if bucket <= 64:
        return TileConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=4)
    return TileConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=3)


def select(
    device_name: str,
    gemm: str,
    num_local: int,
    n: int,
    k: int,
    gated: bool,
    rows: int,
    *,
    fp8: bool = False,
    interpret: bool = False,
) -> TileConfig:
    """The config for ``rows`` grouped rows: tuned entry (nearest bucket), else the heuristic
    (``fp8``: of the block-scale GEMMs)."""
    bucket = rows_bucket(rows, num_local)
    key = shape_key(gemm, num_local, n, k, gated, fp8)
    tuned = {} if interpret else _table(device_name).get(key)
    if tuned:
        exponent = bucket_exponent(bucket)
        nearest = min(tuned, key=lambda b: (abs(bucket_exponent(b) - exponent), b))
        return tuned[nearest]
    if fp8:
        return heuristic_fp8(gemm, bucket, interpret)
    return heuristic(gemm, bucket, n, k, interpret)
