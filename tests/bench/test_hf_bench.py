"""``python -m ep_runtime.bench.hf`` on CPU at --tiny size: it runs, and its fp32 yardstick judges
fairly.

The yardstick: the unpatched model run once in fp32 (the same weights, upcast, transformers'
eager experts). In fp32 every implementation, ours included, must agree with it to 1e-4; in bf16
ours must land no farther from it than transformers' own implementations do (give or take a
quarter)."""

from __future__ import annotations

import json
from pathlib import Path

from ep_runtime.bench import hf as hf_bench
from tests.support.hf_oracle import needs_transformers

pytestmark = needs_transformers


def fp32_distances(tmp_path: Path, dtype: str) -> dict[str, float]:
    out = tmp_path / f"{dtype}.json"
    argv = ["--tiny", "--device", "cpu", "--dtype", dtype, "--fp32-reference", "--iters", "1"]
    argv += ["--warmup", "0", "--prefill-batch", "8", "--json", str(out)]
    assert hf_bench.main(argv) == 0
    return json.loads(out.read_text())["fp32_distance"]


def test_fp32_run_agrees_with_the_fp32_model(tmp_path: Path) -> None:
    distances = fp32_distances(tmp_path, "fp32")
    ours = [name for name in distances if name.startswith("ep_runtime")]
    assert len(distances) == 4 and len(ours) == 2, distances  # two transformers, two ours
    assert ours[0].startswith("ep_runtime defaults (")
    assert ours[1].startswith("ep_runtime tuned: max_tokens_per_rank=256 (")  # 8 x 32 tokens
    assert all(d < 1e-4 for d in distances.values()), distances


def test_bf16_run_is_as_close_to_fp32_as_transformers_own(tmp_path: Path) -> None:
    distances = fp32_distances(tmp_path, "bf16")
    ours = [d for name, d in distances.items() if name.startswith("ep_runtime")]
    theirs = [d for name, d in distances.items() if name.startswith("transformers")]
    assert len(ours) == 2 and all(d <= 1.25 * max(theirs) for d in ours), distances
