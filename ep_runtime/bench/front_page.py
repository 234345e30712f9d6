"""The front page's figures from one results file, so README.md, BENCHMARKS.md and the figure
cannot disagree: ``python -m ep_runtime.bench.front_page --check`` (exit 1 naming each
difference) or ``--write`` (renders them).

From ``docs/figures/front_page.json`` it renders README.md's "Measured" table, BENCHMARKS.md's
"Current figures" tables (one per question, each row with its machine, date and a link to the
session of the log it comes from) and ``docs/figures/decode_vs_hbm_floor.png``. Each rendered
table sits between two HTML comments in its file; the PNG carries a digest of the data it was
drawn from. A number lives once in the JSON: README cells quote the BENCHMARKS cells by
``{cell:question/row/column}``, and ``{run:ID}`` becomes a link to that run's session.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ep_runtime.types import EPInputError

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("docs/figures/front_page.json")
README_REGION = "measured"
BENCHMARKS_REGION = "current-figures"
TEMPLATE = re.compile(r"\{(cell|run):([^}]+)\}")


@dataclass(frozen=True)
class Run:
    """One measurement: where the log records it, on what, when and by which command."""

    label: str
    machine: str
    date: str
    command: str
    session: str | None = None  # a "## " heading of BENCHMARKS.md's session log
    link: str | None = None  # a repository-relative link where no session records it


@dataclass(frozen=True)
class Row:
    """A row of a question's table; ``ratios`` lists (numerator, denominator, ratio) columns."""

    key: str
    run: str
    cells: dict[str, str]
    ratios: tuple[tuple[str, str | None, str], ...] = ()


@dataclass(frozen=True)
class Question:
    """One "Current figures" table."""

    id: str
    title: str
    short: str
    about: str
    columns: tuple[tuple[str, str], ...]  # (key, header)
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class ReadmeRow:
    """A row of README.md's Measured table; ``row`` is ``question/row`` (machine, date, link)."""

    what: str
    figure: str
    row: str


@dataclass(frozen=True)
class Panel:
    """One model's decode sweep: times per forward at each token count."""

    name: str
    layer_ms: tuple[float, ...]
    gemms_ms: tuple[float, ...]
    floor_ms: tuple[float, ...]


@dataclass(frozen=True)
class Figure:
    """The front page's one figure."""

    path: str
    run: str
    title: str
    caption: str
    tokens: tuple[int, ...]
    panels: tuple[Panel, ...]
    digest: str  # of the JSON it was read from, stored in the PNG


@dataclass(frozen=True)
class Results:
    """The whole results file."""

    about: str
    runs: dict[str, Run]
    questions: tuple[Question, ...]
    readme: tuple[ReadmeRow, ...]
    figure: Figure


def load_results(path: Path) -> Results:
    """Read the results file.

    Parameters
    ----------
    path : Path
        The JSON file (``docs/figures/front_page.json``).

    Returns
    -------
    Results
        Its runs, questions, README rows and figure data.

    Raises
    ------
    EPInputError
        Where the file is missing or a field is absent, naming the field.
    """
    if not path.is_file():
        raise EPInputError("results", "an existing JSON file", str(path))
    data = json.loads(path.read_text())
    try:
        runs = {name: Run(**fields) for name, fields in data["runs"].items()}
        questions = tuple(
            Question(
                id=q["id"],
                title=q["title"],
                short=q["short"],
                about=q["about"],
                columns=tuple((key, header) for key, header in q["columns"]),
                rows=tuple(
                    Row(
                        r["key"], r["run"], dict(r["cells"]), tuple(map(tuple, r.get("ratios", [])))
                    )
                    for r in q["rows"]
                ),
            )
            for q in data["questions"]
        )
        readme = tuple(ReadmeRow(**row) for row in data["readme"])
        fig = data["figure"]
        panels = tuple(
            Panel(p["name"], tuple(p["layer_ms"]), tuple(p["gemms_ms"]), tuple(p["floor_ms"]))
            for p in fig["panels"]
        )
        drawn = {"figure": fig, "run": data["runs"][fig["run"]]}  # all the figure shows
        digest = hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()[:16]
        figure = Figure(
            fig["path"],
            fig["run"],
            fig["title"],
            fig["caption"],
            tuple(fig["tokens"]),
            panels,
            digest,
        )
        return Results(data["about"], runs, questions, readme, figure)
    except (KeyError, TypeError) as error:
        raise EPInputError(f"{path.name} field", "the fields front_page.py reads", error) from None


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens.

    Parameters
    ----------
    heading : str
        The heading's text, without the leading ``#``.

    Returns
    -------
    str
        The fragment GitHub links it by (without ``#``; a repeated heading adds ``-1``, ... which
        this does not).
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _run_link(results: Results, name: str) -> str:
    """``[label](#session-anchor)`` (from BENCHMARKS.md), or ``[label](link)`` without a session."""
    run = results.runs[name]
    return f"[{run.label}]({'#' + anchor(run.session) if run.session else run.link})"


