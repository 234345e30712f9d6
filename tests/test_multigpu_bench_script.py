"""tools/gpu/multigpu_bench.sh --dry-run: the commands each part would run on a GPU machine
(world sizes, backends, options, as issues 7 and 50 ask for them), and every launcher command
among them accepted by the launcher's own checks (``build_parser`` then ``build_spec``: the
arguments and the layer they describe, nothing started). Nothing here needs a GPU."""

from __future__ import annotations

import itertools
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from ep_runtime.launch.cli import build_parser, build_spec
from ep_runtime.launch.spec import RunSpec
from tests.multigpu.test_fp8_layer import FP8_WORLD_SIZES, fp8_matrix
from tests.support.processes import ENV, REPO

SCRIPT = REPO / "tools" / "gpu" / "multigpu_bench.sh"
LAUNCHER = "ep_runtime.launch"


@dataclass(frozen=True)
class Command:
    """One printed command: its environment assignments (``env K=V …``), the rest, its log."""

    env: dict[str, str]
    argv: list[str]
    log: str

    @property
    def launcher_args(self) -> list[str] | None:
        """The arguments after ``-m ep_runtime.launch``; None for another command."""
        if LAUNCHER not in self.argv:
            return None
        return self.argv[self.argv.index(LAUNCHER) + 1 :]

    def spec(self) -> RunSpec:
        """The launcher's own parse and checks of this command line (no rank starts)."""
        args = build_parser().parse_args(self.launcher_args)
        return build_spec(args, args.dp)


@dataclass(frozen=True)
class DryRun:
    commands: list[Command]
    notes: list[str]  # every other line

    def logs(self, name: str) -> list[Command]:
        return [c for c in self.commands if Path(c.log).name == name]

    def launches(self, name: str) -> list[tuple[Command, RunSpec]]:
        return [(c, c.spec()) for c in self.logs(name) if c.launcher_args is not None]


def parse_command(line: str) -> Command:
    text, log = line.rsplit(" >> ", 1)
    words = shlex.split(text)
    env = {}
    if words[0] == "env":
        words.pop(0)
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
    return Command(env, words, log)


def dry_run(*args: str, deep_ep_stub: Path | None = None) -> DryRun:
    """The script's dry run; with ``deep_ep_stub`` (a folder holding ``deep_ep.py``) on the
    path, ``import deep_ep`` works for the script's probe."""
    env = dict(ENV)
    if deep_ep_stub is not None:
        env["PYTHONPATH"] = f"{deep_ep_stub}:{env['PYTHONPATH']}"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "dry run: nothing was started"
    commands = [parse_command(line) for line in lines if " >> " in line]
    return DryRun(commands, [line for line in lines if " >> " not in line])


