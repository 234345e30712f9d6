"""Tokens/s of a Qwen3-30B-A3B-shaped transformers model: transformers' own MoE blocks vs
ep_runtime's (``patch_moe_blocks``), at prefill and decode, world size 1 (no process group).

The model has Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of intermediate 768, top-8,
32 heads / 4 KV heads of 128) with ``--layers`` layers and seeded random weights. The rows: each
transformers experts implementation in ``--hf-experts`` (the first is the baseline); the model
patched (its MoE blocks become EP blocks) with every layer option at its default (the row
"ep_runtime defaults": what a user of ``patch_moe_blocks(model)`` gets); with
``max_tokens_per_rank`` tuned to the workload (the row "ep_runtime tuned: max_tokens_per_rank=N",
N from ``--tuned-max-tokens``, default the prefill's tokens; 0 skips it); on CUDA also the
defaults with the layers' own graphs of eager forwards off (``forward_graphs=None``: what they
give), and a decode-only row "ep_runtime capacity + CUDA graphs" (capacity mode with the decode
batch as its cap, each block's decode forward replayed as a CUDA graph:
``patch_moe_blocks(..., cuda_graph_tokens=B)``; ``--no-graphs`` skips it). Every patched row
has its own copy of the same weights (rebuilt from the seed), all held at once, so the rows'
timings are interleaved: each of ``--iters`` rounds (after ``--warmup``) times every row once,
device-synchronised, and a row's figure is its median. Prefill: ``--prefill-batch`` prompts of
``--prefill-len`` tokens, no cache, last-token logits. Decode: ``--decode-batch`` sequences with
a ``--decode-context``-token KV cache, ``--decode-steps`` one-token steps. The column "host":
the host's time to issue one MoE block forward at decode (router, routing, experts, shared
experts; no device sync), over one more decode run of each row.

    python -m ep_runtime.bench.hf               # GPU: bf16, the shapes above (Qwen3-30B-A3B
                                                # layers, prefill 4 x 1024, decode 64 x 16)
    python -m ep_runtime.bench.hf --tiny        # CPU check: a small model, a few tokens

``--fp32-reference`` also runs the unpatched model once in fp32 (the same weights, upcast, with
transformers' eager experts) and prints every implementation's distance from it (max per-token
relative error of the prefill logits): how far each low-precision computation lands from the
higher-precision one, ours and transformers' alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ep_runtime.bench.hf_timing import (
    BlockHostClock,
    Contender,
    check_room_for_rows,
    interleaved_medians,
)
from ep_runtime.bench.timing import sync
from ep_runtime.integrations.transformers import (
    find_moe_blocks,
    patch_moe_blocks,
    require_transformers,
)
from ep_runtime.tolerance import compare_per_token, tolerance_for

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    norm_topk_prob=True,
)
TINY = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    intermediate_size=96,
    num_experts=16,
    num_experts_per_tok=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    norm_topk_prob=True,
)
FP32_REFERENCE_EXPERTS = "eager"  # the fp32 yardstick's experts: none of the compared paths
TINY_WORKLOAD = dict(
    prefill_batch=2, prefill_len=32, decode_batch=4, decode_context=16, decode_steps=4, iters=2
)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected >= 1, given {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.hf",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--tiny", action="store_true", help="a small model and workload (CPU)")
    parser.add_argument(
        "--layers",
        type=int,
        default=4,
        help="decoder layers (every row holds a model of them on the device at once)",
    )
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        help="override the vocabulary (memory), default the model's",
    )
    parser.add_argument(
        "--fp32-reference",
        action="store_true",
        help="compare every implementation's prefill logits with the model run in fp32",
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--hf-experts",
        default="grouped_mm,eager",
        help="transformers experts implementations to time (the first is the baseline)",
    )
    parser.add_argument("--experts", default="auto", help="ep_runtime experts backend")
    parser.add_argument("--dispatcher", default="auto", help="ep_runtime dispatcher")
    parser.add_argument("--mode", choices=("exact", "capacity"), default="exact")
    parser.add_argument(
        "--tuned-max-tokens",
        type=int,
        help="max_tokens_per_rank of the tuned row (default: max(prefill tokens, decode "
        "batch), what a tuned run passes; 0: no tuned row)",
    )
    parser.add_argument(
        "--no-graphs",
        action="store_true",
        help="skip the decode row with the blocks' CUDA graphs (CUDA only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.tiny:
        given = set(argv if argv is not None else sys.argv[1:])
        for key, value in TINY_WORKLOAD.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
        if "--layers" not in given:
            args.layers = 2
    return args


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """A Qwen3-MoE causal LM, every layer MoE, weights ~ N(0, 1/fan_in) generated on device."""
    hf = require_transformers()
    shapes = TINY if args.tiny else QWEN3_30B_A3B
    if args.vocab_size is not None:
        shapes = {**shapes, "vocab_size": args.vocab_size}
    config = hf.Qwen3MoeConfig(
        **shapes,
        num_hidden_layers=args.layers,
        max_position_embeddings=max(args.prefill_len, args.decode_context) + 1024,
        tie_word_embeddings=False,
    )
    with torch.device(device):
        model = hf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.size(-1) ** -0.5, generator=generator)
            else:
                param.fill_(1.0)
    return model.eval()


def measure(
    contenders: list[Contender],
    args: argparse.Namespace,
    device: torch.device,
    prompts: torch.Tensor,  # [B, P] token ids
    decode_state: tuple[Any, torch.Tensor],  # (the context's KV cache, next tokens [B, 1])
) -> dict[str, dict]:
    """Per contender: prefill (where it takes it) and decode seconds, interleaved, the host µs per
    MoE block forward over one more decode run, and the prefill logits (last token of each
    prompt); None for a phase not run."""
    context_cache, next_tokens = decode_state

    def run_prefill(model: torch.nn.Module) -> torch.Tensor:
        return model(input_ids=prompts, use_cache=False, logits_to_keep=1).logits

    def decode(model: torch.nn.Module) -> None:
        cache = copy.deepcopy(context_cache)
        tokens = next_tokens
        for _ in range(args.decode_steps):
            out = model(input_ids=tokens, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            tokens = out.logits[:, -1:].argmax(-1)

    results: dict[str, dict] = {c.name: {"prefill_s": None, "logits": None} for c in contenders}
    with torch.no_grad():
        prefilling = [c for c in contenders if c.prefill]
        for contender in prefilling:
            contender.prepare()
            logits = run_prefill(contender.model)[:, -1].float().cpu()  # [B, V]
            results[contender.name]["logits"] = logits
        runs = {c.name: c.timed(run_prefill) for c in prefilling}
        for name, seconds in interleaved_medians(runs, device, args.iters, args.warmup).items():
            results[name]["prefill_s"] = seconds
        runs = {c.name: c.timed(decode) for c in contenders}
        for name, seconds in interleaved_medians(runs, device, args.iters, args.warmup).items():
            results[name]["decode_s"] = seconds
        for contender in contenders:
            contender.prepare()
            with BlockHostClock(contender.blocks) as clock:
                decode(contender.model)
            sync(device)
            results[contender.name]["decode_block_host_us"] = clock.microseconds_per_forward
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf = require_transformers()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    console = Console(width=120)
    command = "python -m ep_runtime.bench.hf " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    torch.manual_seed(args.seed)
    model = build_model(args, device, dtype)
    config = model.config
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(
        0, config.vocab_size, (args.prefill_batch, args.prefill_len), generator=generator
    ).to(device)
    context = torch.randint(
        0, config.vocab_size, (args.decode_batch, args.decode_context), generator=generator
    ).to(device)
    with torch.no_grad():  # the KV cache every decode timing starts from (copied each time)
        out = model(input_ids=context, use_cache=True, logits_to_keep=1)
        decode_state = (out.cache, out.logits[:, -1:].argmax(-1))
    reference_logits = None
    if args.fp32_reference:  # before patching: the HF blocks, upcast (a copy, freed after)
        reference = copy.deepcopy(model).float()
        reference.set_experts_implementation(FP32_REFERENCE_EXPERTS)
        with torch.no_grad():
            out = reference(input_ids=prompts, use_cache=False, logits_to_keep=1)
            reference_logits = out.logits[:, -1].float().cpu()  # [B, V]
        del reference, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hf_blocks = [block for _, block in find_moe_blocks(model)]
    contenders = [
        Contender(f"transformers {implementation}", model, hf_blocks, True, implementation)
        for implementation in args.hf_experts.split(",")
    ]
    tuned = args.tuned_max_tokens
    if tuned is None:
        tuned = max(args.prefill_batch * args.prefill_len, args.decode_batch)
    settings: list[tuple[str, dict]] = [("defaults", {})]
    if tuned > 0:
        settings.append((f"tuned: max_tokens_per_rank={tuned}", {"max_tokens_per_rank": tuned}))
    batch = args.decode_batch
    if device.type == "cuda":  # what the layers' own graphs of eager forwards give (the default)
        settings.append(("defaults but forward_graphs=None", {"forward_graphs": None}))
    if device.type == "cuda" and not args.no_graphs:
        graphs = {"mode": "capacity", "max_tokens_per_rank": batch, "cuda_graph_tokens": batch}
        settings.append((f"capacity + CUDA graphs (cap {batch}, decode only)", graphs))
    check_room_for_rows(model, len(settings), device)
    choices: dict[str, str] = {}
    ours: list[str] = []
    for label, options in settings:  # each on its own copy of the same weights (seeded)
        torch.manual_seed(args.seed)
        patched = build_model(args, device, dtype)
        options = {"mode": args.mode, **options}
        report = patch_moe_blocks(
            patched, dispatcher=args.dispatcher, experts=args.experts, **options
        )
        choice = report.choice.splitlines()[0].replace("dispatcher=", "").replace("experts=", "")
        name = f"ep_runtime {label} ({choice})"
        prefill = "cuda_graph_tokens" not in options  # the graphs' cap is the decode batch
        blocks = [block.module for block in report.blocks]
        contenders.append(Contender(name, patched, blocks, prefill))
        choices[label] = report.choice
        ours.append(name)
    results = measure(contenders, args, device, prompts, decode_state)

    baseline_name = next(iter(results))
    tolerance = tolerance_for(dtype, max(config.hidden_size, config.moe_intermediate_size))
    tokens = {
        "prefill": args.prefill_batch * args.prefill_len,
        "decode": args.decode_batch * args.decode_steps,
    }
    forwards = {"prefill": 1, "decode": args.decode_steps}
    table = Table(
        title=f"{config.num_hidden_layers} layers of Qwen3-30B-A3B shape (H={config.hidden_size}, "
        f"E={config.num_experts}, I={config.moe_intermediate_size}, K={config.num_experts_per_tok})"
        f", {args.dtype}, {device}, world size 1"
        if not args.tiny
        else f"--tiny: {config.num_hidden_layers} layers, H={config.hidden_size}, "
        f"E={config.num_experts}, K={config.num_experts_per_tok}, {args.dtype}, {device}"
    )
    columns = ("phase", "MoE blocks", "tokens", "ms / forward", "tokens/s", "vs baseline", "host")
    for column in columns:
        table.add_column(column, justify="left" if column in ("phase", "MoE blocks") else "right")
    rows = []
    for phase in ("prefill", "decode"):
        base_s = results[baseline_name][f"{phase}_s"]
        for name, result in results.items():
            seconds = result[f"{phase}_s"]
            if seconds is None:
                continue
            row = {
                "phase": phase,
                "moe_blocks": name,
                "tokens_per_timing": tokens[phase],
                "ms_per_forward": seconds / forwards[phase] * 1e3,
                "tokens_per_s": tokens[phase] / seconds,
                "vs_baseline": base_s / seconds,
                "block_host_us": result["decode_block_host_us"] if phase == "decode" else None,
            }
            rows.append(row)
            table.add_row(
                phase,
                name,
                str(tokens[phase]),
                f"{row['ms_per_forward']:.2f}",
                f"{row['tokens_per_s']:,.0f}",
                f"{row['vs_baseline']:.2f}x",
                "–" if row["block_host_us"] is None else f"{row['block_host_us']:.0f} µs",
            )
    console.print(table)
    console.print(
        f"baseline: {baseline_name}; 'defaults': patch_moe_blocks(model) with every layer option "
        "at its default"
        + (f"; 'tuned': {settings[1][0].split(': ')[1]}" if tuned > 0 else "")
        + "; host: the host's time to issue one MoE block forward at decode (no device sync, "
        "one more decode run)",
        highlight=False,
    )
    agreements = {}
    for name in ours:
        if results[name]["logits"] is None:
            continue
        agreement = compare_per_token(
            results[name]["logits"], results[baseline_name]["logits"], tolerance
        )
        agreements[name] = agreement.describe()
        console.print(
            f"prefill last-token logits, {name} vs {baseline_name}: {agreement.describe()}",
            highlight=False,
        )
    # the same comparison between transformers' own implementations: how far two correct
    # computations of this model drift apart in this dtype (routing near-ties flip in bf16)
    for name in results:
        if name != baseline_name and name not in ours:
            spread = compare_per_token(
                results[name]["logits"], results[baseline_name]["logits"], tolerance
            )
            console.print(
                f"prefill last-token logits, {name} vs {baseline_name}: {spread.describe()}",
                highlight=False,
            )
    fp32_distance: dict[str, float] | None = None  # max per-token relative error vs fp32
    if reference_logits is not None:
        fp32_distance = {}
        for name, result in results.items():
            if result["logits"] is None:
                continue
            distance = compare_per_token(result["logits"], reference_logits, tolerance)
            fp32_distance[name] = distance.max_relative_error
            console.print(
                f"prefill last-token logits, {name} vs the model in fp32 "
                f"({FP32_REFERENCE_EXPERTS} experts): max per-token relative error "
                f"{distance.max_relative_error:.3e}",
                highlight=False,
            )
    console.print(
        f"decode: batch {args.decode_batch}, {args.decode_context}-token cache, "
        f"{args.decode_steps} steps; prefill: batch {args.prefill_batch} × {args.prefill_len}; "
        f"medians of {args.iters} after {args.warmup} warm-up; torch {torch.__version__}, "
        f"transformers {hf.__version__}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        highlight=False,
    )
    console.print(f"command: {command}", highlight=False, soft_wrap=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "rows": rows,
                    "logits_agreement": agreements,
                    "fp32_distance": fp32_distance,
                    "ep_choice": choices,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
