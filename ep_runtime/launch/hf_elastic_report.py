"""The elastic part of an ``--hf-model --elastic`` run's report (``launch/hf_report.py``): which
ranks were lost and in which lockstep step, their requests (lost, not served), each recovery's
timeline (the slowest survivor at each step) and where the lost experts came from; and the
problems that fail the run whatever the tokens: a kill not as told, a survivor missing, a
recovery that does not account for the kills. Its lines are at most 80 columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ep_runtime.launch.elastic_report import STEPS, WIDTH, as_ms, fitted, kill_problems, rank_list

if TYPE_CHECKING:
    from ep_runtime.launch.spec import RunSpec


def build_elastic(spec: RunSpec, survivors: Sequence[dict]) -> dict:
    """The report's ``elastic`` entry from the survivors' summaries (by original rank)."""
    run = spec.workload
    kills = {kill.rank: kill.iteration for kill in run.kills}
    killed = {record["rank"]: record for s in survivors for record in s["kills"]}
    count = min((len(s["recoveries"]) for s in survivors), default=0)
    reported = {s["rank"] for s in survivors}
    return {
        "kills": [{"rank": rank, "step": step} for rank, step in sorted(kills.items())],
        "lost_ranks": sorted(kills),
        "survivors": [s["rank"] for s in survivors],
        "killed": [killed[rank] for rank in sorted(killed)],
        "lost_requests": [
            {
                "rank": rank,
                "step": step,
                "prompt_tokens": run.prompt_lengths[rank],
                "max_new_tokens": run.new_tokens[rank] if run.prompt_lengths[rank] else 0,
                "served": False,
            }
            for rank, step in sorted(kills.items())
            if rank not in reported  # a kill that did not happen: a problem, its request served
        ],
        "recoveries": [_recovery(index, survivors, killed) for index in range(count)],
        "problems": _problems(spec.world_size, kills, killed, survivors),
    }


def _problems(
    world_size: int, kills: dict[int, int], killed: dict[int, dict], survivors: Sequence[dict]
) -> list[str]:
    """Why the run did not pass, its tokens aside."""
    problems = kill_problems(world_size, kills, killed, survivors, "step")
    expected = [rank for rank in range(world_size) if rank not in kills]
    for s in survivors:
        if s["members"] != expected or sorted(s["lost_ranks"]) != sorted(kills):
            problems.append(
                f"rank {s['rank']}: expected recoveries losing ranks {sorted(kills)} and a "
                f"group of {expected}, given {s['lost_ranks']} and {s['members']}"
            )
        if s["retried_steps"] < len(s["recoveries"]):
            problems.append(
                f"rank {s['rank']}: {len(s['recoveries'])} recoveries but "
                f"{s['retried_steps']} steps run again"
            )
    return problems


def _recovery(index: int, survivors: Sequence[dict], killed: dict[int, dict]) -> dict:
    """Recovery ``index`` as every survivor timed it, each time the slowest survivor's."""
    mine = [s["recoveries"][index] for s in survivors]
    first = mine[0]
    killed_at = min((killed[r]["at"] for r in first["lost"] if r in killed), default=None)

    def since_kill(times: list[float | None]) -> float | None:
        if killed_at is None or None in times:
            return None
        return max(times) - killed_at

    resumed = [r["resumed_at"] for r in mine]
    done = [r["done_at"] for r in mine]
    layers = first["layers"]
    origins: dict[str, int] = {}
    for layer in layers:
        for origin, slots in layer["origins"].items():
            origins[origin] = origins.get(origin, 0) + slots
    return {
        "generation": first["generation"],
        "lost": first["lost"],
        "members": first["members"],
        "attempts": max(r["attempts"] for r in mine),
        **{key: max(r[key] for r in mine) for key in STEPS},
        "recovery_s": max(r["total_s"] for r in mine),
        "step_run_again": first["step"],
        "serving_again_s": since_kill(resumed),
        "step_again_s": None
        if None in resumed or None in done
        else max(d - r for d, r in zip(done, resumed, strict=True)),
        "kill_to_step_done_s": since_kill(done),
        "blocks": len(layers),
        "origins": origins,
        "from_replicas": [layer["from_replicas"] for layer in layers],
        "from_source": [layer["from_source"] for layer in layers],
        "lines": first["lines"],
    }


