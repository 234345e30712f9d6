"""The launcher's report as a reader sees it: tables that fit 80 columns without cutting a value,
one validation table per layout that names it, the legend (``layer_floor`` explained), and a plot
whose labels do not overlap. Built from hand-made rank summaries, so every value is known."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from rich.console import Console

from ep_runtime.bench.report import build_report, print_report

REPO = Path(__file__).resolve().parents[1]
PHASES = ("dispatch", "experts", "combine", "layer")


def _stats(median_s: float) -> dict:
    return {"median_s": median_s, "min_s": median_s / 2, "max_s": median_s * 2, "iterations": 3}


def _summary(rank: int, world: int, layouts: list[str], host: str, failing: set) -> dict:
    """What ``RankWorker.summarize`` returns, with round numbers; ``failing`` holds the
    (rank, layout) pairs whose validation failed."""
    experts = 16 // world
    local_counts = [10 + rank] * experts
    cases = []
    for index, layout in enumerate(layouts):
        failed = (rank, layout) in failing
        cases.append(
            {
                "requested_layout": layout,
                "dispatcher": "torch_a2a",
                "experts": "grouped_mm",
                "layout": layout,
                "refused": {},
                "choice": "torch_a2a + grouped_mm",
                "phases": {p: _stats(0.001 * (i + 1 + index)) for i, p in enumerate(PHASES)},
                "validation": {
                    "passed": not failed,
                    "max_abs_err": 1e-6 * (rank + 1),
                    "max_rel_err": 0.5 if failed else 1.25e-7 * (rank + 1) * (index + 1),
                    "tolerance": 8.0e-6,
                    "validated_tokens": 64,
                    "finite": True,
                    "deterministic": True,
                    "experts_regenerated": 5,
                    "verdict": "",
                },
            }
        )
    return {
        "rank": rank,
        "host": host,
        "pid": 1000 + rank,
        "node_ip": None,
        "interfaces": {},
        "device": "cpu",
        "tokens": 64,
        "dtype": "float32",
        "received_rows": 100 + rank,
        "dispatch_received_bytes": 51_200 * (rank + 1),
        "combine_bytes": 51_200,
        "valid_pairs": sum(local_counts),
        "expert_flops": 1_000_000,
        "local_experts": [rank * experts, (rank + 1) * experts],
        "local_expert_counts": local_counts,
        "expert_imbalance": 1.0,
        "expert_weight_bytes": 3_100_000,
        "peak_memory_bytes": 267_000_000,
        "cases": cases,
        "global_expert_counts": [10 + e // experts for e in range(16)],
        "traffic_rows": [[1] * world for _ in range(world)],
        "baselines": {
            name: _stats(0.0005) for name in ("a2a_dispatch", "a2a_combine", "dense_gemm")
        },
    }


def _report(world: int = 4, layouts=("standard",), host: str = "vm", failing=frozenset()):
    spec = {
        "device": "cpu",
        "mode": "exact",
        "model": {
            "name": "tiny",
            "num_experts": 16,
            "top_k": 4,
            "hidden_size": 128,
            "intermediate_size": 256,
            "activation": "silu",
            "tokens_per_rank": 64,
        },
    }
    ranks = [_summary(r, world, list(layouts), host, set(failing)) for r in range(world)]
    return build_report(spec, "spawn", ranks, 1.0)


def _render(report: dict, width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    print_report(report, console)
    return console.export_text()


def _table_rows(text: str, title_start: str) -> list[list[str]]:
    """Rows (split on blanks) of the table whose title starts with ``title_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title_start))
    rows, seen_rule = [], False
    for line in lines[start + 1 :]:
        if set(line.strip()) == {"─"}:
            seen_rule = True
            continue
        if seen_rule:
            if not line.strip():
                break
            rows.append(line.split())
    return rows


@pytest.mark.parametrize("host", ["vm", "ip-10-213-0-12.cluster.internal"])
def test_tables_fit_80_columns_and_keep_every_value(host):
    report = _report(host=host)
    text = _render(report, 80)
    assert max(len(line) for line in text.splitlines() if "─" in line) <= 80
    assert "…" not in text  # nothing cut
    rows = _table_rows(text, "Validation, torch_a2a / grouped_mm, layout standard")
    assert [row[0] for row in rows if row[0].isdigit()] == ["0", "1", "2", "3"]
    for rank in range(4):
        row = next(r for r in rows if r[0] == str(rank))
        assert f"{1.25e-7 * (rank + 1):.1e}" in row  # rel err, in full
        assert row[-1] == "ok"  # status, in full
    traffic = _table_rows(text, "Ranks: traffic and memory")
    hosts: list[str] = []  # a long host name is folded over lines (one word each), never cut
    for row in traffic:
        if row[0].isdigit():
            assert row[-2:] == ["3.1", "267"]  # weights MB, peak MB: the last columns, in full
            hosts.append(row[1])
        else:
            hosts[-1] += row[0]
    assert hosts == [host] * 4


def test_both_layouts_get_their_own_validation_table_naming_the_layout():
    report = _report(layouts=("standard", "expanded"), failing={(2, "expanded")})
    text = _render(report, 80)
    standard = _table_rows(text, "Validation, torch_a2a / grouped_mm, layout standard")
    expanded = _table_rows(text, "Validation, torch_a2a / grouped_mm, layout expanded")
    status = {layout: {r[0]: r[-1] for r in rows if r[0].isdigit()}
              for layout, rows in (("standard", standard), ("expanded", expanded))}  # fmt: skip
    assert status["standard"] == {"0": "ok", "1": "ok", "2": "ok", "3": "ok"}
    assert status["expanded"] == {"0": "ok", "1": "ok", "2": "FAIL", "3": "ok"}
    assert text.count("Phases, torch_a2a / grouped_mm, layout") == 2
    assert not report["passed"]


def test_legend_and_readme_explain_layer_floor():
    text = _render(_report(), 80)
    legend = " ".join(text.split())
    assert "layer_floor = a2a_dispatch + dense_gemm + a2a_combine" in legend
    readme = " ".join((REPO / "README.md").read_text().split())
    launcher_section = readme[readme.index("## The launcher") : readme.index("## Backends")]
    assert "layer_floor" in launcher_section and "a2a_dispatch + dense_gemm" in launcher_section
    # the sum the legend states is the number reported: three baselines of 0.5 ms each
    assert _report()["baselines"]["layer_floor"]["median_ms"] == pytest.approx(1.5)


def test_plot_labels_do_not_overlap():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ep_runtime.bench.report import plot_figure

    figure = plot_figure(_report(world=8, layouts=("standard", "expanded")))
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        for axes in figure.axes:
            for ticks in (axes.get_xticklabels(), axes.get_yticklabels()):
                boxes = [t.get_window_extent(renderer) for t in ticks if t.get_text()]
                for first, second in itertools.combinations(boxes, 2):
                    assert not first.overlaps(second), (first, second)
        labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
        assert "dispatch (standard)" in labels and "dispatch (expanded)" in labels
    finally:
        plt.close(figure)
