"""transformers MoE models with their MoE blocks expert-parallel on real ranks (gloo, fp32):
each rank generates its own request in lockstep; tokens and logits must equal the unpatched
model's (transformers' own greedy ``generate`` in this process), and each rank must hold only
its expert shard."""

from __future__ import annotations

import pytest
import torch

from ep_runtime.integrations.transformers import build_random_model, random_config
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.hf_cases import generate_on_rank
from tests.support.hf_oracle import (
    hf_greedy,
    model_eos,
    moe_shape,
    needs_transformers,
    routed_expert_numel,
)

pytestmark = needs_transformers

ARCHITECTURES = ("qwen3-moe", "mixtral", "deepseek-v3", "deepseek-v2")
SEED = 3


def prompt(length: int, rank: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


# per world size: (prompt length or None = no request, max new tokens) for each rank
REQUESTS = {
    2: [(3, 4), (9, 9)],  # different prompt lengths; rank 0 finishes first
    3: [(None, 0), (10, 6), (2, 3)],  # a rank with no request; ranks 1, 2 finish apart
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ranks_generate_the_unpatched_models_tokens(pool_factory, arch: str, world_size: int):
    config = random_config(arch)
    reference = build_random_model(config, seed=SEED)  # never patched
    eos = model_eos(reference)
    requests = REQUESTS[world_size]
    prompts = [
        None if length is None else prompt(length, rank, config.vocab_size)
        for rank, (length, _) in enumerate(requests)
    ]
    new_tokens = [n for _, n in requests]
    pool = pool_factory(world_size)
    # both CPU experts backends; on NCCL ranks (fp32 on GPUs) whatever "auto" picks
    experts = (
        "auto" if pool.backend == "nccl" else "reference" if arch == "mixtral" else "grouped_mm"
    )
    results = pool.run_ok(generate_on_rank, arch, prompts, new_tokens, eos, SEED, experts)
    num_experts, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    generated = []
    for rank, (result, rank_prompt) in enumerate(zip(results, prompts, strict=True)):
        if rank_prompt is None:
            assert result["tokens"] == [] and result["idle_steps"] == result["steps"]
            continue
        tokens, logits = hf_greedy(reference, rank_prompt, new_tokens[rank], eos)
        assert result["tokens"] == tokens, f"rank {rank}: {result['tokens']} != {tokens}"
        comparison = compare_per_token(result["logits"], logits, tolerance)
        assert comparison.passed, f"rank {rank}: {comparison.describe()}"
        assert result["idle_steps"] == result["steps"] - len(tokens)
        generated.append(len(tokens))
    assert len(set(generated)) > 1, f"ranks should finish at different steps: {generated}"
    assert {r["steps"] for r in results} == {max(generated)}  # lockstep, no extra steps

    # memory: no HF expert tensor survives; each rank holds exactly its 1/W of the experts
    routed = routed_expert_numel(reference)
    total = sum(p.numel() for p in reference.parameters())
    shard = num_experts // world_size
    assert [r["local_experts"] for r in results] == [
        (rank * shard, (rank + 1) * shard) for rank in range(world_size)
    ]
    for rank, result in enumerate(results):
        assert result["hf_expert_tensors_alive"] == 0, f"rank {rank} kept HF expert tensors"
        assert result["params_after"] == total - routed, f"rank {rank}"
        assert result["held_expert_bytes"] * world_size == routed * 4, f"rank {rank}"