@pytest.fixture(scope="module")
def deep_ep_stub(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stub")
    (folder / "deep_ep.py").write_text('"""Stands in for the real package in a dry run."""\n')
    return folder


def deepep_checkout(root: Path, has_format_filter: bool) -> Path:
    """A DeepEP checkout's test_ep.py as the script looks at it (only for the option's name)."""
    test_ep = root / "tests" / "elastic" / "test_ep.py"
    test_ep.parent.mkdir(parents=True)
    option = "parser.add_argument('--use-fp8-dispatch', type=int)\n" if has_format_filter else ""
    test_ep.write_text(f"import argparse\nparser = argparse.ArgumentParser()\n{option}")
    return root


# fp8 ---------------------------------------------------------------------------------------------
def test_fp8_at_8_gpus(deep_ep_stub):
    run = dry_run("--gpus", "8", "--parts", "fp8", deep_ep_stub=deep_ep_stub)
    tests = [c for c in run.logs("fp8.log") if c.launcher_args is None]
    assert [c.argv[c.argv.index("pytest") + 1 :] for c in tests] == [
        ["-q", "-rs", "tests/multigpu/test_fp8_layer.py"],  # every world size of the file
        ["-q", "-rs", "tests/multigpu/test_deepep_real.py", "-k", "fp8"],
    ]
    assert all(c.env == {"EP_TEST_BACKEND": "nccl"} for c in tests)
    launches = run.launches("fp8.log")
    # only EP 8 (the file's world sizes end at 4), torch_a2a, fp8, both layouts, both modes
    assert max(FP8_WORLD_SIZES) == 4
    assert sorted(spec.workload.mode for _, spec in launches) == ["capacity", "exact"]
    for _, spec in launches:
        run_ = spec.workload
        assert (spec.world_size, spec.device, run_.dispatcher) == (8, "cuda", "torch_a2a")
        assert (run_.quantization, run_.layouts) == ("fp8_block", ("standard", "expanded"))


def selected(expression: str, test_name: str) -> bool:
    """Whether ``pytest -k expression`` keeps the test of this name (a case-insensitive
    substring match per word, as pytest's keyword matching)."""
    name = test_name.lower()
    return Expression.compile(expression).evaluate(lambda word, /, **_: word.lower() in name)


def test_fp8_at_2_gpus_deselects_the_world_sizes_above():
    run = dry_run("--gpus", "2", "--parts", "fp8")
    assert "fp8 on deepep_v2 skipped: 'import deep_ep' fails with python3" in run.notes
    (test,) = run.logs("fp8.log")  # no EP 8 launcher run either
    expression = test.argv[test.argv.index("-k") + 1]
    assert expression == "not -w3- and not -w4-"
    # pytest's own -k evaluation over the matrix's ids: exactly the world sizes <= 2 stay
    for param in fp8_matrix():
        kept = selected(expression, f"test_fp8_layer_matches_the_oracle[{param.id}]")
        assert kept == (param.values[1] <= 2), param.id
    assert selected(expression, "test_fp8_local_shards[expanded]")  # the file's W = 2 cases


def test_fp8_needs_two_gpus():
    run = dry_run("--gpus", "1", "--parts", "fp8")
    assert run.commands == []
    assert "fp8 part skipped: needs >= 2 GPUs, found 1" in run.notes


# bandwidth ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("has_format_filter", [True, False])
def test_bandwidth_at_8_gpus(tmp_path, deep_ep_stub, has_format_filter):
    checkout = deepep_checkout(tmp_path / "DeepEP", has_format_filter)
    run = dry_run(
        "--gpus", "8", "--parts", "bandwidth", "--deepep-dir", str(checkout),
        deep_ep_stub=deep_ep_stub,
    )  # fmt: skip
    launches = run.launches("bandwidth.log")
    points = sorted(
        (s.world_size, s.workload.model.tokens_per_rank, s.workload.dispatcher,
         s.workload.quantization or "none", s.workload.mode)
        for _, s in launches
    )  # fmt: skip
    expected = [
        (ep, tokens, dispatcher, quantization, "capacity" if tokens == 128 else "exact")
        for ep, tokens, dispatcher, quantization in itertools.product(
            (2, 4, 8), (128, 4096), ("deepep_v2", "torch_a2a"), ("fp8_block", "none")
        )
    ]
    assert points == expected
    for _, spec in launches:
        model = spec.workload.model  # DeepSeek-V3's shape, its own router, the baselines on
        assert (model.name, model.hidden_size, model.top_k, model.num_experts) == (
            "deepseek-v3", 7168, 8, 256,
        )  # fmt: skip
        assert spec.device == "cuda" and spec.workload.baselines
        assert spec.workload.layouts == ("standard", "expanded")  # like for like in both formats
    reference = run.logs("deepep_test_ep.log")
    formats = (["0"], ["1"]) if has_format_filter else ([],)
    expected_runs = [
        [str(checkout / "tests/elastic/test_ep.py"), "--num-processes", str(ep),
         "--num-tokens", str(tokens), "--hidden", "7168", "--num-topk", "8",
         "--num-experts", "256", "--test-first-only",
         *(["--use-fp8-dispatch", *fp8] if fp8 else [])]
        for ep, tokens, fp8 in itertools.product((2, 4, 8), (128, 4096), formats)
    ]  # fmt: skip
    assert [c.argv[c.argv.index("python3") + 1 :] for c in reference] == expected_runs
    assert all(c.argv[:2] == ["timeout", "240"] for c in reference)
    assert all(c.argv[c.argv.index("env") + 1] == "EP_DISABLE_GIN=1" for c in reference)


def test_bandwidth_narrowed_without_deepep(tmp_path):
    run = dry_run("--gpus", "4", "--parts", "bandwidth", "--tokens", "4096")
    assert "EP 8 skipped: this machine has 4 GPU(s)." in run.notes
    assert "DeepEP's own figures skipped: no --deepep-dir (a DeepEP checkout)" in run.notes
    points = sorted(
        (s.world_size, s.workload.dispatcher, s.workload.quantization or "none")
        for _, s in run.launches("bandwidth.log")
    )
    assert points == [
        (2, "torch_a2a", "fp8_block"), (2, "torch_a2a", "none"),
        (4, "torch_a2a", "fp8_block"), (4, "torch_a2a", "none"),
    ]  # fmt: skip
    missing = tmp_path / "nowhere"
    run = dry_run("--gpus", "2", "--parts", "bandwidth", "--deepep-dir", str(missing))
    assert f"DeepEP's own figures skipped: {missing}/tests/elastic/test_ep.py not found" in (
        run.notes
    )


# eplb --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("gpus", "sizes"), [("8", [2, 4, 8]), ("4", [2, 4])])
def test_eplb_at_each_ep_size_the_machine_has(gpus, sizes):
    launches = dry_run("--gpus", gpus, "--parts", "eplb").launches("eplb.log")
    assert [spec.world_size for _, spec in launches] == sizes
    for command, spec in launches:
        run = spec.workload
        assert (run.routing, run.redundant_experts, run.rebalance_every) == ("zipf:1.2", 8, 2)
        assert (spec.device, run.model.name, run.quantization) == ("cuda", "deepseek-v3", None)
        assert "--json" in command.launcher_args


def test_eplb_without_a_size_that_fits():
    run = dry_run("--gpus", "1", "--parts", "eplb")
    assert run.commands == []
    assert "eplb part skipped: no EP size of --ep fits 1 GPU(s)" in run.notes


# every part, and the CPU rehearsal -------------------------------------------------------------
def test_all_parts_at_8_gpus(tmp_path, deep_ep_stub):
    checkout = deepep_checkout(tmp_path / "DeepEP", has_format_filter=False)
    run = dry_run(
        "--gpus", "8", "--parts", "all", "--deepep-dir", str(checkout), deep_ep_stub=deep_ep_stub
    )
    logs = {Path(c.log).name for c in run.commands}
    assert logs == {
        f"{part}.log" for part in ("suite", "comm", "layer", "fp8", "bandwidth", "eplb")
    } | {"deepep_test_ep.log"}
    (suite,) = run.logs("suite.log")
    assert suite.env == {"EP_TEST_WORLD_SIZES": "1,2,4,8", "EP_TEST_GROUP_TIMEOUT_S": "120"}
    launched = [c for c in run.commands if c.launcher_args is not None]
    # comm: EP x tokens x 3 dispatchers x 2 modes; layer 2; fp8 2 (EP 8); bandwidth: EP x tokens
    # x 2 dispatchers x 2 formats; eplb: EP
    assert len(launched) == 3 * 2 * 3 * 2 + 2 + 2 + 3 * 2 * 2 * 2 + 3
    for command in launched:  # each one the launcher accepts as it stands
        spec = command.spec()
        assert spec.device == "cuda" and spec.world_size in (2, 4, 8)
        assert command.argv[:2] == ["timeout", "240"]


def test_cpu_rehearsal():
    run = dry_run("--cpu", "--parts", "eplb,bandwidth", "--deepep-dir", "/opt/DeepEP")
    assert "DeepEP's own figures skipped: --cpu (DeepEP runs on GPUs)" in run.notes
    eplb = run.launches("eplb.log")
    assert [s.world_size for _, s in eplb] == [2, 4]  # --cpu's default --ep
    bandwidth = run.launches("bandwidth.log")
    assert len(bandwidth) == 2 * 2 * 2  # EP 2, 4 x 128, 4096 tokens x none, fp8_block
    for _, spec in eplb + bandwidth:
        assert (spec.device, spec.workload.model.name) == ("cpu", "tiny")
        assert spec.workload.dispatcher in ("auto", "torch_a2a")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu", "--parts", "fp8"],
         "--cpu: expected parts among eplb,bandwidth (the others need GPUs), given 'fp8'"),
        (["--parts", "elastic"], "--parts: unknown part 'elastic'"),
    ],
)  # fmt: skip
def test_refused_parts(args, message):
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [message]
