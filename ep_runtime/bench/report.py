"""Turn per-rank results into one report: a dict (the ``--json`` file), rich tables, a plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ep_runtime.bench.metrics import imbalance

# the validation error, as ep_runtime/tolerance.py computes it; docs/launch.md and
# docs/architecture.md state the same formula (tests/launch/test_launch_report.py checks they do)
RELATIVE_ERROR = "‖out_t − ref_t‖ / Σ_k |w_k|·‖FFN_k(x_t)‖"
# printed under the tables and stored in the JSON report ("conventions")
CONVENTIONS = (
    "phase time = per-iteration max over ranks after a barrier (and device sync); median and min "
    "over the timed iterations, in ms",
    "bandwidth = bytes received per rank, own tokens included (DeepEP's definition), hidden "
    "payload of valid rows only, averaged over ranks, over the phase time",
    "expert FLOP/s counts valid (token, expert) pairs only, averaged over ranks",
    "baselines from the same run: a2a_dispatch / a2a_combine = one all_to_all_single of the same "
    "rows (the communication floor); the experts' baseline is their roofline, the larger of "
    "dense_gemm = two dense GEMMs of the same FLOPs (the compute floor) and weights_read = the "
    "bytes of the expert weights the phase reads (its experts with tokens) at the rate of a "
    "same-run memory copy (the memory floor: decode is bound by it); base/phase = baseline time "
    "/ phase time",
    "layer_floor = a2a_dispatch + experts' baseline + a2a_combine: the layer's time if each phase "
    "ran at its baseline's speed, one after the other (no routing, packing or metadata, no "
    "overlap); a reference point, not a bound; for the layer, base/phase = layer_floor / layer "
    "time",
    "max/mean = a rank's busiest expert over its mean expert load, in (token, expert) pairs",
    "recv rows / recv MB = the rows a rank receives in a dispatch (their hidden payload); pairs "
    "= its valid (token, expert) pairs; weights MB = its expert shard; peak MB = its peak memory "
    "before the baselines ran (CUDA: allocated; CPU: resident set)",
    f"rel err = max over the validated tokens of {RELATIVE_ERROR} against reference_moe (fp64; "
    "the size of the summed terms, so cancelling terms are judged fairly); ok = within the "
    "tolerance and the phase-timed forward's output equals the layer's bitwise",
)
GRAPH_CONVENTION = (
    "layer_graph = the layer replayed as a captured CUDA graph (capacity mode on CUDA)"
)
EXPERTS_FLOORS = ("dense_gemm", "weights_read")  # the experts' roofline: the larger of the two
LAYER_FLOOR = "layer_floor"


def _ms(stats: dict) -> dict:
    return {
        "median_ms": stats["median_s"] * 1e3,
        "min_ms": stats["min_s"] * 1e3,
        "max_ms": stats["max_s"] * 1e3,
        "iterations": stats["iterations"],
    }


def _rate(amount_per_rank: list[float], seconds: float, unit: float) -> float:
    """Mean over ranks of ``amount / seconds`` in ``unit``s (0 when not timed)."""
    if seconds <= 0 or not amount_per_rank:
        return 0.0
    return sum(amount_per_rank) / len(amount_per_rank) / seconds / unit


def build_report(spec: dict, launcher: str, ranks: list[dict], elapsed_s: float) -> dict:
    """The run's report from every rank's ``summarize()`` result (ordered by rank)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    first = ranks[0]
    world = len(ranks)
    recv_bytes = [r["dispatch_received_bytes"] for r in ranks]
    flops = [r["expert_flops"] for r in ranks]
    baselines = {name: _ms(stats) for name, stats in first["baselines"].items()}
    baseline_s = {name: stats["median_s"] for name, stats in first["baselines"].items()}
    floors = [name for name in EXPERTS_FLOORS if name in baseline_s]
    experts_floor = max(floors, key=baseline_s.__getitem__) if floors else None
    if experts_floor and all(name in baseline_s for name in ("a2a_dispatch", "a2a_combine")):
        parts = ("a2a_dispatch", experts_floor, "a2a_combine")
        baseline_s[LAYER_FLOOR] = sum(baseline_s[name] for name in parts)
        baselines[LAYER_FLOOR] = {"median_ms": baseline_s[LAYER_FLOOR] * 1e3, "parts": parts}
    cases = []
    for index, case in enumerate(first["cases"]):
        phases = case["phases"]
        seconds = {phase: stats["median_s"] for phase, stats in phases.items()}
        validations = [r["cases"][index]["validation"] for r in ranks]
        rates = {
            "dispatch_GBps": _rate(recv_bytes, seconds["dispatch"], 1e9),
            "combine_GBps": _rate(recv_bytes, seconds["combine"], 1e9),
            "experts_TFLOPs": _rate(flops, seconds["experts"], 1e12),
        }
        ratios = {}
        for phase, baseline in (
            ("dispatch", "a2a_dispatch"),
            ("combine", "a2a_combine"),
            ("experts", experts_floor),
            ("layer", LAYER_FLOOR),
            ("layer_graph", LAYER_FLOOR),
        ):
            if baseline in baseline_s and seconds.get(phase, 0) > 0:
                ratios[f"{phase}_vs_{baseline}"] = baseline_s[baseline] / seconds[phase]
        cases.append(
            {
                "dispatcher": case["dispatcher"],
                "experts": case["experts"],
                "layout": case["layout"],
                "requested_layout": case["requested_layout"],
                "choice": case["choice"],
                "refused": case["refused"],
                "phases": {phase: _ms(stats) for phase, stats in phases.items()},
                "rates": rates,
                "vs_baseline": ratios,
                "passed": all(v["passed"] for v in validations),
                "max_abs_err": max(v["max_abs_err"] for v in validations),
                "max_rel_err": max(v["max_rel_err"] for v in validations),
                **({"eplb": case["eplb"]} if "eplb" in case else {}),
            }
        )
    rank_loads = [r["valid_pairs"] for r in ranks]
    per_rank = []
    for r in ranks:
        validations = [case["validation"] for case in r["cases"]]
        per_rank.append(
            {
                key: r[key]
                for key in (
                    "rank",
                    "host",
                    "pid",
                    "node_ip",
                    "interfaces",
                    "device",
                    "tokens",
                    "received_rows",
                    "dispatch_received_bytes",
                    "combine_bytes",
                    "valid_pairs",
                    "expert_flops",
                    "local_experts",
                    "local_expert_counts",
                    "expert_imbalance",
                    "expert_weight_bytes",
                    "peak_memory_bytes",
                )
            }
            | {
                "passed": all(v["passed"] for v in validations),
                "max_abs_err": max(v["max_abs_err"] for v in validations),
                "max_rel_err": max(v["max_rel_err"] for v in validations),
                "validation": validations,
            }
        )
    notes = []
    if world == 1:
        notes.append("W = 1: dispatch/combine 'bandwidth' is a local memory copy, not a network")
    if spec.get("quantization"):
        notes.append(
            f"{spec['quantization']}: weights MB = e4m3 expert weights + fp32 block scales; "
            "recv MB counts the fp8 rows dispatch sends (e4m3 hidden, an fp32 scale per 128 "
            f"columns, ids, weights); combine and the a2a baselines move {first['dtype']} rows; "
            "rel err against the contract's quantized math, at the bf16 tolerance"
        )
    return {
        "passed": all(case["passed"] for case in cases),
        "world_size": world,
        "launcher": launcher,
        "device": spec["device"],
        "dtype": first["dtype"],
        "quantization": spec.get("quantization"),
        "model": spec["model"],
        "mode": spec["mode"],
        "tokens_per_rank": spec["model"]["tokens_per_rank"],
        "dispatcher": cases[0]["dispatcher"],
        "experts": cases[0]["experts"],
        "layout": "+".join(case["layout"] for case in cases),
        "max_abs_err": max(case["max_abs_err"] for case in cases),
        "max_rel_err": max(case["max_rel_err"] for case in cases),
        "tolerance": ranks[0]["cases"][0]["validation"]["tolerance"],
        "phases": cases[0]["phases"],
        "cases": cases,
        "baselines": baselines,
        "experts_baseline": experts_floor,
        "load": {
            "global_expert_counts": first["global_expert_counts"],
            "rank_valid_pairs": rank_loads,
            "rank_imbalance": imbalance(rank_loads),
            "expert_imbalance_per_rank": [r["expert_imbalance"] for r in ranks],
            "traffic_rows": first["traffic_rows"],
        },
        "per_rank": per_rank,
        "spec": spec,
        "conventions": list(CONVENTIONS),
        "notes": notes,
        "elapsed_s": elapsed_s,
    }


