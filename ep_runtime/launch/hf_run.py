"""``python -m ep_runtime.launch --hf-model NAME|PATH``: a Hugging Face MoE model on the ranks.

Each rank loads the model (a small random model of the named architecture, or a local
checkpoint), replaces its sparse-MoE blocks with EP blocks (only its expert shard stays) and
greedily generates for its own request (data-parallel attention, expert-parallel MoE), in
lockstep with the others. Rank r's request: a prompt of ``prompt_tokens + 3r`` random ids and up
to ``new_tokens + 2r`` new tokens (``--hf-idle-rank R``: no request), so ranks start and finish
at different steps. The reporting process then runs the unpatched model (transformers' own
``generate``, greedy) on every rank's prompt and requires the same tokens and logits within the
derived tolerance (``ep_runtime/tolerance.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table

from ep_runtime.bench.report import write_json
from ep_runtime.launch.presets import ModelPreset, RouterSpec
from ep_runtime.launch.rank import Step, peak_memory_bytes
from ep_runtime.launch.spec import RunSpec
from ep_runtime.tolerance import compare_per_token, tolerance_for

if TYPE_CHECKING:
    from ep_runtime.launch.rank import RankWorker

CONVENTIONS = (
    "tok/s = generated tokens / time from the first step to this rank's last token",
    "MoE s = time inside the EP blocks (router, dispatch, experts, combine, shared experts), "
    "waiting for other ranks and zero-token steps included; rest = everything else in the loop",
    "validation: the unpatched model, transformers' greedy generate, in the reporting process",
)


@dataclass(frozen=True)
class HFRun:
    """What every rank runs: the model and each rank's request."""

    model: str  # a random architecture name or a local checkpoint directory
    prompt_lengths: tuple[int, ...]  # per rank; 0 = no request
    new_tokens: tuple[int, ...]  # per rank, at most

    def prompt(self, rank: int, seed: int, vocab_size: int) -> list[int]:
        """Rank ``rank``'s prompt ids, the same in every process."""
        generator = torch.Generator().manual_seed(seed * 7919 + rank)
        return torch.randint(
            0, vocab_size, (self.prompt_lengths[rank],), generator=generator
        ).tolist()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Hugging Face model (instead of one synthetic layer)")
    group.add_argument(
        "--hf-model",
        metavar="NAME|PATH",
        help="generate with a transformers MoE model: qwen3-moe, mixtral, deepseek-v3, "
        "deepseek-v2 (small random models) or a local checkpoint directory",
    )
    group.add_argument("--hf-prompt-tokens", type=int, default=8,
                       help="rank r's prompt: this + 3r tokens")  # fmt: skip
    group.add_argument("--hf-new-tokens", type=int, default=12,
                       help="rank r generates up to this + 2r tokens")  # fmt: skip
    group.add_argument("--hf-idle-rank", type=int, action="append", default=[], metavar="RANK",
                       help="a rank with no request (repeatable)")  # fmt: skip


def _hf_config(name_or_path: str) -> Any:
    from ep_runtime.integrations.transformers import RANDOM_MODELS, random_config

    if name_or_path in RANDOM_MODELS:
        return random_config(name_or_path)
    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_path)
    raise ValueError(
        f"--hf-model: expected one of {', '.join(RANDOM_MODELS)} or a local checkpoint "
        f"directory, given {name_or_path!r}"
    )


def describe_model(name: str, config: Any, tokens_per_rank: int) -> ModelPreset:
    """The MoE layer shape of an HF config, for the report (the ranks read the real blocks)."""
    expert_keys = ("num_local_experts", "n_routed_experts", "num_experts")
    num_experts = next((getattr(config, k) for k in expert_keys if getattr(config, k, None)), 0)
    kind = config.model_type
    if kind == "deepseek_v3":
        router = RouterSpec(
            scoring="sigmoid",
            renormalize=bool(config.norm_topk_prob),
            correction_bias=True,
            num_expert_groups=config.n_group,
            num_topk_groups=config.topk_group,
            routed_scaling_factor=float(config.routed_scaling_factor),
        )
    elif kind == "deepseek_v2":
        router = RouterSpec(
            renormalize=False, routed_scaling_factor=float(config.routed_scaling_factor)
        )
    else:
        router = RouterSpec(renormalize=bool(getattr(config, "norm_topk_prob", True)))
    return ModelPreset(
        name=name,
        hidden_size=config.hidden_size,
        num_experts=int(num_experts),
        top_k=int(config.num_experts_per_tok or 0),
        intermediate_size=int(getattr(config, "moe_intermediate_size", config.intermediate_size)),
        activation="silu",
        router=router,
        tokens_per_rank=tokens_per_rank,
    )


