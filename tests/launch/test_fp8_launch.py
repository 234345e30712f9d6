"""``python -m ep_runtime.launch --quantization fp8_block``: the rank's fp8 shard (bf16 weights
quantized per block), the launcher's reference against the tests' own fp64 oracle of the contract
(tests/support/fp8_oracle.py), its validation failing wrong fp8 layers, a whole spawn run beside
the bf16
one (weight bytes about halved, dispatch bytes unchanged), and bad shapes refused up front."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ep_runtime.bench.metrics import dispatch_row_bytes
from ep_runtime.experts import reference as reference_experts
from ep_runtime.launch import cli, layer_data
from ep_runtime.launch.cli import EXIT_OK, EXIT_USAGE, main
from ep_runtime.launch.layer_run import LayerWorkload
from ep_runtime.launch.presets import PRESETS
from ep_runtime.launch.rank import RankWorker
from ep_runtime.launch.spec import RunSpec
from ep_runtime.quantization import FP8_DTYPE
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support import fp8_oracle

CPU = torch.device("cpu")
H, I = 256, 128  # noqa: E741
MODEL = PRESETS["tiny"].with_overrides(hidden_size=H, intermediate_size=I)
CONFIG = replace(MODEL.moe_config(), quantization="fp8_block")
BF16_TOLERANCE = tolerance_for(torch.bfloat16, max(H, I))


def test_rank_shard_is_the_bf16_weights_quantized_per_block():
    experts = [3, 4, 5]
    (w13, w2), scales = layer_data.rank_shard(CONFIG, experts, 7, CPU, torch.float32)
    assert w13.dtype == w2.dtype == FP8_DTYPE
    assert w13.shape == (3, 2 * I, H) and w2.shape == (3, H, I)
    assert scales["w13_scale_inv"].shape == (3, 2 * I // 128, H // 128)
    assert scales["w2_scale_inv"].shape == (3, H // 128, I // 128)
    for slot, expert in enumerate(experts):
        bf16_13, bf16_2 = layer_data.expert_weights(CONFIG, expert, 7, CPU, torch.bfloat16)
        q13, s13 = fp8_oracle.quantize_blocks(bf16_13)  # the tests' formula, not production's
        q2, s2 = fp8_oracle.quantize_blocks(bf16_2)
        assert torch.equal(w13[slot].double(), q13) and torch.equal(w2[slot].double(), q2)
        assert torch.equal(scales["w13_scale_inv"][slot].double(), s13)
        assert torch.equal(scales["w2_scale_inv"][slot].double(), s2)
    # a rank's shard is the slice of the global weights, bit for bit
    (g13, _), global_scales = layer_data.rank_shard(CONFIG, list(range(8)), 7, CPU, torch.float32)
    assert torch.equal(g13[3:6].view(torch.uint8), w13.view(torch.uint8))
    assert torch.equal(global_scales["w2_scale_inv"][3:6], scales["w2_scale_inv"])
    assert layer_data.shard_weight_bytes(CONFIG, 2, torch.bfloat16) == 8 * (
        3 * H * I + 4 * (2 * 2 + 2 * 1)
    )


def _sample(tokens: int = 48):
    x = layer_data.rank_hidden_states(CONFIG, 0, tokens, 1, CPU, torch.bfloat16)
    ids, weights = layer_data.rank_routing(MODEL, 0, tokens, 1, CPU)
    return x, ids, weights


def test_launcher_reference_is_the_contracts_quantized_math():
    """The launcher's reference (production quantizers, fp64 accumulation) against the tests'
    fp64 oracle written from the formulas: within the bf16 tolerance, far closer than the
    unquantized reference on the same dequantized weights."""
    x, ids, weights = _sample()
    ref, _, touched = layer_data.sampled_reference(
        MODEL, x, ids, weights, 1, experts_per_chunk=3, quantization="fp8_block"
    )
    (q13, q2), scales = layer_data.rank_shard(CONFIG, list(range(16)), 1, CPU, torch.bfloat16)
    s13, s2 = scales["w13_scale_inv"], scales["w2_scale_inv"]
    oracle, scale = fp8_oracle.fp8_moe_oracle(x, ids, weights, q13, s13, q2, s2, "silu")
    agreement = compare_per_token(ref, oracle, BF16_TOLERANCE, scale)
    assert agreement.passed, agreement.describe()
    unquantized, _ = fp8_oracle.fp8_moe_oracle(
        x, ids, weights, q13, s13, q2, s2, "silu", quantize_activations=False
    )
    distance = compare_per_token(unquantized, oracle, BF16_TOLERANCE, scale)
    assert distance.max_relative_error > 10 * agreement.max_relative_error, distance.describe()
    assert touched == sorted(set(ids[ids >= 0].tolist()))


def _fp8_worker(dtype: str) -> RankWorker:
    workload = LayerWorkload(
        model=MODEL.with_overrides(tokens_per_rank=24),
        dtype=dtype,
        iters=1,
        warmup=0,
        baselines=False,
        quantization="fp8_block",
    )
    worker = RankWorker(RunSpec(world_size=1, device="cpu", workload=workload), 0)
    worker.init_process_group(store=dist.HashStore())
    return worker


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rank_validation_passes_fp8_and_fails_wrong_fp8_layers(dtype, monkeypatch):
    """Negative controls: w2 scales 10% off must fail; experts that skip the activation
    quantization land much farther from the reference than the real fp8 layer."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    threads = torch.get_num_threads()
    worker = _fp8_worker(dtype)
    try:
        worker.step("setup", ())
        worker.step("build", (0,))
        good = worker.step("validate", ())
        assert good["passed"], good["verdict"]
        assert good["tolerance"] == BF16_TOLERANCE
        layer = worker.workload.layer
        fp8 = layer.experts.fp8
        with monkeypatch.context() as patch:
            unquantized = lambda v: (v.float(), torch.ones(v.size(0), v.size(1) // 128))  # noqa: E731
            patch.setattr(reference_experts, "quantize_activations", unquantized)
            skipped = worker.step("validate", ())
        assert skipped["max_rel_err"] > 3 * good["max_rel_err"], (skipped, good)
        layer.experts.fp8 = replace(fp8, w2_scale_inv=fp8.w2_scale_inv * 1.1)
        wrong = worker.step("validate", ())
        assert not wrong["passed"] and wrong["max_rel_err"] > 0.05, wrong["verdict"]
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)


def _spawn(tmp_path: Path, name: str, *extra: str) -> tuple[int, dict]:
    path = tmp_path / f"{name}.json"
    argv = ["--launcher", "spawn", "--dp", "2", "--device", "cpu", "--dtype", "bf16"]
    argv += ["--hidden", str(H), "--intermediate", str(I), "--iters", "2", "--warmup", "1"]
    code = main([*argv, "--no-baselines", "--json", str(path), *extra])
    return code, json.loads(path.read_text())


def test_spawn_fp8_run_passes_with_about_half_the_weight_bytes(tmp_path, capsys):
    code, fp8 = _spawn(tmp_path, "fp8", "--quantization", "fp8_block")
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "PASSED" in out and "recv MB counts the fp8 rows dispatch sends" in out
    code, bf16 = _spawn(tmp_path, "bf16")
    assert code == EXIT_OK, capsys.readouterr().out
    assert fp8["passed"] and fp8["quantization"] == "fp8_block" and bf16["quantization"] is None
    assert fp8["max_rel_err"] <= fp8["tolerance"] == BF16_TOLERANCE
    for q, b in zip(fp8["per_rank"], bf16["per_rank"], strict=True):
        elements = 8 * 3 * H * I  # 8 experts per rank, w13 [2I, H] + w2 [H, I]
        assert b["expert_weight_bytes"] == 2 * elements
        assert q["expert_weight_bytes"] == elements + 8 * 6 * 4  # + 6 fp32 scales per expert
        assert 0.5 < q["expert_weight_bytes"] / b["expert_weight_bytes"] < 0.501
        # the same rows, each an fp8 row on the wire: e4m3 hidden + H/128 fp32 scales (+ the
        # ids and weights both formats carry)
        assert q["received_rows"] == b["received_rows"] > 0
        fp8_row = dispatch_row_bytes(H, torch.bfloat16, MODEL.top_k, quantized=True)
        bf16_row = dispatch_row_bytes(H, torch.bfloat16, MODEL.top_k, quantized=False)
        assert fp8_row < bf16_row
        assert q["dispatch_received_bytes"] == q["received_rows"] * fp8_row
        assert b["dispatch_received_bytes"] == b["received_rows"] * bf16_row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hidden", "200"], "--hidden: expected a multiple of 128 (quantization='fp8_block'), "
         "given 200"),
        (["--model", "mixtral-8x7b", "--intermediate", "1000"], "--intermediate: expected a "
         "multiple of 128 (quantization='fp8_block'), given 1000"),
    ],
)  # fmt: skip
def test_bad_fp8_shapes_exit_2_with_one_line_before_launching(argv, message, capsys, monkeypatch):
    def no_launch(*args):
        raise AssertionError("launched despite bad arguments")

    monkeypatch.setattr(cli, "_launch", no_launch)
    assert main(["--launcher", "spawn", "--quantization", "fp8_block", *argv]) == EXIT_USAGE
    assert capsys.readouterr().out.strip().splitlines() == [f"error: {message}"]


def test_tiny_preset_fits_fp8_blocks_without_overrides(capsys, monkeypatch):
    """H = 128, I = 256: accepted as it is (the spec is built and the launch reached)."""
    reached = []

    def stop_at_launch(launcher, spec, *args):
        reached.append(spec)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_launch", stop_at_launch)
    assert main(["--launcher", "spawn", "--quantization", "fp8_block"]) == cli.EXIT_INTERRUPTED
    assert [spec.workload.quantization for spec in reached] == ["fp8_block"]