def elastic_lines(elastic: dict) -> list[str]:
    """The lost ranks and their requests, then each recovery's timeline; at most 80 columns."""
    killed = {record["rank"] for record in elastic["killed"]}
    lines = []
    for lost in elastic["lost_requests"]:
        how = "SIGKILLed" if lost["rank"] in killed else "told to die"
        request = (
            f"its request (prompt {lost['prompt_tokens']}, up to {lost['max_new_tokens']} tokens)"
            if lost["prompt_tokens"]
            else "no request"
        )
        lines.append(f"Lost: rank {lost['rank']}, {how} in step {lost['step']}, and {request}")
    for index, recovery in enumerate(elastic["recoveries"]):
        lines += _recovery_lines(index, recovery)
    lines += [f"problem: {problem}" for problem in elastic["problems"]]
    return fitted(lines)


def _recovery_lines(index: int, r: dict) -> list[str]:
    step = r["step_run_again"]
    replicas = sum(map(len, r["from_replicas"]))
    read = sum(map(len, r["from_source"]))
    pairs = zip(r["from_replicas"], r["from_source"], strict=True)
    per_block = {tuple(sorted([*copied, *source])) for copied, source in pairs}
    experts = (
        f"lost experts {rank_list(next(iter(per_block)))} in each of {r['blocks']} blocks"
        if len(per_block) == 1
        else f"lost experts over {r['blocks']} blocks"
    )
    origins = r["origins"]
    timeline = [
        ("members agreed", r["members_s"], "through the launcher's store"),
        ("group re-formed", r["reform_s"], "a new default process group"),
        ("weights re-homed", r["rehome_s"], "placement, moves, experts read"),
        ("blocks rebuilt", r["rebuild_s"], "every MoE block, on the new group"),
        ("kill -> serving again", r["serving_again_s"],
         f"detection, recover() ({as_ms(r['recovery_s']).strip()})"),
        (f"step {step} run again", r["step_again_s"], "what it added to the KV cache undone first"),
        (f"kill -> step {step} done", r["kill_to_step_done_s"], ""),
    ]  # fmt: skip
    return [
        f"Recovery {index + 1}: survivors {rank_list(r['members'])} are ranks "
        f"{rank_list(range(len(r['members'])))} of generation {r['generation']} "
        f"({r['attempts']} attempt{'s' if r['attempts'] > 1 else ''})",
        "  step (slowest survivor)        ms",
        *(f"  {label:<25}{as_ms(seconds)}  {what}".rstrip() for label, seconds, what in timeline),
        f"  {experts}: {replicas} from replicas, {read} read from the source",
        f"  slots on the survivors: {origins.get('kept', 0)} kept, {origins.get('moved', 0)} "
        f"moved, {origins.get('source', 0)} read",
    ]


def elastic_verdict(elastic: dict, passed: bool, differ: str | None, error: str) -> str:
    """The verdict of an elastic run: the ranks lost (and in which steps, where it fits), then
    the survivors' tokens (``differ``: the ranks whose differ) or the problems; ``error``: the
    largest logits error, as text."""
    kills = elastic["kills"]
    ranks = [kill["rank"] for kill in kills]
    plural = "s" if len(ranks) > 1 else ""
    who = f"rank{plural} {rank_list(ranks)} lost"
    steps = f"{who} at step{plural} {', '.join(str(kill['step']) for kill in kills)}"
    if passed:
        outcome = f"survivors' tokens as transformers' (err {error})"
    elif elastic["problems"]:
        outcome = f"{len(elastic['problems'])} problem(s) above"
    elif differ:
        outcome = f"tokens differ on {differ}"
    else:
        outcome = f"logits rel err {error} beyond tolerance"
    word = "PASSED" if passed else "FAILED"
    line = f"{word}: {steps}; {outcome}"
    return line if len(line) <= WIDTH else f"{word}: {who}; {outcome}"
