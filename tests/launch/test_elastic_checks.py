"""``--elastic`` / ``--kill-rank`` before any rank starts (one line naming the option, what was
expected and what was given; exit 2), the spawn supervisor's view of a rank the run kills
itself, and the negative control of the elastic report (a wrong output fails it): no processes
are started here."""

from __future__ import annotations

import queue
import signal

import pytest
import torch
import torch.distributed as dist

from ep_runtime.launch import cli, spawn
from ep_runtime.launch.cli import EXIT_USAGE, build_parser, build_spec, main
from ep_runtime.launch.elastic_options import ELASTIC_ROUTING, TORCHRUN_KEEPS_NO_SURVIVOR
from ep_runtime.launch.elastic_report import build_report, report_lines
from ep_runtime.launch.elastic_run import ElasticWorkload, KillAt
from ep_runtime.launch.layer_run import LayerWorkload
from ep_runtime.launch.presets import PRESETS
from ep_runtime.launch.rank import RankWorker
from ep_runtime.launch.spec import RankFailure, RunOutcome, RunSpec


def _no_launch(*args):
    raise AssertionError("a run was started")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--kill-rank", "2@5"],
         "--kill-rank: expected --elastic with it (a rank's death ends any other run), given 2@5 "
         "without --elastic"),
        (["--elastic", "--launcher", "torchrun"], TORCHRUN_KEEPS_NO_SURVIVOR),
        (["--elastic", "--dp", "4", "--kill-rank", "4@5"],
         "--kill-rank: expected a rank in [0, 4) (--dp 4), given 4 (in 4@5)"),
        (["--elastic", "--dp", "4", "--iters", "5", "--kill-rank", "1@5"],
         "--kill-rank: expected an iteration in [0, 5) (--iters 5), given 5 (in 1@5)"),
        (["--elastic", "--dp", "2", "--kill-rank", "0@1,1@2"],
         "--kill-rank: expected a rank left alive, given all 2 ranks killed"),
        (["--elastic", "--dp", "4", "--kill-rank", "1@1", "--kill-rank", "1@2"],
         "--kill-rank: expected each rank killed once, given rank 1 twice"),
        (["--elastic", "--kill-rank", "two@5"],
         "--kill-rank: expected R@N (rank R killed as iteration N starts; several: R@N,R@N), "
         "given 'two@5'"),
        (["--elastic", "--kill-rank", "1@"],
         "--kill-rank: expected R@N (rank R killed as iteration N starts; several: R@N,R@N), "
         "given '1@'"),
        (["--elastic", "--quantization", "fp8_block", "--hidden", "128", "--intermediate", "128"],
         "--quantization: expected none with --elastic, given fp8_block"),
        (["--elastic", "--rebalance-every", "2"],
         "--rebalance-every: expected none with --elastic, given 2"),
        (["--elastic", "--inject-failure", "1:kill:2"],
         "--inject-failure: expected none with --elastic, given 1:kill:2"),
        (["--elastic", "--layout", "both"],
         "--layout: expected one layout with --elastic (auto, standard or expanded), given both"),
        (["--elastic", "--dispatcher", "torch_symm_mem"],
         "--dispatcher: expected one that is built again on a re-formed group with --elastic "
         "(deepep_v2, local, torch_a2a), given 'torch_symm_mem'"),
    ],
)  # fmt: skip
def test_bad_elastic_arguments_are_one_line_exit_2(argv, line, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_launch", _no_launch)
    launcher = [] if "--launcher" in argv else ["--launcher", "spawn"]
    try:
        code = main([*launcher, *argv])
    except SystemExit as exited:  # argparse's own (the value's form)
        code = exited.code
    assert code == EXIT_USAGE
    captured = capsys.readouterr()
    assert (captured.out + captured.err).splitlines() == [f"error: {line}"]


def test_kill_ranks_are_flattened_in_order_and_the_workload_knows_its_dead():
    args = build_parser().parse_args(
        ["--elastic", "--dp", "4", "--kill-rank", "1@3,2@6", "--kill-rank", "0@1"]
    )
    spec = build_spec(args, 4)
    workload = spec.workload
    assert isinstance(workload, ElasticWorkload)
    assert workload.kills == (KillAt(1, 3), KillAt(2, 6), KillAt(0, 1))
    assert workload.killed_ranks == {0, 1, 2} and workload.reporting_rank == 3
    assert workload.forms_elastic_group
    assert workload.to_json()["kills"] == ["1@3", "2@6", "0@1"]
    steps = workload.plan()
    iterations = [step.args for step in steps if step.method == "run_iters"]
    covered = [i for start, count in iterations for i in range(start, start + count)]
    assert covered == list(range(workload.iters))  # every iteration once, in order


@pytest.mark.parametrize(
    ("argv", "routing"),
    [
        (["--elastic"], ELASTIC_ROUTING),
        (["--elastic", "--routing", "model"], "model"),
        ([], "model"),
        (["--routing", "zipf:2"], "zipf:2"),
    ],
)
def test_routing_is_skewed_by_default_under_elastic_only(argv, routing):
    workload = build_spec(build_parser().parse_args(argv), 2).workload
    assert workload.routing == routing
    assert isinstance(workload, ElasticWorkload if "--elastic" in argv else LayerWorkload)


# spawn's supervisor ------------------------------------------------------------------------------
class _Process:
    """What ``_supervise`` reads of a rank process."""

    def __init__(self, pid: int, exitcode: int | None) -> None:
        self.pid, self.exitcode = pid, exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None


class _Progress:
    def done(self, step) -> None:
        pass


def _events(*events) -> queue.Queue:
    channel: queue.Queue = queue.Queue()
    for event in events:
        channel.put(event)
    return channel


def test_spawn_goes_on_without_a_rank_the_run_killed():
    processes = [_Process(100 + r, 0) for r in range(4)]
    processes[2].exitcode = -signal.SIGKILL
    events = _events(*(("result", r, {"rank": r}) for r in (0, 1, 3)))
    summaries = spawn._supervise(processes, events, _Progress(), frozenset({2}))
    assert [s["rank"] for s in summaries] == [0, 1, 3]


@pytest.mark.parametrize(
    ("dead", "exitcode", "killed"),
    [
        (1, -signal.SIGKILL, frozenset({2})),  # another rank died: a failure as ever
        (2, 1, frozenset({2})),  # the named rank exited otherwise: a failure
        (2, -signal.SIGKILL, frozenset()),  # not an elastic run
    ],
)
def test_spawn_still_ends_the_run_on_any_other_death(dead, exitcode, killed):
    processes = [_Process(100 + r, None) for r in range(4)]
    processes[dead].exitcode = exitcode
    events = _events(*(("result", r, {"rank": r}) for r in range(4) if r != dead))
    with pytest.raises(RankFailure) as failure:
        spawn._supervise(processes, events, _Progress(), killed)
    assert failure.value.rank == dead


# the report's negative control -------------------------------------------------------------------
def test_a_wrong_output_fails_the_elastic_report():
    """One elastic rank in this process (its group on a local store): validated, then made to
    apply its experts twice; the survivor's check and the report must both fail."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    workload = ElasticWorkload(
        model=PRESETS["tiny"].with_overrides(tokens_per_rank=16), dtype="fp32", iters=2
    )
    spec = RunSpec(world_size=1, device="cpu", workload=workload)
    threads = torch.get_num_threads()
    worker = RankWorker(spec, 0)
    worker.init_process_group(store=dist.HashStore())
    try:
        for method, args in (("setup", ()), ("build", ()), ("run_iters", (0, 2)), ("measure", ())):
            worker.step(method, args)
        assert worker.step("validate", ())["passed"]
        layer = worker.workload.layer
        forward = layer.experts.forward
        layer.experts.forward = lambda dispatched, out=None: forward(dispatched) * 2
        result = worker.step("validate", ())
        assert not result["passed"] and result["max_rel_err"] > 0.5
        summary = worker.step("summarize", ())
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
    report = build_report(spec, {}, RunOutcome("spawn", [summary], 1.0, True))
    assert not report["passed"]
    assert [problem.split(":")[0] for problem in report["problems"]] == ["rank 0"]
    assert report_lines(report)[-1] == "FAILED: no rank lost; 1 problem(s) above"