REPORT_WIDTH = 80  # every table fits it, in a terminal and piped (a log, ray job logs)


def _table(title: str, columns: dict[str, str]) -> Table:
    """A compact table (``columns`` maps header -> justify): two spaces between columns, no
    edges. Cells never wrap or lose characters; a ``host`` column folds instead when the table
    would be wider than ``REPORT_WIDTH``."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )
    for header, justify in columns.items():
        if header == "host":
            table.add_column(header, justify=justify, overflow="fold")
        else:
            table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    return table


def print_table(table: Table, console: Console) -> None:
    """``table`` at most ``REPORT_WIDTH`` wide whatever the console's width (piped output is
    wider, for the prose), then a blank line."""
    console.print(table, width=min(console.width, REPORT_WIDTH))
    console.print()


def ms_text(ms: float) -> str:
    """A time in ms to four significant digits, at most 5 characters below 100 s: ``0.012``,
    ``95.86``, ``992.2``, ``12346``."""
    for limit, digits in ((10, 3), (100, 2), (1000, 1)):
        if round(ms, digits) < limit:
            return f"{ms:.{digits}f}"
    return f"{ms:.0f}"


def verdict_line(report: dict) -> str:
    """The report's last line: PASSED or FAILED, the layer's median time per forward (per
    layout where there are several) and the largest validation error against its tolerance;
    within ``REPORT_WIDTH`` for times below 100 s."""
    cases = report["cases"]
    times = [ms_text(case["phases"]["layer"]["median_ms"]) for case in cases]
    if len(cases) == 1:
        layer = f"layer {times[0]} ms per forward"
    else:  # "layer standard 4.000, expanded 5.000 ms"
        per_layout = (f"{case['layout']} {time}" for case, time in zip(cases, times, strict=True))
        layer = f"layer {', '.join(per_layout)} ms"
    word = "PASSED" if report["passed"] else "FAILED"
    return f"{word}: {layer}, rel err {report['max_rel_err']:.1e} (tol {report['tolerance']:.1e})"


def print_verdict(line: str, passed: bool, console: Console) -> None:
    """``line`` (from ``verdict_line``) as the report's last line, its first word coloured."""
    word, rest = line.split(":", 1)
    colour = "green" if passed else "red"
    console.print(f"[bold {colour}]{word}[/]:{escape(rest)}", highlight=False)


