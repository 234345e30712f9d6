"""scripts/hf_bench.py on CPU at --tiny size: it runs, and its fp32 yardstick judges fairly.

The yardstick: the unpatched model run in fp32 (the same weights, upcast). In fp32 every
implementation, ours included, must agree with it to the derived tolerance; in bf16 ours must land
no farther from it than transformers' own implementations do (give or take a quarter)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_bench.py"


def run_hf_bench(tmp_path: Path, dtype: str) -> dict:
    spec = importlib.util.spec_from_file_location("hf_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / f"{dtype}.json"
    argv = ["--tiny", "--device", "cpu", "--dtype", dtype, "--fp32-reference", "--iters", "1"]
    assert module.main([*argv, "--warmup", "0", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_fp32_run_agrees_with_the_fp32_model(tmp_path: Path) -> None:
    report = run_hf_bench(tmp_path, "fp32")
    distances = report["fp32_distance"]
    assert len(distances) == 3 and any(name.startswith("ep_runtime") for name in distances)
    assert all(d < 1e-4 for d in distances.values()), distances
    assert report["logits_agreement"].startswith("ok")


def test_bf16_run_is_as_close_to_fp32_as_transformers_own(tmp_path: Path) -> None:
    distances = run_hf_bench(tmp_path, "bf16")["fp32_distance"]
    ours = next(d for name, d in distances.items() if name.startswith("ep_runtime"))
    theirs = [d for name, d in distances.items() if name.startswith("transformers")]
    assert ours <= 1.25 * max(theirs), distances
