"""Rank-side code of the transformers-integration tests (runs inside ``RankPool`` ranks)."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from ep_runtime.comm import default_device
from ep_runtime.integrations.transformers import (
    build_random_model,
    find_moe_blocks,
    greedy_generate,
    patch_moe_blocks,
    random_config,
)


def generate_on_rank(
    arch: str,
    prompts: list[list[int] | None],
    new_tokens: list[int],
    eos: list[int],
    seed: int,
    experts: str,
) -> dict:
    """Build the seeded random model (on the pool's device), patch it on the pool's group,
    generate this rank's request in lockstep; also what the rank holds afterwards."""
    rank = dist.get_rank()
    device = default_device(dist.group.WORLD)  # CPU on gloo, this rank's GPU on NCCL
    model = build_random_model(random_config(arch), seed=seed, device=str(device))
    hf_tensors = [
        weakref.ref(tensor)
        for _, block in find_moe_blocks(model)
        for tensor in (block.experts.gate_up_proj, block.experts.down_proj)
    ]
    report = patch_moe_blocks(model, dispatcher="torch_a2a", experts=experts)
    gc.collect()
    result = greedy_generate(model, report, prompts[rank], new_tokens[rank], eos_token_id=eos)
    for block in report.blocks:
        block.module.ep.close()
    return {
        "tokens": result.tokens,
        "logits": result.logits,
        "steps": result.steps,
        "idle_steps": result.idle_steps,
        "params_after": sum(p.numel() for p in model.parameters()),
        "held_expert_bytes": report.held_expert_bytes(),
        "hf_expert_tensors_alive": sum(ref() is not None for ref in hf_tensors),
        "local_experts": (report.local_experts.start, report.local_experts.stop),
        "dtype": torch.float32,
    }
