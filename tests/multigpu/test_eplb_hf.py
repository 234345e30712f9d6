"""Expert load balancing in a patched transformers model on real ranks (gloo, fp32): with
redundant experts, every EP layer rebalanced from its measured load in the middle of greedy
generation; the tokens must equal the unpatched model's (transformers' own greedy ``generate``)
and the logits stay within the tolerance, and the rebalance must actually have moved experts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_runtime.comm import default_device
from ep_runtime.integrations.transformers import (
    build_random_model,
    greedy_generate,
    patch_moe_blocks,
    random_config,
)
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support.hf_oracle import hf_greedy, model_eos, moe_shape, needs_transformers

pytestmark = needs_transformers

SEED = 3
REDUNDANT = 2  # 12 experts + 2 = 14 slots, 7 per rank at W = 2
REBALANCE_AFTER_STEP = 2  # prefill, one decode step, then every layer rebalances
REQUESTS = [(5, 6), (9, 7)]  # (prompt length, new tokens) per rank


def prompt(length: int, rank: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(200 + rank)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def generate_with_rebalance(
    arch: str, prompts: list[list[int]], new_tokens: list[int], eos: list[int], experts: str
) -> dict:
    """Patch with ``REDUNDANT`` slots, generate, rebalance every EP layer after step
    ``REBALANCE_AFTER_STEP`` (the same lockstep step on every rank), go on generating."""
    rank = dist.get_rank()
    device = default_device(dist.group.WORLD)
    model = build_random_model(random_config(arch), seed=SEED, device=str(device))
    report = patch_moe_blocks(
        model, dispatcher="torch_a2a", experts=experts, num_redundant_experts=REDUNDANT
    )
    layers = [block.module.ep for block in report.blocks]
    before = [layer.placement for layer in layers]
    rebalances = []

    def on_step(step: int) -> None:
        if step == REBALANCE_AFTER_STEP:
            rebalances.extend(layer.rebalance() for layer in layers)

    try:
        result = greedy_generate(
            model, report, prompts[rank], new_tokens[rank], eos_token_id=eos, on_step=on_step
        )
        dist.barrier()
    finally:
        for layer in layers:
            layer.close()
    return {
        "tokens": result.tokens,
        "logits": result.logits,
        "local_experts": report.local_experts,
        "changed_slots": [r.changed_slots for r in rebalances],
        "remote_slots": [r.remote_slots for r in rebalances],
        "placement_changed": [
            layer.placement != old for layer, old in zip(layers, before, strict=True)
        ],
        "fingerprints": [layer.placement.fingerprint() for layer in layers],
    }


@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
def test_rebalance_mid_generation_keeps_the_unpatched_models_tokens(pool_factory, arch: str):
    config = random_config(arch)
    reference = build_random_model(config, seed=SEED)  # never patched
    eos = model_eos(reference)
    prompts = [prompt(length, rank, config.vocab_size) for rank, (length, _) in enumerate(REQUESTS)]
    new_tokens = [n for _, n in REQUESTS]
    pool = pool_factory(2)
    experts = "auto" if pool.backend == "nccl" else "grouped_mm"
    results = pool.run_ok(generate_with_rebalance, arch, prompts, new_tokens, eos, experts)
    num_experts, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    for rank, result in enumerate(results):
        tokens, logits = hf_greedy(reference, prompts[rank], new_tokens[rank], eos)
        assert len(tokens) > REBALANCE_AFTER_STEP, "the rebalance must fall inside generation"
        assert result["tokens"] == tokens, f"rank {rank}: {result['tokens']} != {tokens}"
        comparison = compare_per_token(result["logits"], logits, tolerance)
        assert comparison.passed, f"rank {rank}: {comparison.describe()}"
        # with redundancy the slots are not one contiguous run: one logical expert per slot
        slots = (num_experts + REDUNDANT) // 2
        assert len(result["local_experts"]) == slots
    first, second = results
    assert first["fingerprints"] == second["fingerprints"], "ranks ended on different maps"
    assert first["changed_slots"] == second["changed_slots"]  # one report, every rank
    assert any(first["placement_changed"]) and sum(first["changed_slots"]) > 0
    assert sum(first["remote_slots"]) > 0, "no expert moved between ranks: a vacuous check"
