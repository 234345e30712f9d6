"""Turn launcher reports (``python -m ep_runtime.launch ... --json``) into BENCHMARKS.md tables.

Usage: ``python -m ep_runtime.bench.summary REPORT.json|RUNS.jsonl ... [--jsonl MERGED.jsonl]``.
Each report becomes one row: dispatch and combine bandwidth (bytes received per rank, own tokens
included: DeepEP's definition, as the launcher measures it) as ratios to the same run's
``all_to_all_single`` floor and to the published anchors, expert TFLOP/s, layer time, tokens/s and
the overlap the layer achieved over its phases run one by one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Anchor:
    """A published bandwidth (GB/s, received bytes per rank) and the token count it was taken at
    (None: any)."""

    name: str
    dispatch_GBps: float
    combine_GBps: float
    tokens: int | None
    source: str


ANCHORS = (
    Anchor(
        "NVLink4 eff.",
        370.0,
        370.0,
        None,
        "NCCL effective NVLink4 per direction (sjeaugey, NVIDIA/nccl-tests#212)",
    ),
    Anchor(
        "UCCL-EP 8xH200",
        320.0,
        319.0,
        4096,
        "DeepEP-class intranode EP8 on 8xH200, 4096 tok, FP8 dispatch/BF16 combine "
        "(uccl-project/uccl ep/README.md)",
    ),
    Anchor(
        "NCCL-EP 8xH100",
        224.3,
        185.2,
        128,
        "NCCL EP low-latency EP8 on 8xH100, 128 tok, BF16 (NVIDIA/nccl contrib/nccl_ep/README.md)",
    ),
)


def load_reports(paths: Iterable[str]) -> list[dict]:
    """Reports from ``.json`` files (one report) and ``.jsonl`` files (one per line)."""
    reports = []
    for path in paths:
        text = Path(path).read_text()
        if path.endswith(".jsonl"):
            reports += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            reports.append(json.loads(text))
    return reports


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _rate_GBps(num_bytes: float, milliseconds: float) -> float:
    return num_bytes / (milliseconds * 1e-3) / 1e9 if milliseconds > 0 else 0.0


def summarize_case(report: dict, case: dict) -> dict:
    """One row's numbers from one report and one of its layouts."""
    recv_bytes = _mean([r["dispatch_received_bytes"] for r in report["per_rank"]])
    phases = {name: stats["median_ms"] for name, stats in case["phases"].items()}
    baselines = {name: stats["median_ms"] for name, stats in report["baselines"].items()}
    world, tokens = report["world_size"], report["tokens_per_rank"]
    row = {
        "world": world,
        "tokens": tokens,
        "dispatcher": case["dispatcher"],
        "experts": case["experts"],
        "layout": case["layout"],
        "mode": report["mode"],
        "device": report["device"],
        "passed": case["passed"],
        "recv_MB": recv_bytes / 1e6,
        "phases_ms": phases,
        "layer_tokens_per_s": world * tokens / (phases["layer"] * 1e-3) if phases["layer"] else 0,
        "overlap": 1 - phases["layer"] / sum(phases[p] for p in ("dispatch", "experts", "combine")),
        "experts_TFLOPs": case["rates"]["experts_TFLOPs"],
    }
    for phase, baseline in (("dispatch", "a2a_dispatch"), ("combine", "a2a_combine")):
        rate = _rate_GBps(recv_bytes, phases[phase])
        floor = _rate_GBps(recv_bytes, baselines.get(baseline, 0.0))
        row[f"{phase}_GBps"] = rate
        row[f"{phase}_floor_GBps"] = floor
        row[f"{phase}_vs_floor"] = rate / floor if floor else None
        for anchor in ANCHORS:
            if anchor.tokens in (None, tokens):
                reference = getattr(anchor, f"{phase}_GBps")
                row[f"{phase}_vs {anchor.name}"] = rate / reference
                row[f"{phase}_floor_vs {anchor.name}"] = floor / reference
    return row


