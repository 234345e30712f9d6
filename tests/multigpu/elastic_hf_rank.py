"""One rank of an elastic, expert-parallel tiny qwen3-moe that loses a rank while generating, run
as its own script (``python -m``). The rank named in ``--kill R@S`` SIGKILLs itself as its first
MoE block starts in lockstep step ``S`` (step 1 is the prefill): the survivors fail inside that
step, after the first layer's attention appended to the KV cache. Each survivor prints one JSON
line: its tokens and logits, the steps, the recoveries, what the patch refused, and whether each
slot holds, after the recovery, the seeded model's expert that its placement names."""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal

import torch

from ep_runtime import EPInputError
from ep_runtime.elastic import ElasticGroup
from ep_runtime.integrations.transformers import (
    RandomExpertSource,
    build_random_model,
    greedy_generate,
    patch_moe_blocks,
    random_config,
)
from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.rendezvous import LOOPBACK, join_store

ARCH = "qwen3-moe"
PROMPT_LENGTHS = (5, 7, 3)  # per original rank
NEW_TOKENS = (6, 7, 8)  # per original rank: the survivors finish at different steps


def prompt(rank: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, vocab, (PROMPT_LENGTHS[rank],), generator=generator).tolist()


def refusal(call) -> str:
    """The message of the ``EPInputError`` ``call()`` raises (or what else happened)."""
    try:
        call()
    except EPInputError as error:
        return str(error)
    return "no EPInputError"


def slots_hold_their_experts(report, reference: torch.nn.Module) -> bool:
    for block in report.blocks:
        hf = reference.get_submodule(block.name).experts
        ep = block.module.ep
        w13, w2 = ep.eplb.slot_weights
        experts = ep.placement.experts_on_rank(ep.comm.rank)
        for slot, expert in enumerate(experts):
            if not torch.equal(w13[slot], hf.gate_up_proj[expert]):
                return False
            if not torch.equal(w2[slot], hf.down_proj[expert]):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "seed"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--kill", required=True)  # R@S
    args = parser.parse_args()
    victim, kill_step = (int(part) for part in args.kill.split("@"))
    store = join_store(LOOPBACK, args.port, None, 60)
    apply_interface_defaults(LOOPBACK)
    group = ElasticGroup(store, args.rank, args.world, device="cpu", timeout_s=30)
    config = random_config(ARCH)
    model = build_random_model(config, seed=args.seed)
    reference = copy.deepcopy(model)  # never patched: the slots' oracle
    options = {"dispatcher": "torch_a2a", "experts": "grouped_mm"}
    refused = {  # before anything is built: every rank alike, no collective
        "no_source": refusal(lambda: patch_moe_blocks(model, elastic=group, **options)),
        "group_too": refusal(
            lambda: patch_moe_blocks(
                model, group.group, elastic=group, expert_source=lambda *_: None, **options
            )
        ),
    }
    source = RandomExpertSource(config, seed=args.seed)
    report = patch_moe_blocks(model, elastic=group, expert_source=source, **options)
    if args.rank == victim:
        dying = []
        report.blocks[0].module.register_forward_pre_hook(
            lambda *_: os.kill(os.getpid(), signal.SIGKILL) if dying else None
        )

        def on_step(step: int) -> None:
            if step == kill_step - 1:
                dying.append(step)
    else:
        on_step = None
    result = greedy_generate(
        model,
        report,
        prompt(args.rank, config.vocab_size),
        NEW_TOKENS[args.rank],
        on_step=on_step,
    )
    print(
        json.dumps(
            {
                "rank": args.rank,
                "new_rank": report.rank,
                "world": report.world_size,
                "tokens": result.tokens,
                "logits": result.logits.tolist(),
                "steps": result.steps,
                "idle_steps": result.idle_steps,
                "retried_steps": result.retried_steps,
                "lost_ranks": list(result.lost_ranks),
                "members": [list(r.members) for r in result.recoveries],
                "from_source": [[list(x.from_source) for x in r.layers] for r in result.recoveries],
                "recovery_lines": [r.lines() for r in result.recoveries],
                "fingerprints": [b.module.ep.placement.fingerprint() for b in report.blocks],
                "slots_hold_their_experts": slots_hold_their_experts(report, reference),
                "refused": refused,
            }
        ),
        flush=True,
    )
    for block in report.blocks:
        block.module.ep.close()


if __name__ == "__main__":
    main()
