"""The documentation's Python examples run as written: every ```python block of README.md and
docs/*.md is executed in a fresh process (world of 1, CPU); a block fenced ```python no-run (a
fragment that needs a checkpoint, fp8 weights or several processes) is only compiled."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ENV

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str, str]]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append(
                (f"{path.relative_to(REPO)}:{line}", match.group(1).strip(), match.group(2))
            )
    return found


BLOCKS = _blocks()


def test_the_readme_has_a_runnable_example():
    assert any(where.startswith("README.md") and tag == "" for where, tag, _ in BLOCKS)


@pytest.mark.parametrize(("where", "tag", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block_runs(where, tag, code, tmp_path):
    assert tag in ("", "no-run"), f"{where}: unknown fence tag {tag!r}"
    compile(code, where, "exec")  # every block is at least valid Python
    if tag == "no-run":
        return
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # nothing written into the clone
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout}\n{done.stderr}"
    assert "Warning" not in done.stderr, done.stderr