def _question(results: Results, question_id: str) -> Question:
    for question in results.questions:
        if question.id == question_id:
            return question
    raise EPInputError("question", f"one of {[q.id for q in results.questions]}", question_id)


def _row(results: Results, ref: str) -> Row:
    question_id, _, key = ref.partition("/")
    for row in _question(results, question_id).rows:
        if row.key == key:
            return row
    raise EPInputError("row", "'question/row' naming a row of the results file", ref)


def _cell(results: Results, ref: str) -> str:
    row_ref, _, column = ref.rpartition("/")
    cells = _row(results, row_ref).cells
    if column not in cells:
        raise EPInputError("cell", f"one of {sorted(cells)} after {row_ref}/", column)
    return cells[column]


def _fill(results: Results, text: str) -> str:
    """``{cell:question/row/column}`` → that cell, ``{run:ID}`` → the run's link."""

    def one(match: re.Match) -> str:
        kind, ref = match.groups()
        return _cell(results, ref) if kind == "cell" else _run_link(results, ref)

    return TEMPLATE.sub(one, text)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _commands(results: Results, question: Question) -> str:
    """The commands of a question's runs (rows' and cells' ``{run:ID}``), one per command."""
    names = dict.fromkeys(row.run for row in question.rows)
    for row in question.rows:
        for value in row.cells.values():
            names.update(
                dict.fromkeys(ref for kind, ref in TEMPLATE.findall(value) if kind == "run")
            )
    by_command: dict[str, list[str]] = {}
    for name in names:
        by_command.setdefault(results.runs[name].command, []).append(results.runs[name].label)
    return "; ".join(f"{' and '.join(labels)}: `{cmd}`" for cmd, labels in by_command.items())


def render_benchmarks(results: Results) -> str:
    """BENCHMARKS.md's "Current figures": per question a heading, its setting, its table (each
    row with machine, date and a link to its run) and the commands.

    Parameters
    ----------
    results : Results
        The results file.

    Returns
    -------
    str
        The text between the ``current-figures`` markers.
    """
    lines = []
    for question in results.questions:
        header = [h for _, h in question.columns] + ["machine", "date", "run"]
        rows = []
        for row in question.rows:
            run = results.runs[row.run]
            cells = [_fill(results, row.cells[key]) for key, _ in question.columns]
            rows.append([*cells, run.machine, run.date, _run_link(results, row.run)])
        lines += [f"### {question.title}", "", question.about, "", *_table(header, rows), ""]
        lines += [f"Commands: {_commands(results, question)}.", ""]
    return "\n".join(lines)


def render_readme(results: Results) -> str:
    """README.md's Measured table: per row what was measured, the figure, machine, date and a link
    to its question's table in BENCHMARKS.md.

    Parameters
    ----------
    results : Results
        The results file.

    Returns
    -------
    str
        The text between the ``measured`` markers.
    """
    rows = []
    for entry in results.readme:
        question = _question(results, entry.row.split("/")[0])
        run = results.runs[_row(results, entry.row).run]
        link = f"[{question.short}](BENCHMARKS.md#{anchor(question.title)})"
        rows.append([entry.what, _fill(results, entry.figure), run.machine, run.date, link])
    return "\n".join(_table(["measured", "figure", "on", "date", "details"], rows))


def _region(text: str, name: str) -> tuple[int, int] | None:
    start = text.find(f"<!-- {name}:")
    end = text.find(f"<!-- /{name} -->")
    if start < 0 or end < start:
        return None
    return text.index("-->", start) + len("-->\n"), end


def _replace(text: str, name: str, body: str) -> str:
    span = _region(text, name)
    if span is None:
        raise EPInputError(name, f"a '<!-- {name}: ... -->' ... '<!-- /{name} -->' region", "none")
    return text[: span[0]] + body + "\n" + text[span[1] :]