def print_report(report: dict, console: Console) -> None:
    """The run in one line; per layout a phase table and a validation table; one
    traffic-and-memory table (the same for every layout); the backends not chosen, the legend;
    last, the verdict (``verdict_line``), so that it is on screen when the run ends."""
    model = report["model"]
    console.print(
        f"{model['name']} E={model['num_experts']} K={model['top_k']} "
        f"H={model['hidden_size']} I={model['intermediate_size']} {model['activation']}  "
        f"W={report['world_size']} ({report['launcher']}, {report['device']}, {report['dtype']}, "
        f"{report['mode']})  T/rank={report['tokens_per_rank']}",
        highlight=False,
    )
    baselines = report["baselines"]
    experts_floor = report["experts_baseline"]
    for index, case in enumerate(report["cases"]):
        backends = f"{case['dispatcher']} / {case['experts']}, layout {case['layout']}"
        phases = _table(
            f"Phases, {backends} (ms)",
            {"phase": "left", "median": "right", "min": "right", "rate": "right",
             "baseline": "left", "base": "right", "base/phase": "right"},
        )  # fmt: skip
        rates = case["rates"]
        rows = (
            ("dispatch", si_rate(rates["dispatch_GBps"] * 1e9, "B/s"), "a2a_dispatch"),
            ("experts", si_rate(rates["experts_TFLOPs"] * 1e12, "FLOP/s"), experts_floor),
            ("combine", si_rate(rates["combine_GBps"] * 1e9, "B/s"), "a2a_combine"),
            ("layer", "", LAYER_FLOOR),
            *((("layer_graph", "", LAYER_FLOOR),) if "layer_graph" in case["phases"] else ()),
        )
        for phase, rate, baseline in rows:
            stats = case["phases"][phase]
            base = baselines.get(baseline) if baseline else None
            ratio = case["vs_baseline"].get(f"{phase}_vs_{baseline}")
            phases.add_row(
                phase,
                ms_text(stats["median_ms"]),
                ms_text(stats["min_ms"]),
                rate,
                baseline if base else "",
                ms_text(base["median_ms"]) if base else "",
                f"{ratio:.2f}" if ratio is not None else "",
            )
        print_table(phases, console)
        validation = _table(
            f"Validation, {backends}",
            {"rank": "right", "host": "left", "tokens": "right", "max abs err": "right",
             "rel err": "right", "tolerance": "right", "status": "left"},
        )  # fmt: skip
        for r in report["per_rank"]:
            result = r["validation"][index]
            validation.add_row(
                str(r["rank"]),
                r["host"],
                str(result["validated_tokens"]),
                f"{result['max_abs_err']:.1e}",
                f"{result['max_rel_err']:.1e}",
                f"{result['tolerance']:.1e}",
                "[green]ok[/]" if result["passed"] else "[red]FAIL[/]",
            )
        print_table(validation, console)
        balancing = case.get("eplb", {}).get("lines", ())  # expert load balancing
        for line in balancing:
            console.print(line, markup=False, highlight=False)
        if balancing:
            console.print()
    ranks = _table(
        "Ranks: traffic and memory (the same for every layout)",
        {"rank": "right", "host": "left", "recv rows": "right", "recv MB": "right",
         "pairs": "right", "max/mean": "right", "weights MB": "right", "peak MB": "right"},
    )  # fmt: skip
    for r in report["per_rank"]:
        ranks.add_row(
            str(r["rank"]),
            r["host"],
            str(r["received_rows"]),
            f"{r['dispatch_received_bytes'] / 1e6:.2f}",
            str(r["valid_pairs"]),
            f"{r['expert_imbalance']:.2f}",
            f"{r['expert_weight_bytes'] / 1e6:.1f}",
            f"{r['peak_memory_bytes'] / 1e6:.0f}",
        )
    print_table(ranks, console)
    load = report["load"]
    console.print(
        f"load: rank imbalance (max/mean valid pairs over ranks) {load['rank_imbalance']:.2f}"
    )
    _print_passed_over(report["cases"], console)
    graphs = any("layer_graph" in case["phases"] for case in report["cases"])
    for line in (*CONVENTIONS, *((GRAPH_CONVENTION,) if graphs else ())):
        console.print(f"[dim]{line}[/]", highlight=False)
    for note in report["notes"]:
        console.print(f"note: {note}")
    print_verdict(verdict_line(report), report["passed"], console)


