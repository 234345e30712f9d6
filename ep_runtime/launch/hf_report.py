"""The reporting process of an ``--hf-model`` run (``launch/hf_run.py``): every rank's tokens and
logits against transformers' own greedy ``generate`` on the unpatched model, and the report. A
model's FP8 experts are computed there by transformers' fp8 forward where it runs, else by the
fp8 contract's math (said in the report). An ``--elastic`` run's survivors are validated the same
way; its report adds the lost ranks, their requests (lost) and the recoveries
(``hf_elastic_report``)."""

from __future__ import annotations

import torch
from rich.console import Console

from ep_runtime.bench.report import _table, print_table, print_verdict
from ep_runtime.launch.elastic_report import rank_list
from ep_runtime.launch.hf_elastic_report import build_elastic, elastic_lines, elastic_verdict
from ep_runtime.launch.spec import RunSpec
from ep_runtime.tolerance import compare_per_token, tolerance_for

MAX_NAMED_RANKS = 4  # the verdict names the ranks whose tokens differ up to this many
# printed under the tables, one line per column group, and stored in the JSON report
CONVENTIONS = (
    "prompt = prompt tokens (rank r: --hf-prompt-tokens + 3r); gen = tokens generated (at most "
    "--hf-new-tokens + 2r); idle = lockstep steps the rank ran every MoE block on zero tokens of "
    "its own (no request, or finished), serving its experts to the others",
    "tok/s = generated tokens / time from the first step to this rank's last token; prefill ms = "
    "this rank's first forward (its whole prompt)",
    "MoE s = time inside the EP blocks (router, dispatch, experts, combine, shared experts), "
    "waiting for other ranks and zero-token steps included; rest s = everything else in the "
    "loop (attention, norms, the LM head, the token choice)",
    "experts = the routed experts the rank holds (global ids); params = their parameters; peak MB "
    "= the rank's peak memory (CUDA: allocated; CPU: resident set)",
    "validation: the unpatched model, transformers' greedy generate, in the reporting process; "
    "rel err = max over steps of |ours - ref| / |ref| of the logits (tolerance from "
    "ep_runtime/tolerance.py); tokens = same: every token equal, differ @i: from step i on",
)
LOST_CONVENTION = (
    "--elastic: a rank lost (lost @N: killed in lockstep step N) has no row values and no "
    "tokens: its request is not served; the others' are validated in full"
)


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


def fp8_reference(model: torch.nn.Module) -> str | None:
    """For a model with FP8 experts, what computes them in the reference: transformers' own
    forward where it runs, else the fp8 contract's math (``integrations.transformers.fp8``),
    saying in one line why transformers' does not run: off a GPU, that it needs one (its kernels,
    DeepGEMM or the Hub's finegrained-fp8 Triton kernel, are CUDA only: not tried, so nothing is
    fetched from the Hub); on a GPU, the first line of the error its forward raised."""
    from ep_runtime.integrations.transformers.fp8 import (
        fp8_experts,
        fp8_forward_unavailable,
        use_contract_experts,
    )

    if not fp8_experts(model):
        return None
    device = next(model.parameters()).device
    if device.type == "cuda":
        unavailable = fp8_forward_unavailable(model)
        if unavailable is None:
            return "FP8 experts: transformers' own fp8 forward"
    else:
        unavailable = (
            f"it needs a GPU, its kernels are CUDA only; the reference runs on {device.type}"
        )
    use_contract_experts(model)
    return (
        "FP8 experts: the fp8 contract's math (fp64, dequantized weights, quantized GEMM inputs); "
        f"transformers' fp8 forward does not run here ({unavailable})"
    )


def validate(spec: RunSpec, summaries: list[dict]) -> list[dict]:
    """Every rank's tokens and logits against the unpatched model in this process."""
    from ep_runtime.integrations.transformers import eos_ids, load_model

    run = spec.workload
    dtype = run.compute_dtype(spec.device)
    device = "cuda" if spec.device == "cuda" and torch.cuda.is_available() else "cpu"
    model = load_model(run.hf_model, seed=run.seed, dtype=dtype, device=device)
    eos = eos_ids(model)
    shape = run.model
    experts_reference = fp8_reference(model)
    # fp8 is judged at the bf16 tolerance whatever the compute dtype (as the layer, issue 21)
    judged = dtype if experts_reference is None else torch.bfloat16
    tolerance = tolerance_for(judged, max(shape.hidden_size, shape.intermediate_size))
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
                    "experts_reference": experts_reference,
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
        # a copy: arrays from Ray's object store are read-only (torch warns on sharing them)
        ours_logits = torch.tensor(summary["logits"][:compared])
        comparison = compare_per_token(ours_logits, logits[:compared], tolerance)
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
                "experts_reference": experts_reference,
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
    elastic = build_elastic(spec, summaries) if spec.workload.elastic else None
    conventions = [*CONVENTIONS, *([LOST_CONVENTION] if elastic else [])]
    return {
        "passed": all(row["passed"] for row in per_rank) and not (elastic or {}).get("problems"),
        "kind": "hf",
        "world_size": spec.world_size,
        "launcher": launcher,
        "device": spec.device,
        "dtype": first["dtype"],
        "model": spec.workload.model.to_json(),
        "hf_model": spec.workload.hf_model,
        "architecture": first["architecture"],
        "moe_blocks": first["moe_blocks"],
        "router": first["router"],
        "choice": first["choice"],
        "mode": spec.workload.mode,
        "steps": first["steps"],
        "max_rel_err": max(v["max_rel_err"] for v in validations),
        "tolerance": validations[0]["tolerance"],
        "experts_reference": validations[0]["experts_reference"],
        "per_rank": per_rank,
        "elastic": elastic,
        "spec": spec.to_json(),
        "conventions": conventions,
        "elapsed_s": elapsed_s,
    }