def draw_figure(results: Results, out: Path) -> None:
    """Draw the decode figure: per model, time per forward against tokens per rank for the layer
    and the bare GEMMs, the HBM floor drawn, each point labelled layer ÷ floor.

    Parameters
    ----------
    results : Results
        The results file (its ``figure`` and that figure's run).
    out : Path
        The PNG to write; it carries the data's digest (:func:`figure_digest`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = results.figure
    run = results.runs[fig.run]
    figure, axes = plt.subplots(1, len(fig.panels), figsize=(11, 4.4), constrained_layout=True)
    for ax, panel in zip(axes, fig.panels, strict=True):
        ax.fill_between(fig.tokens, 0, panel.floor_ms, color="0.9")
        ax.plot(fig.tokens, panel.floor_ms, "k--", lw=1.5, label="HBM floor")
        ax.plot(fig.tokens, panel.gemms_ms, "s-", color="tab:orange",
                label="bare torch._grouped_mm GEMMs alone")  # fmt: skip
        ax.plot(fig.tokens, panel.layer_ms, "o-", color="tab:blue", lw=2,
                label="ep_runtime layer, whole forward")  # fmt: skip
        for t, layer, floor in zip(fig.tokens, panel.layer_ms, panel.floor_ms, strict=True):
            ax.annotate(f"{layer / floor:.2f}×", (t, layer), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8, color="tab:blue")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(fig.tokens, [str(t) for t in fig.tokens])
        ax.set_ylim(0, max(panel.gemms_ms + panel.layer_ms) * 1.15)
        ax.set_xlabel("tokens per rank (decode batch)")
        ax.set_ylabel("ms per forward")
        ax.set_title(panel.name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    figure.suptitle(f"{fig.title} ({run.machine}, {run.date}; labels: layer ÷ HBM floor)",
                    fontsize=11)  # fmt: skip
    figure.supxlabel(textwrap.fill(fig.caption, 160), fontsize=8, color="0.3")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110, metadata={"Description": f"front_page {fig.digest}"})
    plt.close(figure)


def figure_digest(path: Path) -> str | None:
    """The data digest a PNG drawn by :func:`draw_figure` carries.

    Parameters
    ----------
    path : Path
        A PNG.

    Returns
    -------
    str or None
        The digest, or None where the PNG carries none.
    """
    from PIL import Image

    with Image.open(path) as image:
        text = image.text.get("Description", "")
    return text.removeprefix("front_page ") if text.startswith("front_page ") else None


def _first_difference(expected: str, found: str) -> str:
    ours, theirs = expected.splitlines(), found.splitlines()
    line = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    want = ours[line] if line < len(ours) else "(end)"
    got = theirs[line] if line < len(theirs) else "(end)"
    return f"at its line {line + 1}, expected {want!r}, found {got!r}"


def check(root: Path) -> list[str]:
    """Every way README.md, BENCHMARKS.md or the figure differ from the results file.

    Parameters
    ----------
    root : Path
        The repository's root (holding README.md, BENCHMARKS.md and ``docs/figures/``).

    Returns
    -------
    list[str]
        One line per difference; empty when everything agrees.
    """
    results = load_results(root / RESULTS)
    benchmarks = (root / "BENCHMARKS.md").read_text()
    problems = [
        f"run {name}: no '## {run.session}' in BENCHMARKS.md"
        for name, run in results.runs.items()
        if run.session and f"\n## {run.session}\n" not in benchmarks
    ]
    for file, region, body in (
        ("README.md", README_REGION, render_readme(results)),
        ("BENCHMARKS.md", BENCHMARKS_REGION, render_benchmarks(results)),
    ):
        text = (root / file).read_text()
        span = _region(text, region)
        if span is None:
            problems.append(f"{file}: no '<!-- {region}: ... -->' region")
        elif text[span[0] : span[1]] != body + "\n":
            where = _first_difference(body + "\n", text[span[0] : span[1]])
            problems.append(f"{file}: the {region} region differs from {RESULTS}: {where}")
    png = root / results.figure.path
    if not png.is_file():
        problems.append(f"{results.figure.path}: missing")
    elif figure_digest(png) != results.figure.digest:
        problems.append(f"{results.figure.path}: drawn from other data than {RESULTS}")
    return problems


def write(root: Path) -> None:
    """Render README.md's and BENCHMARKS.md's marked regions and the figure from the results.

    Parameters
    ----------
    root : Path
        The repository's root.

    Raises
    ------
    EPInputError
        Where a file lacks its marked region.
    """
    results = load_results(root / RESULTS)
    for file, region, body in (
        ("README.md", README_REGION, render_readme(results)),
        ("BENCHMARKS.md", BENCHMARKS_REGION, render_benchmarks(results)),
    ):
        path = root / file
        path.write_text(_replace(path.read_text(), region, body))
    draw_figure(results, root / results.figure.path)


def main(argv: list[str] | None = None) -> int:
    """``python -m ep_runtime.bench.front_page --check | --write [--root DIR]``.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default: the command line's).

    Returns
    -------
    int
        0 when everything agrees (or was written), 1 naming each difference.
    """
    parser = argparse.ArgumentParser(prog="python -m ep_runtime.bench.front_page",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 naming each difference")
    mode.add_argument("--write", action="store_true", help="render the tables and the figure")
    parser.add_argument(
        "--root", type=Path, default=REPO, help="the repository (default: this one)"
    )
    args = parser.parse_args(argv)
    if args.write:
        write(args.root)
        print(f"wrote README.md, BENCHMARKS.md and the figure from {RESULTS}")
        return 0
    problems = check(args.root)
    for problem in problems:
        print(problem)
    print("front page agrees with " + str(RESULTS) if not problems else "front page: DIFFERS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