def _print_passed_over(cases: list[dict], console: Console) -> None:
    """Why "auto" passed over or refused the other backends: once, under a heading (per layout
    only where the layouts' reasons differ)."""
    reasons = {case["layout"]: case["choice"].splitlines()[1:] for case in cases}
    groups = (
        {"": next(iter(reasons.values()))}
        if len({tuple(lines) for lines in reasons.values()}) == 1
        else {f", layout {layout}": lines for layout, lines in reasons.items()}
    )
    for suffix, lines in groups.items():
        if lines:
            console.print(f"Backends not chosen{suffix}:", highlight=False)
        for line in lines:
            console.print(f"[dim]  {line.strip()}[/]", highlight=False)


def si_rate(value: float, unit: str) -> str:
    """Three significant digits and an SI prefix: ``5.08e6, "B/s"`` -> ``"5.08 MB/s"``."""
    rounded = float(f"{value:.3g}")
    prefix, scale = next(
        ((p, f) for p, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if rounded >= f),
        ("", 1.0),
    )
    scaled = rounded / scale
    digits = max(0, 2 - math.floor(math.log10(scaled))) if scaled > 0 else 2
    return f"{scaled:.{digits}f} {prefix}{unit}"


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def write_plot(report: dict, path: str | Path) -> None:
    """PNG of ``plot_figure``."""
    import matplotlib.pyplot as plt

    fig = plot_figure(report)
    fig.savefig(path, dpi=100)
    plt.close(fig)


