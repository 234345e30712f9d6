"""A passing run prints no warning the user cannot act on (issue 24 item 5): a whole launcher run
on a private Ray cluster (whose token authentication is on: Ray's notice saying so is dropped,
its warning that it is off is not), and the HF validation of logits that arrive read-only (as
arrays out of Ray's object store do)."""

from __future__ import annotations

import re
import subprocess
import warnings

import pytest

from ep_runtime.bench.report import CONVENTIONS
from tests.hf_oracle import hf_greedy, model_eos, needs_transformers
from tests.processes import ENV, LAUNCH, REPO


def test_a_passing_ray_run_prints_no_warning_and_unwrapped_prose():
    pytest.importorskip("ray", reason="ray is not installed")
    env = {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}  # Ray's default: token auth on
    done = subprocess.run(
        [*LAUNCH, "--dp", "2", "--iters", "2", "--warmup", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not re.search(r"warn", output, re.IGNORECASE), output
    lines = output.splitlines()
    for convention in CONVENTIONS:  # piped: each legend line whole, not wrapped mid-phrase
        assert convention in lines, convention


@needs_transformers
def test_hf_validation_of_read_only_logits_warns_nothing():
    from ep_runtime.integrations.transformers import build_random_model, random_config
    from ep_runtime.launch import hf_report, hf_run
    from ep_runtime.launch.cli import build_parser

    args = build_parser().parse_args(["--hf-model", "qwen3-moe", "--hf-new-tokens", "3"])
    spec = hf_run.build_spec(args, 1)
    reference = build_random_model(random_config("qwen3-moe"), seed=spec.workload.seed)
    prompt = spec.workload.prompt(0, reference.config.vocab_size)
    tokens, logits = hf_greedy(reference, prompt, 3, model_eos(reference))
    read_only = logits.numpy()
    read_only.setflags(write=False)
    summary = {"rank": 0, "prompt": prompt, "max_new_tokens": 3, "tokens": tokens,
               "logits": read_only}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (verdict,) = hf_report.validate(spec, [summary])
    assert verdict["passed"] and verdict["max_rel_err"] == 0.0, verdict