def build_spec(args: argparse.Namespace, world_size: int) -> RunSpec:
    """The run of ``--hf-model``; checks what can be checked before any rank starts."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("--hf-model needs transformers: pip install 'ep_runtime[hf]'") from None
    if world_size < 1:
        raise ValueError(f"--dp: expected >= 1, given {world_size}")
    if args.hf_prompt_tokens < 1 or args.hf_new_tokens < 1:
        raise ValueError(
            "--hf-prompt-tokens and --hf-new-tokens: expected >= 1, given "
            f"{args.hf_prompt_tokens} and {args.hf_new_tokens}"
        )
    for rank in args.hf_idle_rank:
        if not 0 <= rank < world_size:
            raise ValueError(f"--hf-idle-rank: expected a rank in [0, {world_size}), given {rank}")
    if args.layout == "both":
        raise ValueError(
            "--layout: expected auto, standard or expanded with --hf-model, given both"
        )
    config = _hf_config(args.hf_model)
    idle = set(args.hf_idle_rank)
    prompts = tuple(
        0 if rank in idle else args.hf_prompt_tokens + 3 * rank for rank in range(world_size)
    )
    model = describe_model(args.hf_model, config, max(prompts))
    if model.num_experts % world_size:
        raise ValueError(
            f"--dp: {args.hf_model} has {model.num_experts} experts, "
            f"not divisible by {world_size} ranks"
        )
    run = HFRun(
        model=args.hf_model,
        prompt_lengths=prompts,
        new_tokens=tuple(args.hf_new_tokens + 2 * rank for rank in range(world_size)),
    )
    return RunSpec(
        model=model,
        world_size=world_size,
        device=args.device,
        dtype=args.dtype,
        dispatcher=args.dispatcher,
        experts=args.experts,
        layouts=(args.layout,),
        mode=args.mode,
        iters=1,
        warmup=min(args.warmup, 1),
        seed=args.seed,
        baselines=False,
        timeout_s=args.timeout,
        hf=run,
    )


def plan(spec: RunSpec) -> list[Step]:
    """The collective steps of an ``--hf-model`` run, identical on every rank."""
    steps = [Step("hf", ("setup",), 1, "load model, patch MoE blocks")]
    if spec.warmup:
        steps.append(Step("hf", ("warmup",), 1, "warm-up generation (2 tokens)"))
    steps.append(Step("hf", ("generate",), 1, "greedy generation, all ranks in lockstep"))
    steps.append(Step("hf", ("summarize",), 0, "summarize"))
    return steps


class HFRankWorker:
    """One rank's model, EP blocks and generation; methods are the steps of ``plan``."""

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.spec = worker.spec
        self.run: HFRun = worker.spec.hf
        self.rank = worker.rank
        self.device = worker.device
        self.dtype = self.spec.torch_dtype() or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )

    def setup(self) -> dict:
        from ep_runtime.integrations.transformers import load_model, patch_moe_blocks

        spec, run = self.spec, self.run
        options: dict[str, Any] = {
            "dispatcher": spec.dispatcher,
            "experts": spec.experts,
            "layout": spec.layouts[0],
            "mode": spec.mode,
            "device": self.device,
        }
        if spec.mode == "capacity":  # static buffers: the longest prompt must fit
            options["max_tokens_per_rank"] = max(1, *run.prompt_lengths)
        self.load = None
        if os.path.isdir(run.model):  # a checkpoint: this rank reads only its part of it
            from ep_runtime.integrations.checkpoint import load_sharded

            loaded = load_sharded(run.model, dtype=self.dtype, **options)
            model, self.report, self.load = loaded.model, loaded.patch, loaded.load
        else:
            model = load_model(run.model, seed=spec.seed, dtype=self.dtype, device=str(self.device))
            self.report = patch_moe_blocks(model, **options)
        gc.collect()
        self.model = model
        self.params_after = sum(p.numel() for p in model.parameters())
        self.params_before = self.params_after + self.report.expert_params_freed
        self.prompt = run.prompt(self.rank, spec.seed, model.config.vocab_size)
        return {"patched": self.report.describe()}

    def warmup(self) -> None:
        self._generate(min(2, self.run.new_tokens[self.rank]))

    def generate(self) -> None:
        self.result = self._generate(self.run.new_tokens[self.rank])

    def _generate(self, max_new_tokens: int):
        from ep_runtime.integrations.transformers import eos_ids, greedy_generate

        return greedy_generate(
            self.model,
            self.report,
            self.prompt or None,
            max_new_tokens,
            eos_token_id=eos_ids(self.model),
        )

    def summarize(self) -> dict:
        result, report = self.result, self.report
        generated = len(result.tokens)
        decode_s = result.active_s - result.prefill_s
        block = report.blocks[0].module
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "architecture": report.blocks[0].hf_class,
            "moe_blocks": len(report.blocks),
            "router": {k: getattr(v, "value", v) for k, v in asdict(block.router).items()},
            "choice": report.choice,
            "prompt": self.prompt,
            "max_new_tokens": self.run.new_tokens[self.rank],
            "tokens": result.tokens,
            # [N, V] as numpy: pickled by value (a torch tensor would travel as a shared-memory
            # handle that dies with the rank process); compared by the reporting process
            "logits": result.logits.numpy(),
            "steps": result.steps,
            "idle_steps": result.idle_steps,
            "prefill_s": result.prefill_s,
            "active_s": result.active_s,
            "total_s": result.total_s,
            "moe_s": result.moe_s,
            "tokens_per_s": generated / result.active_s if result.active_s > 0 else 0.0,
            "decode_tokens_per_s": (generated - 1) / decode_s if generated > 1 else 0.0,
            "local_experts": [report.local_experts.start, report.local_experts.stop],
            "num_experts": report.num_experts,
            "expert_params_kept": report.expert_params_kept,
            "expert_params_freed": report.expert_params_freed,
            "held_expert_bytes": report.held_expert_bytes(),
            "params_before_patch": self.params_before,
            "params_after_patch": self.params_after,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "load": None if self.load is None else self.load.describe(),
            "load_s": None if self.load is None else self.load.total_s,
            "bytes_read": None if self.load is None else self.load.bytes_read,
        }

    def close(self) -> None:
        for block in getattr(getattr(self, "report", None), "blocks", []):
            block.module.ep.close()