LAYOUT_COLOURS = {"standard": "tab:blue", "expanded": "tab:orange"}
BASELINE_COLOUR = "tab:gray"
MAX_LABELLED_EXPERTS = 32  # per-expert counts written on the bars up to this many experts
BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.12)}  # a legend under its axes


def plot_figure(report: dict):  # -> matplotlib.figure.Figure (matplotlib is optional)
    """Phase medians per layout (a colour per layout) next to the baselines, and tokens per
    expert coloured by owning rank; values on the bars; the title names the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels, values, colors = [], [], []
    for case in report["cases"]:
        for phase in ("dispatch", "experts", "combine", "layer"):
            labels.append(f"{phase} ({case['layout']})")
            values.append(case["phases"][phase]["median_ms"])
            colors.append(LAYOUT_COLOURS.get(case["layout"], "tab:green"))
    for name, stats in report["baselines"].items():
        labels.append(f"{name} (baseline)")
        values.append(stats["median_ms"])
        colors.append(BASELINE_COLOUR)
    # horizontal bars: one label per line, so labels cannot run into each other
    fig, (ax_time, ax_load) = plt.subplots(
        1, 2, figsize=(13, max(4.5, 0.3 * len(values) + 2)), width_ratios=(1, 1.3)
    )
    model = report["model"]
    fig.suptitle(
        f"{model['name']} (E={model['num_experts']} K={model['top_k']} H={model['hidden_size']} "
        f"I={model['intermediate_size']}), W={report['world_size']}, {report['mode']} mode, "
        f"{report['device']}, {report['dtype']}, T/rank={report['tokens_per_rank']}",
        fontsize=11,
    )
    bars = ax_time.barh(range(len(values)), values, color=colors)
    ax_time.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
    ax_time.set_xlim(0, max(values, default=1.0) * 1.2)  # room for the values
    ax_time.set_yticks(range(len(values)), labels, fontsize=8)
    ax_time.invert_yaxis()  # first phase on top
    ax_time.set_xlabel("ms (median of per-iteration max over ranks)")
    ax_time.set_title(f"phases: {report['dispatcher']} / {report['experts']}", fontsize=10)
    layouts = dict.fromkeys(case["layout"] for case in report["cases"])
    ax_time.legend(
        handles=[
            *(Patch(color=LAYOUT_COLOURS.get(lay, "tab:green"), label=lay) for lay in layouts),
            Patch(color=BASELINE_COLOUR, label="same-run baseline"),
        ],
        fontsize=8,
        ncol=len(layouts) + 1,
        **BELOW,
    )
    counts = report["load"]["global_expert_counts"]
    world = report["world_size"]
    per_rank = len(counts) // world
    palette = plt.get_cmap("tab10")
    bars = ax_load.bar(
        range(len(counts)),
        counts,
        color=[palette((e // per_rank) % 10) for e in range(len(counts))],
    )
    if len(counts) <= MAX_LABELLED_EXPERTS:
        ax_load.bar_label(bars, fontsize=7, padding=1)
    ax_load.set_ylim(0, max(counts, default=1) * 1.15)
    ax_load.set_xlabel("expert")
    ax_load.set_ylabel("(token, expert) pairs")
    ax_load.set_title(
        f"load per expert, colour = owning rank; rank max/mean = "
        f"{report['load']['rank_imbalance']:.2f}",
        fontsize=10,
    )
    ax_load.legend(
        handles=[Patch(color=palette(r % 10), label=f"rank {r}") for r in range(world)],
        fontsize=8,
        ncol=min(world, 8),
        **BELOW,
    )
    fig.tight_layout()
    return fig
