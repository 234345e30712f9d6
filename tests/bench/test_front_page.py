"""The front page cannot disagree with its results file: README.md's Measured table, BENCHMARKS.md's
current figures and the figure are what ``python -m ep_runtime.bench.front_page`` renders from
``docs/figures/front_page.json``, an edited number is caught, and the file's ratios follow from
its own times (hand arithmetic, independent of the renderer)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from ep_runtime.bench import front_page

# the checkout holding this file, wherever in tests/ it lives
REPO = next(p for p in Path(__file__).resolve().parents if (p / "BENCHMARKS.md").is_file())
RESULTS = json.loads((REPO / front_page.RESULTS).read_text())


def _copy(tmp_path: Path) -> Path:
    """The three files and the figure folder, in a scratch repository root."""
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "docs" / "figures", tmp_path / "docs" / "figures")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) >= 1, old
    path.write_text(text.replace(old, new, 1))


def test_readme_benchmarks_and_figure_agree_with_the_results():
    assert front_page.check(REPO) == []


def test_the_command_checks_and_exits_zero(capsys):
    assert front_page.main(["--check", "--root", str(REPO)]) == 0
    assert "agrees" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("file", "old", "new"),
    [
        ("README.md", "| 1.05× the HBM floor", "| 1.04× the HBM floor"),
        ("README.md", "(5.162 vs 4.769 ms)", "(5.162 vs 4.796 ms)"),
        ("BENCHMARKS.md", "| 5.3770 | 3.1472 | 0.585 |", "| 5.3770 | 3.1472 | 0.58 |"),
        ("BENCHMARKS.md", "| 11.20 | 9.54 | 1.17 |", "| 11.20 | 9.45 | 1.17 |"),
    ],
)
def test_one_edited_number_is_named(tmp_path, file, old, new):
    root = _copy(tmp_path)
    _edit(root / file, old, new)
    problems = front_page.check(root)
    assert len(problems) == 1 and problems[0].startswith(f"{file}: "), problems
    assert new.strip("| ") in problems[0]
    assert front_page.main(["--check", "--root", str(root)]) == 1


def test_a_run_must_be_a_session_of_the_log(tmp_path):
    root = _copy(tmp_path)
    _edit(
        root / "BENCHMARKS.md", "\n## 1× H100, world size 1 (2026-12-06, fourth session)", "\n## x"
    )
    problems = front_page.check(root)
    assert any(p.startswith("run fp8-h100-run-4: no '## 1× H100") for p in problems), problems


def test_a_figure_drawn_from_other_data_is_refused(tmp_path):
    root = _copy(tmp_path)
    results = root / front_page.RESULTS
    _edit(results, "0.698, 1.123", "0.700, 1.123")  # a layer time of the figure's data
    assert front_page.check(root) == [f"{RESULTS['figure']['path']}: drawn from other data "
                                      f"than {front_page.RESULTS}"]  # fmt: skip
    front_page.write(root)
    assert front_page.check(root) == []


def test_the_figure_redraws_as_committed(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    results = front_page.load_results(REPO / front_page.RESULTS)
    committed = REPO / results.figure.path
    redrawn = tmp_path / "figure.png"
    front_page.draw_figure(results, redrawn)
    assert front_page.figure_digest(redrawn) == front_page.figure_digest(committed)
    with Image.open(redrawn) as new, Image.open(committed) as old:
        assert new.size == old.size
    assert 0.7 < redrawn.stat().st_size / committed.stat().st_size < 1.3


def _number(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell))


def test_each_ratio_follows_from_its_times():
    """Hand arithmetic: a/b equals the stated ratio to its last digit (plus the rounding of a
    and b, at most 0.1 %)."""
    checked = 0
    for question in RESULTS["questions"]:
        for row in question["rows"]:
            for numerator, denominator, ratio in row.get("ratios", []):
                if denominator is None:  # the cell holds "a / b"
                    a, b = (_number(x) for x in row["cells"][numerator].split(" / "))
                else:
                    a, b = _number(row["cells"][numerator]), _number(row["cells"][denominator])
                stated = row["cells"][ratio]
                digits = len(stated.split(".")[1])
                assert abs(a / b - float(stated)) <= 0.5 * 10**-digits + 1e-3 * float(stated), (
                    question["id"], row["key"], a, b, stated
                )  # fmt: skip
                checked += 1
    assert checked == 12


def test_each_run_names_its_machine_and_date_as_its_session_does():
    for name, run in RESULTS["runs"].items():
        if run.get("session") is None:
            assert (REPO / run["link"].split("#")[0]).is_file(), name
            continue
        card = run["machine"].split()[-1]  # "1× H200" -> "H200"
        assert card in run["session"] and run["date"] in run["session"], name
