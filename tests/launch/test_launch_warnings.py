"""A passing run prints no warning the user cannot act on (issue 24 item 5): the HF validation of
logits that arrive read-only (as arrays out of Ray's object store do). A whole passing launcher
run on a private Ray cluster (token authentication on: Ray's notice saying so is dropped, its
warning that it is off is not) is checked for warnings by tests/launch/test_launch_ray.py."""

from __future__ import annotations

import warnings

from tests.support.hf_oracle import hf_greedy, model_eos, needs_transformers


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