def describe_router(router: dict) -> str:
    """``route()``'s settings in words: 'softmax, top-3, renormalised, ...'."""
    parts = [router["scoring"], f"top-{router['top_k']}"]
    if router.get("num_expert_groups"):
        ranked = " (by their best score)" if router.get("group_scoring") == "max" else ""
        groups = f"top-{router['num_topk_groups']} of {router['num_expert_groups']} groups"
        parts.append(groups + ranked)
    if router.get("uses_correction_bias"):
        parts.append("correction bias")
    parts.append("renormalised" if router["renormalize"] else "not renormalised")
    if router.get("routed_scaling_factor", 1.0) != 1.0:
        parts.append(f"scaled by {router['routed_scaling_factor']:g}")
    if router.get("weights_in_logits_dtype"):
        parts.append("weights rounded to the logits' dtype")
    return ", ".join(parts)


def hf_verdict_line(report: dict) -> str:
    """The report's last line: PASSED or FAILED, whether every rank's tokens are transformers'
    (else the ranks whose differ), the largest logits error against its tolerance."""
    differ = [str(r["rank"]) for r in report["per_rank"] if not r["validation"]["tokens_match"]]
    if len(differ) > MAX_NAMED_RANKS:  # the line stays within 80 columns
        ranks = f"{len(differ)} of {report['world_size']} ranks"
    else:
        ranks = f"rank{'s' if len(differ) > 1 else ''} {', '.join(differ)}"
    if report.get("elastic"):
        error = f"{report['max_rel_err']:.1e}"
        return elastic_verdict(
            report["elastic"], report["passed"], ranks if differ else None, error
        )
    tokens = f"tokens differ on {ranks}" if differ else "tokens as transformers'"
    word = "PASSED" if report["passed"] else "FAILED"
    return (
        f"{word}: {tokens}, logits rel err {report['max_rel_err']:.1e} "
        f"(tol {report['tolerance']:.1e})"
    )


def print_hf_report(report: dict, console: Console) -> None:
    """The run in one line; a generation table and an experts-and-validation table (both fit 80
    columns); a legend line per group of columns; last, the verdict (``hf_verdict_line``)."""
    model = report["model"]
    console.print(
        f"{report['hf_model']} ({report['architecture']} × {report['moe_blocks']}, "
        f"E={model['num_experts']} K={model['top_k']} H={model['hidden_size']} "
        f"I={model['intermediate_size']})  W={report['world_size']} ({report['launcher']}, "
        f"{report['device']}, {report['dtype']}, {report['mode']})  {report['steps']} lockstep "
        "steps",
        highlight=False,
    )
    console.print(
        f"[dim]backends: {report['choice'].splitlines()[0]}; "
        f"router: {describe_router(report['router'])}[/]",
        highlight=False,
    )
    if report["experts_reference"]:
        line = f"validation reference: {report['experts_reference']}"
        console.print(line, style="dim", markup=False, highlight=False)
    generation = _table(
        "Generation: each rank its own request, in lockstep",
        {"rank": "right", "prompt": "right", "gen": "right", "idle": "right", "tok/s": "right",
         "prefill ms": "right", "MoE s": "right", "rest s": "right"},
    )  # fmt: skip
    held = _table(
        "Experts, memory and validation against transformers",
        {"rank": "right", "host": "left", "experts": "right", "params": "right",
         "peak MB": "right", "rel err": "right", "tolerance": "right", "tokens": "left"},
    )  # fmt: skip
    lost = {q["rank"]: q for q in (report.get("elastic") or {}).get("lost_requests", [])}
    for r in sorted([*report["per_rank"], *lost.values()], key=lambda row: row["rank"]):
        if r["rank"] in lost:  # listed, not hidden: its request was not served
            generation.add_row(str(r["rank"]), str(r["prompt_tokens"]), "lost", *["-"] * 5)
            held.add_row(str(r["rank"]), *["-"] * 6, f"[red]lost @{r['step']}[/]")
            continue
        v = r["validation"]
        generation.add_row(
            str(r["rank"]),
            str(len(r["prompt"])),
            str(r["generated"]),
            str(r["idle_steps"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['prefill_s'] * 1e3:.1f}",
            f"{r['moe_s']:.3f}",
            f"{r['rest_s']:.3f}",
        )
        status = "[green]same[/]" if v["tokens_match"] else f"[red]differ @{v['first_mismatch']}[/]"
        held.add_row(
            str(r["rank"]),
            r["host"],
            rank_list(r["local_experts"]),
            _count(r["expert_params_kept"]),
            f"{r['peak_memory_bytes'] / 1e6:.0f}",
            f"{v['max_rel_err']:.1e}",
            f"{v['tolerance']:.1e}",
            status,
        )
    print_table(generation, console)
    print_table(held, console)
    for r in report["per_rank"]:
        if r.get("load"):  # --hf-model DIR: what each rank read of the checkpoint
            console.print(f"[dim]{r['load']}[/]", highlight=False)
    total = _count(report["per_rank"][0]["expert_params_freed"])
    console.print(f"[dim]the model has {total} routed-expert parameters in all[/]")
    for line in report["conventions"]:
        console.print(f"[dim]{line}[/]", highlight=False)
    for line in elastic_lines(report["elastic"]) if report.get("elastic") else []:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    print_verdict(hf_verdict_line(report), report["passed"], console)


def _count(number: int) -> str:
    """12345678 → '12.3M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if number >= scale:
            return f"{number / scale:.3g}{unit}"
    return str(number)
