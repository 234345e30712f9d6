"""The report of an elastic run (``--elastic``): which ranks were lost and when, each recovery's
timeline (the slowest survivor at each step), where the lost experts came from, the work lost,
the load balance before and after, and every survivor validated against ``reference_moe``.
Printed in lines of at most 80 columns (the verdict last) and written as JSON (``--json``).

The run passes only if every rank told to die did so at its iteration, every other rank
reported, each recovery's first forward and each survivor's final output matched the oracle,
and the survivors hold exactly the experts their placement names.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from ep_runtime.bench.report import write_json

if TYPE_CHECKING:
    from ep_runtime.launch.spec import RunOutcome, RunSpec

__all__ = ["build_report", "print_report", "write_json"]
WIDTH = 80  # columns of every printed line
STEPS = ("members_s", "reform_s", "rehome_s", "rebuild_s")  # a Recovery's, in order


def build_report(spec: RunSpec, kills: dict[int, int], outcome: RunOutcome) -> dict:
    """The report from the survivors' ``summarize()`` results (by original rank); ``kills``:
    the ranks the run was told to kill, and the iteration of each."""
    run = spec.to_json()
    survivors = sorted(outcome.summaries, key=lambda s: s["rank"])
    killed = {record["rank"]: record for s in survivors for record in s["kills"]}
    tokens = run["model"]["tokens_per_rank"]
    count = min((len(s["recoveries"]) for s in survivors), default=0)
    recoveries = [_recovery(index, survivors, killed) for index in range(count)]
    first = survivors[0] if survivors else {}
    return {
        "passed": not (problems := _problems(spec.world_size, kills, killed, survivors)),
        "problems": problems,
        "launcher": outcome.launcher,
        "elapsed_s": outcome.elapsed_s,
        **run,
        "tokens_per_rank": tokens,
        "dtype": first.get("dtype"),
        "choice": first.get("choice"),
        "survivors": [s["rank"] for s in survivors],
        "lost_ranks": sorted(kills),
        "killed": [killed[rank] for rank in sorted(killed)],
        "recoveries": recoveries,
        "lost_work": _lost_work(survivors, kills, spec.world_size, run["iters"], tokens),
        "load": {
            "before_measured": first.get("load_before"),
            "before_predicted": recoveries[0]["before_predicted"] if recoveries else None,
            "after_predicted": recoveries[-1]["after_predicted"] if recoveries else None,
            "after_measured": first.get("load_after"),
        },
        "forward_ms": _slowest(survivors, lambda s: s["forward_ms"]),
        "per_rank": survivors,
    }


def kill_problems(
    world_size: int,
    kills: dict[int, int],
    killed: dict[int, dict],
    survivors: Sequence[dict],
    unit: str,
) -> list[str]:
    """What every elastic report checks first: each rank told to die recorded its kill at its
    ``unit`` (``"iteration"``, ``"step"``), and every other rank reported."""
    problems = []
    for rank, at in sorted(kills.items()):
        record = killed.get(rank)
        if record is None:
            problems.append(f"rank {rank} did not record its kill (told: {unit} {at})")
        elif record[unit] != at:
            problems.append(f"rank {rank} died in {unit} {record[unit]}, not {at}")
    expected = [rank for rank in range(world_size) if rank not in kills]
    reported = [s["rank"] for s in survivors]
    if reported != expected:
        problems.append(f"expected summaries from ranks {expected}, given {reported}")
    return problems


def _problems(
    world_size: int, kills: dict[int, int], killed: dict[int, dict], survivors: list[dict]
) -> list[str]:
    """Why the run did not pass: a kill not as told, a survivor missing or in another group,
    recoveries that do not account for the kills, a wrong output."""
    problems = kill_problems(world_size, kills, killed, survivors, "iteration")
    expected = [rank for rank in range(world_size) if rank not in kills]
    for s in survivors:
        lost = sorted(rank for recovery in s["recoveries"] for rank in recovery["lost"])
        if s["members"] != expected or lost != sorted(kills):
            problems.append(
                f"rank {s['rank']}: expected recoveries losing ranks {sorted(kills)} and a "
                f"group of {expected}, given {lost} and {s['members']}"
            )
        problems += [
            f"rank {s['rank']}: the first forward after recovery {index + 1} failed: "
            + recovery.get("first_forward", {"verdict": "none ran"})["verdict"]
            for index, recovery in enumerate(s["recoveries"])
            if not recovery.get("first_forward", {}).get("passed")
        ]
        validation = s["validation"]
        if not validation["passed"]:
            slots = "" if validation["slots_hold_their_experts"] else "; slots hold wrong weights"
            problems.append(f"rank {s['rank']}: {validation['verdict']}{slots}")
    return problems


def _slowest(survivors: Sequence[dict], values: Callable[[dict], dict]) -> dict:
    """Key by key, the largest value over the survivors."""
    keys = {key for s in survivors for key in values(s)}
    return {key: max(values(s)[key] for s in survivors if key in values(s)) for key in keys}


def _recovery(index: int, survivors: list[dict], killed: dict[int, dict]) -> dict:
    """Recovery ``index`` as every survivor timed it: each step's time is the slowest
    survivor's (the group serves again once its slowest member does). Its detection is the
    failed forward before it, ``index``-th on every survivor (each failed forward is followed
    by one recovery)."""
    mine = [s["recoveries"][index] for s in survivors]
    failed = [s["lost_forwards"][index] for s in survivors if len(s["lost_forwards"]) > index]
    first = mine[0]
    killed_at = min((killed[r]["at"] for r in first["lost"] if r in killed), default=None)
    since_kill = (lambda at: at - killed_at) if killed_at is not None else (lambda at: None)
    layer = first["layers"][0]
    forwards = [r.get("first_forward") for r in mine]
    served = all(f is not None for f in forwards)
    return {
        "generation": first["generation"],
        "lost": first["lost"],
        "members": first["members"],
        "attempts": max(r["attempts"] for r in mine),
        "failed_iteration": failed[0]["iteration"] if failed else None,
        "detect_s": since_kill(max(f["seen_at"] for f in failed)) if failed else None,
        **{key: max(r[key] for r in mine) for key in STEPS},
        "recovery_s": max(r["ended_at"] - r["started_at"] for r in mine),
        "first_forward_s": max(
            f["done_at"] - r["ended_at"] for f, r in zip(forwards, mine, strict=True)
        )
        if served
        else None,
        "first_forward_passed": served and all(f["passed"] for f in forwards),
        "kill_to_first_correct_s": since_kill(max(f["done_at"] for f in forwards))
        if served
        else None,
        "origins": layer["origins"],
        "from_replicas": layer["from_replicas"],
        "regenerated": layer["from_source"],
        "regenerated_by_rank": {
            s["rank"]: r["regenerated"]
            for s, r in zip(survivors, mine, strict=True)
            if r["regenerated"]
        },
        "before_predicted": _stats(layer["before"]),
        "after_predicted": _stats(layer["after"]),
        "lines": first["lines"],
    }


def _stats(stats: dict) -> dict:
    """A ``LoadStats`` as JSON with its busiest-rank ratio."""
    mean = stats["rank_mean"]
    return stats | {"rank_imbalance": stats["rank_max"] / mean if mean > 0 else 1.0}


def _lost_work(
    survivors: list[dict], kills: dict[int, int], world_size: int, iters: int, tokens: int
) -> dict:
    """The forwards that failed (as the survivors saw them; every rank alive then lost its
    tokens, the ones killed later too) and the iterations the killed ranks never ran, in
    tokens: listed, not hidden."""
    failed = sorted({forward["iteration"] for s in survivors for forward in s["lost_forwards"]})
    failed_forwards = []
    for iteration in failed:
        ranks = [r for r in range(world_size) if kills.get(r, iters) > iteration]
        failed_forwards.append(
            {
                "iteration": iteration,
                "ranks": ranks,
                "tokens_per_rank": tokens,
                "tokens": tokens * len(ranks),
            }
        )
    not_run = [
        {"rank": rank, "iterations": [it, iters], "tokens": (iters - it) * tokens}
        for rank, it in sorted(kills.items())
    ]
    total = sum(f["tokens"] for f in failed_forwards) + sum(n["tokens"] for n in not_run)
    return {"failed_forwards": failed_forwards, "not_run": not_run, "tokens": total}


# ----------------------------------------------------------------- printing
def as_ms(seconds: float | None) -> str:
    return "       -" if seconds is None else f"{seconds * 1e3:8.1f}"


def rank_list(ids: Sequence[int]) -> str:
    """Sorted ids with each run of three or more as ``first-last``: ``0, 1, 3-7``."""
    parts: list[str] = []
    run: list[int] = []
    for value in [*sorted(ids), None]:
        if value is not None and run and value == run[-1] + 1:
            run.append(value)
            continue
        if len(run) >= 3:
            parts.append(f"{run[0]}-{run[-1]}")
        else:
            parts += map(str, run)
        run = [] if value is None else [value]
    return ", ".join(parts)


def report_lines(report: dict) -> list[str]:
    """The printed report, every line at most 80 columns; the verdict last."""
    model = report["model"]
    lines = [
        f"Elastic EP: {model['name']} E={model['num_experts']} K={model['top_k']} "
        f"H={model['hidden_size']} I={model['intermediate_size']}, W={report['world_size']} "
        f"({report['launcher']}, {report['device']}, {report['dtype']})",
        f"  {report['iters']} iterations, T/rank={report['tokens_per_rank']}, routing "
        f"{report['routing']}, mode {report['mode']}",
        f"  {(report['choice'] or '').splitlines()[0] if report['choice'] else ''}",
    ]
    for record in report["killed"]:
        lines.append(f"Lost: rank {record['rank']}, SIGKILL as iteration {record['iteration']} "
                     "started")  # fmt: skip
    for index, r in enumerate(report["recoveries"]):
        lines += _recovery_lines(index, r)
    lines += _lost_work_lines(report["lost_work"])
    lines += _load_lines(report["load"])
    forward = ", ".join(
        f"{ms:.1f} ms at W={world}"
        for world, ms in sorted(report["forward_ms"].items(), key=lambda item: -int(item[0]))
    )
    if forward:
        lines.append(f"Forward (median, slowest rank): {forward}")
    lines.append("Survivors vs reference_moe (final output):")
    for s in report["per_rank"]:
        v = s["validation"]
        verdict = "ok" if v["passed"] else "FAIL"
        lines.append(
            f"  rank {s['rank']} -> {s['new_rank']}: max rel err {v['max_rel_err']:.1e} "
            f"(tol {v['tolerance']:.1e}), {v['validated_tokens']} tokens, {verdict}"
        )
    lines += [f"problem: {p}" for p in report["problems"]]
    lines.append(_verdict(report))
    return fitted(lines)


def _recovery_lines(index: int, r: dict) -> list[str]:
    origins = r["origins"]
    lost = r["from_replicas"] + r["regenerated"]
    lines = [
        f"Recovery {index + 1}: survivors {rank_list(r['members'])} are ranks "
        f"{rank_list(range(len(r['members'])))} of generation {r['generation']} "
        f"({r['attempts']} attempt{'s' if r['attempts'] > 1 else ''})",
        "  step (slowest survivor)        ms",
        f"  detected                 {as_ms(r['detect_s'])}  kill -> survivors' RemoteRankError",
        f"  members agreed           {as_ms(r['members_s'])}  through the launcher's store",
        f"  group re-formed          {as_ms(r['reform_s'])}  a new default process group",
        f"  weights re-homed         {as_ms(r['rehome_s'])}  placement, moves, regeneration",
        f"  layer rebuilt            {as_ms(r['rebuild_s'])}",
        f"  first forward            {as_ms(r['first_forward_s'])}  vs reference_moe: "
        f"{'ok' if r['first_forward_passed'] else 'FAIL'}",
        f"  kill -> first correct    {as_ms(r['kill_to_first_correct_s'])}  "
        f"recover() took {as_ms(r['recovery_s']).strip()}",
        f"  lost experts {rank_list(lost)}: {len(r['from_replicas'])} from replicas on "
        f"survivors, {len(r['regenerated'])} regenerated from the seed",
        f"  slots on the survivors: {origins['kept']} kept, {origins['moved']} moved, "
        f"{origins['source']} regenerated",
    ]
    return lines


def _lost_work_lines(lost: dict) -> list[str]:
    if not lost["tokens"]:
        return ["Lost work: none"]
    lines = [f"Lost work: {lost['tokens']} tokens"]
    for f in lost["failed_forwards"]:
        lines.append(
            f"  iteration {f['iteration']}: forward failed on ranks {rank_list(f['ranks'])} "
            f"({f['tokens_per_rank']} tokens each)"
        )
    for n in lost["not_run"]:
        first, end = n["iterations"]
        span = f"{first}-{end - 1}" if end - first > 1 else f"{first}"
        lines.append(f"  rank {n['rank']}: iterations {span} not run ({n['tokens']} tokens)")
    return lines


def _load_lines(load: dict) -> list[str]:
    """Busiest rank / mean rank: measured before the loss and after the last recovery, and
    what the recovery predicted from the load the survivors had counted."""
    lines = ["Expert load, busiest rank / mean rank:"]
    label = "before the loss"
    before = load["before_measured"]
    if before is not None:
        lines.append(f"  {label:<16} {_measured(before)}")
        label = ""
    if load["before_predicted"] is not None:
        imbalance = load["before_predicted"]["rank_imbalance"]
        lines.append(f"  {label:<16} {imbalance:.3f} predicted from the survivors' counts")
    after = load["after_measured"]
    if after is not None:
        predicted = load["after_predicted"]
        guess = f"{predicted['rank_imbalance']:.3f} predicted, " if predicted else ""
        label = "after recovery" if predicted else "no loss"
        lines.append(f"  {label:<16} {guess}{_measured(after)}")
    return lines


def _measured(load: dict) -> str:
    return (
        f"{load['rank_imbalance']:.3f} measured ({load['forwards']} forwards, "
        f"{load['world_size']} ranks)"
    )


def _verdict(report: dict) -> str:
    """One line: passed or not, the ranks lost, how soon the survivors served correctly."""
    lost = report["lost_ranks"]
    who = f"rank{'s' if len(lost) > 1 else ''} {rank_list(lost)} lost" if lost else "no rank lost"
    if not report["passed"]:
        return f"FAILED: {who}; {len(report['problems'])} problem(s) above"
    totals = [r["kill_to_first_correct_s"] for r in report["recoveries"]]
    again = f", correct {max(totals):.3f} s after the kill" if totals else ""
    return f"PASSED: {who}, {len(report['survivors'])} survivors validated{again}"


def print_report(report: dict, console: Console) -> None:
    for line in report_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def fitted(lines: list[str]) -> list[str]:
    """Lines longer than ``WIDTH`` folded at spaces, the rest indented (a long list of ids)."""
    return [
        part
        for line in lines
        for part in (
            textwrap.wrap(line, WIDTH, subsequent_indent="    ") if len(line) > WIDTH else [line]
        )
    ]
