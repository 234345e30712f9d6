"""Rank-side code of the FP8 transformers tests (runs inside ``RankPool`` ranks): the patched
``deepseek-v3-fp8`` model generates this rank's request; every EP block's inputs and outputs are
recorded for the per-layer oracle in the test process."""

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


def generate_fp8_on_rank(
    prompts: list[list[int] | None], new_tokens: list[int], eos: list[int], seed: int
) -> dict:
    rank = dist.get_rank()
    device = default_device(dist.group.WORLD)  # CPU on gloo, this rank's GPU on NCCL
    model = build_random_model(random_config("deepseek-v3-fp8"), seed=seed, device=str(device))
    hf_tensors = [
        weakref.ref(getattr(block.experts, name))
        for _, block in find_moe_blocks(model)
        for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    ]
    report = patch_moe_blocks(model, dispatcher="torch_a2a")
    gc.collect()
    calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {b.name: [] for b in report.blocks}
    handles = []
    for block in report.blocks:

        def record(module, args, output, name=block.name):
            x = args[0].reshape(-1, args[0].size(-1))
            if x.size(0):  # zero-token steps serve the peers only
                calls[name].append((x.detach().cpu().clone(), output.reshape(x.shape).cpu()))

        handles.append(block.module.register_forward_hook(record))
    result = greedy_generate(model, report, prompts[rank], new_tokens[rank], eos_token_id=eos)
    for handle in handles:
        handle.remove()
    fp8 = [block.module.ep.experts.fp8 for block in report.blocks]
    summary = {
        "tokens": result.tokens,
        "logits": result.logits,
        "steps": result.steps,
        "idle_steps": result.idle_steps,
        "calls": calls,
        "quantization": [block.module.ep.config.quantization.value for block in report.blocks],
        "held_dtypes": sorted({str(w.w13.dtype) for w in fp8} | {str(w.w2.dtype) for w in fp8}),
        "held_expert_bytes": report.held_expert_bytes(),
        "hf_expert_tensors_alive": sum(ref() is not None for ref in hf_tensors),
        "local_experts": (report.local_experts.start, report.local_experts.stop),
    }
    for block in report.blocks:
        block.module.ep.close()
    return summary