# the reporting process ----------------------------------------------------------------------------
def reference_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: list[int]
) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy ``generate`` on the unpatched model: tokens and ``[N, V]``
    logits (a fresh GenerationConfig: no processors a checkpoint's defaults might add)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)  # [1, P]
        # an explicit mask: generate() would otherwise take ids equal to pad_token_id for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.stack([step[0].float().cpu() for step in out.logits])


def validate(spec: RunSpec, summaries: list[dict]) -> list[dict]:
    """Every rank's tokens and logits against the unpatched model in this process."""
    from ep_runtime.integrations.transformers import eos_ids, load_model

    dtype = spec.torch_dtype() or (torch.bfloat16 if spec.device == "cuda" else torch.float32)
    device = "cuda" if spec.device == "cuda" and torch.cuda.is_available() else "cpu"
    model = load_model(spec.hf.model, seed=spec.seed, dtype=dtype, device=device)
    eos = eos_ids(model)
    shape = spec.model
    tolerance = tolerance_for(dtype, max(shape.hidden_size, shape.intermediate_size))
    results = []
    for summary in summaries:
        if not summary["prompt"]:
            results.append(
                {
                    "passed": summary["tokens"] == [],
                    "tokens_match": summary["tokens"] == [],
                    "first_mismatch": None,
                    "max_rel_err": 0.0,
                    "tolerance": tolerance,
                    "verdict": "no request: no tokens expected",
                }
            )
            continue
        tokens, logits = reference_greedy(model, summary["prompt"], summary["max_new_tokens"], eos)
        ours = summary["tokens"]
        mismatch = next(
            (i for i, (a, b) in enumerate(zip(ours, tokens, strict=False)) if a != b),
            None if len(ours) == len(tokens) else min(len(ours), len(tokens)),
        )
        compared = min(len(ours), len(tokens)) if mismatch is None else mismatch + 1
        compared = min(compared, len(ours), len(tokens))
        comparison = compare_per_token(
            torch.from_numpy(summary["logits"][:compared]), logits[:compared], tolerance
        )
        results.append(
            {
                "passed": mismatch is None and comparison.passed,
                "tokens_match": mismatch is None,
                "first_mismatch": mismatch,
                "reference_tokens": tokens,
                "max_rel_err": comparison.max_relative_error,
                "tolerance": tolerance,
                "verdict": comparison.describe()
                + ("" if mismatch is None else f"; tokens differ from step {mismatch}"),
            }
        )
    return results


def build_hf_report(
    spec: RunSpec, launcher: str, summaries: list[dict], elapsed_s: float, validations: list[dict]
) -> dict:
    summaries = sorted(summaries, key=lambda s: s["rank"])
    per_rank = []
    for summary, validation in zip(summaries, validations, strict=True):
        row = {k: v for k, v in summary.items() if k != "logits"}
        row["generated"] = len(summary["tokens"])
        row["rest_s"] = summary["total_s"] - summary["moe_s"]
        row["validation"] = validation
        row["passed"] = validation["passed"]
        per_rank.append(row)
    first = summaries[0]
    return {
        "passed": all(row["passed"] for row in per_rank),
        "kind": "hf",
        "world_size": len(summaries),
        "launcher": launcher,
        "device": spec.device,
        "dtype": first["dtype"],
        "model": spec.model.to_json(),
        "hf_model": spec.hf.model,
        "architecture": first["architecture"],
        "moe_blocks": first["moe_blocks"],
        "router": first["router"],
        "choice": first["choice"],
        "mode": spec.mode,
        "steps": first["steps"],
        "max_rel_err": max(v["max_rel_err"] for v in validations),
        "tolerance": validations[0]["tolerance"],
        "per_rank": per_rank,
        "spec": spec.to_json(),
        "conventions": list(CONVENTIONS),
        "elapsed_s": elapsed_s,
    }


def print_hf_report(report: dict, console: Console) -> None:
    model = report["model"]
    verdict = "[bold green]PASSED[/]" if report["passed"] else "[bold red]FAILED[/]"
    console.print(
        f"{verdict}  {report['hf_model']} ({report['architecture']} × {report['moe_blocks']}, "
        f"E={model['num_experts']} K={model['top_k']} H={model['hidden_size']} "
        f"I={model['intermediate_size']})  W={report['world_size']} ({report['launcher']}, "
        f"{report['device']}, {report['dtype']}, {report['mode']})  {report['steps']} lockstep "
        f"steps  max logits rel err {report['max_rel_err']:.2e} (tol {report['tolerance']:.2e})",
        highlight=False,
    )
    console.print(f"[dim]{report['choice'].splitlines()[0]}; router {report['router']}[/]")
    table = Table(title="Ranks: greedy generation, each rank its own request")
    columns = (
        "rank", "prompt", "gen", "idle", "tok/s", "prefill ms", "MoE s", "rest s", "experts",
        "params", "peak MB", "rel err", "tokens",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for r in report["per_rank"]:
        v = r["validation"]
        status = "[green]same[/]" if v["tokens_match"] else f"[red]differ @{v['first_mismatch']}[/]"
        table.add_row(
            str(r["rank"]),
            str(len(r["prompt"])),
            str(r["generated"]),
            str(r["idle_steps"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['prefill_s'] * 1e3:.1f}",
            f"{r['moe_s']:.3f}",
            f"{r['rest_s']:.3f}",
            f"{r['local_experts'][0]}-{r['local_experts'][1] - 1}",
            _count(r["expert_params_kept"]),
            f"{r['peak_memory_bytes'] / 1e6:.0f}",
            f"{v['max_rel_err']:.1e}",
            status,
        )
    console.print(table)
    for r in report["per_rank"]:
        if r.get("load"):  # --hf-model DIR: what each rank read of the checkpoint
            console.print(f"[dim]{r['load']}[/]", highlight=False)
    console.print(
        f"params = routed-expert parameters the rank keeps, of "
        f"{_count(report['per_rank'][0]['expert_params_freed'])} in the model; "
        + "; ".join(report["conventions"]),
        highlight=False,
    )


def _count(number: int) -> str:
    """12345678 → '12.3M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if number >= scale:
            return f"{number / scale:.3g}{unit}"
    return str(number)


def finish(
    spec: RunSpec,
    launcher: str,
    summaries: list[dict],
    elapsed_s: float,
    is_reporter: bool,
    console: Console,
    json_path: str | None,
) -> int:
    """Validate (reporting process only), print, write JSON; the exit status (0 ok, 1 wrong)."""
    if not is_reporter:
        return 0
    validations = validate(spec, sorted(summaries, key=lambda s: s["rank"]))
    report = build_hf_report(spec, launcher, summaries, elapsed_s, validations)
    print_hf_report(report, console)
    if json_path:
        write_json(report, json_path)
    return 0 if report["passed"] else 1
