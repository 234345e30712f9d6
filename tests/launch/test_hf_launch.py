"""``python -m ep_runtime.launch --hf-model``: a whole spawn run checked against transformers'
own generate here, the validation failing a wrong rank, and bad arguments refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ep_runtime.integrations.transformers import build_random_model, random_config
from ep_runtime.launch import hf_report, hf_run
from ep_runtime.launch.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from tests.support.hf_oracle import hf_greedy, model_eos, needs_transformers, routed_expert_numel

pytestmark = needs_transformers


def test_spawn_run_generates_the_unpatched_models_tokens(tmp_path: Path, capsys) -> None:
    path = tmp_path / "report.json"
    argv = ["--launcher", "spawn", "--dp", "2", "--device", "cpu", "--hf-model", "qwen3-moe"]
    code = main([*argv, "--json", str(path)])  # CPU: fp32, as the reference built here
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "PASSED" in out and "tok/s" in out and "MoE s" in out
    report = json.loads(path.read_text())
    assert report["passed"] and report["world_size"] == 2 and report["kind"] == "hf"
    reference = build_random_model(random_config("qwen3-moe"), seed=0)  # the launcher's seed
    eos = model_eos(reference)
    ranks = report["per_rank"]
    assert [len(r["prompt"]) for r in ranks] == [8, 11]  # defaults: 8 + 3r prompt tokens
    for rank in ranks:
        tokens, _ = hf_greedy(reference, rank["prompt"], rank["max_new_tokens"], eos)
        assert rank["tokens"] == tokens
        assert rank["steps"] == max(len(r["tokens"]) for r in ranks)
        assert rank["idle_steps"] == rank["steps"] - len(tokens)
        assert rank["expert_params_kept"] * 2 == routed_expert_numel(reference)
        assert rank["held_expert_bytes"] * 2 == routed_expert_numel(reference) * 4
        assert 0 < rank["moe_s"] < rank["total_s"] and rank["tokens_per_s"] > 0


def _summary(spec, rank: int, tokens: list[int], logits: torch.Tensor) -> dict:
    return {
        "rank": rank,
        "prompt": spec.workload.prompt(rank, 256),
        "max_new_tokens": spec.workload.new_tokens[rank],
        "tokens": tokens,
        "logits": logits.numpy(),
    }


def test_validation_fails_a_wrong_token_and_passes_the_right_ones() -> None:
    args = build_parser().parse_args(["--hf-model", "mixtral", "--hf-new-tokens", "3"])
    spec = hf_run.build_spec(args, 2)
    reference = build_random_model(random_config("mixtral"), seed=spec.workload.seed)
    summaries = []
    for rank in range(2):
        prompt = spec.workload.prompt(rank, 256)
        tokens, logits = hf_greedy(
            reference, prompt, spec.workload.new_tokens[rank], model_eos(reference)
        )
        summaries.append(_summary(spec, rank, tokens, logits))
    assert [v["passed"] for v in hf_report.validate(spec, summaries)] == [True, True]
    wrong = dict(
        summaries[1], tokens=[*summaries[1]["tokens"][:-1], 255 - summaries[1]["tokens"][-1]]
    )
    verdicts = hf_report.validate(spec, [summaries[0], wrong])
    assert [v["passed"] for v in verdicts] == [True, False]
    assert verdicts[1]["first_mismatch"] == len(wrong["tokens"]) - 1
    scaled = dict(summaries[0], logits=summaries[0]["logits"] * np.float32(1.001))
    assert not hf_report.validate(spec, [scaled, summaries[1]])[0]["passed"]  # 1e-3 > tolerance


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf-model", "gpt-9"], "--hf-model: expected one of qwen3-moe, mixtral"),
        (["--hf-model", "qwen3-moe", "--dp", "5"], "has 12 experts, not divisible by 5"),
        (["--hf-model", "mixtral", "--hf-idle-rank", "2"], "--hf-idle-rank: expected a rank"),
        (["--hf-model", "mixtral", "--layout", "both"], "--layout: expected auto, standard"),
        (["--hf-model", "mixtral", "--hf-new-tokens", "0"], "--hf-new-tokens: expected >= 1"),
    ],
)
def test_bad_hf_arguments_exit_2_before_launching(argv, message, capsys) -> None:
    assert main(["--launcher", "spawn", "--dp", "2", *argv]) == EXIT_USAGE
    assert message in capsys.readouterr().out.replace("\n", " ")
