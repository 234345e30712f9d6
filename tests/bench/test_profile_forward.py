"""``python -m ep_runtime.bench.profile_forward`` on CPU (its tiny points run in no time): the
host time per forward of a world-of-one layer with the dispatcher asked for, in both layouts."""

from __future__ import annotations

import re

import pytest

from ep_runtime.bench import profile_forward


@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("dispatcher", ["torch_a2a", "local"])
def test_cpu_run_times_the_layer_built_with_the_dispatcher_asked_for(capsys, dispatcher, layout):
    argv = ["--device", "cpu", "--point", "tiny-prefill", "--layout", layout, "--no-profile"]
    argv += ["--dispatcher", dispatcher, "--forwards", "3", "--repeats", "1"]
    assert profile_forward.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"tiny-prefill (exact, {layout}, {dispatcher}, grouped_mm, T=64,")
    assert float(re.search(r"host ([0-9.]+) us/forward to issue", line).group(1)) > 0