def _fmt(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def _anchor_cells(row: dict, prefix: str) -> str:
    cells = [
        f"{anchor.name} {_fmt(row[key], 2)}"
        for anchor in ANCHORS
        if (key := f"{prefix}_vs {anchor.name}") in row
    ]
    return "; ".join(cells)


def markdown(rows: list[dict]) -> str:
    """The tables: communication (ours vs floor vs anchors), then the layer."""
    lines = [
        "Bandwidth = bytes received per rank, own tokens included (DeepEP's definition), hidden "
        "payload of valid rows, over the phase's median time (max over ranks per iteration). "
        "Floor = plain `all_to_all_single` of the same rows in the same run. Ratios > 1 beat the "
        "reference. Anchors: "
        + "; ".join(
            f"{a.name} {a.dispatch_GBps:g}/{a.combine_GBps:g} GB/s ({a.source})" for a in ANCHORS
        )
        + ".",
        "",
        "| EP | tok/rank | dispatcher | mode | layout | ok | recv MB | dispatch ms | GB/s "
        "| floor GB/s | vs floor | vs anchors | combine ms | GB/s | floor GB/s | vs floor "
        "| vs anchors | floor vs anchors (dispatch) |",
        "|" + "---|" * 18,
    ]
    ordered = sorted(rows, key=lambda r: (r["world"], r["tokens"], r["dispatcher"], r["mode"]))
    for row in ordered:
        p = row["phases_ms"]
        lines.append(
            f"| {row['world']} | {row['tokens']} | {row['dispatcher']} | {row['mode']} "
            f"| {row['layout']} | {'yes' if row['passed'] else '**NO**'} | {_fmt(row['recv_MB'])} "
            f"| {p['dispatch']:.3f} | {_fmt(row['dispatch_GBps'])} "
            f"| {_fmt(row['dispatch_floor_GBps'])} | {_fmt(row['dispatch_vs_floor'], 2)} "
            f"| {_anchor_cells(row, 'dispatch')} "
            f"| {p['combine']:.3f} | {_fmt(row['combine_GBps'])} "
            f"| {_fmt(row['combine_floor_GBps'])} | {_fmt(row['combine_vs_floor'], 2)} "
            f"| {_anchor_cells(row, 'combine')} "
            f"| {_anchor_cells(row, 'dispatch_floor')} |"
        )
    lines += [
        "",
        "Layer: phases timed one by one, then the whole layer; tokens/s = EP x tokens per rank / "
        "layer time; overlap = 1 - layer / (dispatch + experts + combine) (0: none; the layer is "
        "synchronous today, so a negative value is per-call overhead).",
        "",
        "| EP | tok/rank | dispatcher | experts | mode | layout | ok | dispatch ms | experts ms "
        "| expert TFLOP/s | combine ms | layer ms | tokens/s | overlap |",
        "|" + "---|" * 14,
    ]
    for row in ordered:
        p = row["phases_ms"]
        lines.append(
            f"| {row['world']} | {row['tokens']} | {row['dispatcher']} | {row['experts']} "
            f"| {row['mode']} | {row['layout']} | {'yes' if row['passed'] else '**NO**'} "
            f"| {p['dispatch']:.3f} | {p['experts']:.3f} | {_fmt(row['experts_TFLOPs'])} "
            f"| {p['combine']:.3f} | {p['layer']:.3f} | {row['layer_tokens_per_s']:.4g} "
            f"| {row['overlap']:+.2f} |"
        )
    devices = sorted({row["device"] for row in rows})
    if devices != ["cuda"]:
        lines += ["", f"Note: devices {devices}: CPU numbers rehearse the format only."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.summary", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("reports", nargs="+", help="launcher --json files, or .jsonl files")
    parser.add_argument("--jsonl", help="also write every report, one per line, to this file")
    args = parser.parse_args(argv)
    reports = load_reports(args.reports)
    failed = [r for r in reports if "cases" not in r]  # a run that ended early: error only
    rows = [summarize_case(r, case) for r in reports if "cases" in r for case in r["cases"]]
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(r) + "\n" for r in reports))
    sys.stdout.write(markdown(rows) if rows else "No completed runs.\n")
    for report in failed:
        sys.stdout.write(
            f"\nFAILED run (W={report.get('world_size')}): {report.get('error', '?')}\n"
        )
    return 0 if rows and not failed and all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
