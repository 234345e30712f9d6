"""The launcher without Ray, in process: workload determinism and sharding, sampled validation
against the full oracle, hand-counted metrics, failure attribution and CLI arguments. Whole runs
(spawn, torchrun, signals, the launcher's extra): tests/launch/test_launch_runs.py."""

from __future__ import annotations

import pytest
import torch

from ep_runtime import reference_moe
from ep_runtime.bench.metrics import (
    Traffic,
    destination_rows,
    expert_flops_per_pair,
    expert_token_counts,
    imbalance,
)
from ep_runtime.bench.timing import max_over_ranks_stats
from ep_runtime.dispatch import DISPATCHERS
from ep_runtime.launch import cli, layer_data
from ep_runtime.launch.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from ep_runtime.launch.layer_run import FailureInjection
from ep_runtime.launch.presets import PRESETS, preset_by_name
from ep_runtime.launch.spec import LaunchError
from ep_runtime.launch.supervision import (
    GRACE_S,
    Failure,
    FailureKind,
    classify_exception_text,
    exception_messages,
    root_failure,
    usage_error_line,
    window_closed,
)
from ep_runtime.launch.torchrun import env_rank
from ep_runtime.types import BackendUnavailableError, EPInputError

CPU = torch.device("cpu")
TINY = PRESETS["tiny"]
TINY_CONFIG = TINY.moe_config()


# workload ---------------------------------------------------------------------------------------
def test_expert_weights_depend_on_seed_and_expert_only():
    w13, w2 = layer_data.expert_weights(TINY_CONFIG, 3, 7, CPU, torch.float32)
    again13, again2 = layer_data.expert_weights(TINY_CONFIG, 3, 7, CPU, torch.float32)
    assert torch.equal(w13, again13) and torch.equal(w2, again2)
    assert w13.shape == (2 * TINY.intermediate_size, TINY.hidden_size)
    assert w2.shape == (TINY.hidden_size, TINY.intermediate_size)
    assert not torch.equal(w13, layer_data.expert_weights(TINY_CONFIG, 4, 7, CPU, torch.float32)[0])
    assert not torch.equal(w13, layer_data.expert_weights(TINY_CONFIG, 3, 8, CPU, torch.float32)[0])


def test_rank_shard_equals_slice_of_global_weights():
    world, rank = 4, 2
    full13, full2 = layer_data.stacked_expert_weights(
        TINY_CONFIG, list(range(TINY.num_experts)), 0, CPU, torch.bfloat16
    )
    local = layer_data.local_experts(TINY_CONFIG, rank, world)
    assert local == [8, 9, 10, 11]  # 16 experts over 4 ranks: rank 2 owns the third quarter
    shard13, shard2 = layer_data.stacked_expert_weights(TINY_CONFIG, local, 0, CPU, torch.bfloat16)
    assert torch.equal(shard13, full13[8:12])
    assert torch.equal(shard2, full2[8:12])


@pytest.mark.parametrize("model_name", ["tiny", "nemotron-3-nano"])
def test_sampled_reference_equals_full_reference(model_name):
    """Chunked regeneration (3 experts at a time) gives the oracle's answer on the sample."""
    model = preset_by_name(model_name).with_overrides(hidden_size=32, intermediate_size=16)
    config = model.moe_config()
    x = layer_data.rank_hidden_states(config, 1, 24, 5, CPU, torch.float32)
    ids, weights = layer_data.rank_routing(model, 1, 24, 5, CPU)
    full13, full2 = layer_data.stacked_expert_weights(
        config, list(range(model.num_experts)), 5, CPU, torch.float32
    )
    expected = reference_moe(x, ids, weights, full13, full2, activation=model.activation)
    got, _, touched = layer_data.sampled_reference(model, x, ids, weights, 5, experts_per_chunk=3)
    assert touched == sorted(set(ids.flatten().tolist()))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    wrong_seed, _, _ = layer_data.sampled_reference(model, x, ids, weights, 6, experts_per_chunk=3)
    assert not torch.allclose(wrong_seed, expected, rtol=1e-2, atol=1e-2)


def test_validation_regenerates_only_touched_experts_a_chunk_at_a_time(monkeypatch):
    """DeepSeek-V3 routing (256 experts): never more than one chunk of experts resident."""
    model = PRESETS["deepseek-v3"].with_overrides(hidden_size=16, intermediate_size=8)
    x = layer_data.rank_hidden_states(model.moe_config(), 0, 16, 0, CPU, torch.bfloat16)
    ids, weights = layer_data.rank_routing(model, 0, 16, 0, CPU)
    built: list[list[int]] = []
    original = layer_data.stacked_expert_weights

    def recording(config, experts, *args):
        built.append(list(experts))
        return original(config, experts, *args)

    monkeypatch.setattr(layer_data, "stacked_expert_weights", recording)
    _, _, touched = layer_data.sampled_reference(model, x, ids, weights, 0)
    assert max(len(chunk) for chunk in built) <= layer_data.EXPERTS_PER_VALIDATION_CHUNK
    assert sorted(e for chunk in built for e in chunk) == touched
    assert len(touched) < model.num_experts


def test_deepseek_v3_rank_shard_is_an_eighth_at_ep8():
    config = PRESETS["deepseek-v3"].moe_config()
    per_expert = (2 * 2048 + 2048) * 7168 * 2  # w13 [4096, 7168] + w2 [7168, 2048], bf16
    assert layer_data.shard_weight_bytes(config, 8, torch.bfloat16) == 32 * per_expert
    assert layer_data.shard_weight_bytes(config, 1, torch.bfloat16) == 256 * per_expert  # 22.5 GB


def test_validation_sample_is_deterministic_and_sorted():
    sample = layer_data.validation_sample(100, 10, 3, 1)
    assert torch.equal(sample, layer_data.validation_sample(100, 10, 3, 1))
    assert sample.tolist() == sorted(set(sample.tolist())) and len(sample) == 10
    assert layer_data.validation_sample(5, 0, 3, 1).tolist() == [0, 1, 2, 3, 4]


# routers of the presets -------------------------------------------------------------------------
def _route(name: str, tokens: int = 64):
    model = PRESETS[name]
    ids, weights = layer_data.rank_routing(model, 0, tokens, 0, CPU)
    assert ids.shape == (tokens, model.top_k) and ids.dtype == torch.int32
    assert all(len(set(row)) == model.top_k for row in ids.tolist())  # distinct per token
    return model, ids, weights


@pytest.mark.parametrize("name", ["tiny", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_softmax_renormalised_presets_sum_to_one(name):
    _, _, weights = _route(name)
    torch.testing.assert_close(weights.sum(1), torch.ones(weights.size(0)))


def test_deepseek_v2_lite_does_not_renormalise():
    _, _, weights = _route("deepseek-v2-lite")
    sums = weights.sum(1)
    assert bool((sums < 0.99).all()) and bool((sums > 0).all())


def test_deepseek_v3_uses_at_most_four_groups_and_scales_by_2_5():
    model, ids, weights = _route("deepseek-v3")
    per_group = model.num_experts // 8
    assert max(len({e // per_group for e in row}) for row in ids.tolist()) <= 4
    torch.testing.assert_close(weights.sum(1), torch.full((ids.size(0),), 2.5))


def test_nemotron_is_relu2_sigmoid_scaled():
    model, ids, weights = _route("nemotron-3-nano")
    assert model.activation == "relu2"
    torch.testing.assert_close(weights.sum(1), torch.full((ids.size(0),), 2.5))


def test_preset_lookup_is_forgiving_and_strict():
    assert preset_by_name("DeepSeek-V3") is PRESETS["deepseek-v3"]
    assert preset_by_name("qwen3_30b_a3b") is PRESETS["qwen3-30b-a3b"]
    with pytest.raises(ValueError, match="--model"):
        preset_by_name("llama")


# metrics ------------------------------------------------------------------------------------------
def test_traffic_and_counts_by_hand():
    ids = torch.tensor([[0, 1], [0, 5], [6, 7], [-1, 3], [-1, -1]])  # E=8, W=2: L=4
    assert destination_rows(ids, 8, 2) == [3, 2]  # rank 0: rows 0,1,3; rank 1: rows 1,2
    assert expert_token_counts(ids, 8) == [2, 1, 0, 1, 0, 1, 1, 1]
    traffic = Traffic(rows=[[3, 2], [1, 4]], row_bytes=10)
    assert traffic.received_rows(0) == 4 and traffic.received_rows(1) == 6
    assert traffic.dispatch_received_bytes(1) == 60 == traffic.combine_bytes(1)
    assert imbalance([1, 3]) == 1.5 and imbalance([0, 0]) == 1.0
    assert expert_flops_per_pair(4, 2, gated=True) == 2 * 4 * 4 + 2 * 2 * 4
    assert expert_flops_per_pair(4, 2, gated=False) == 2 * 4 * 2 + 2 * 2 * 4


def test_phase_time_is_max_over_ranks_per_iteration():
    stats = max_over_ranks_stats([[1.0, 5.0, 3.0], [2.0, 1.0, 4.0]])  # per iteration: 2, 5, 4
    assert (stats.median_s, stats.min_s, stats.max_s, stats.iterations) == (4.0, 2.0, 5.0, 3)


# failure attribution ----------------------------------------------------------------------------
def test_root_failure_blames_the_dead_rank_over_its_peers_echo():
    failures = [
        Failure(0, FailureKind.COMMUNICATION, "gloo: Connection reset by peer", 0),
        Failure(1, FailureKind.DIED, "rank 1 died", 1),
    ]
    error = root_failure(failures, "step x", still_running=[2])
    assert error.rank == 1 and "died" in error.where
    assert "rank 0 (communication)" in str(error) and "ranks [2]" in str(error)


def test_root_failure_prefers_an_own_exception_and_strips_colour():
    failures = [
        Failure(0, FailureKind.COMMUNICATION, "RemoteRankError: rank 2 failed", 0),
        Failure(2, FailureKind.RAISED, "\x1b[36mray::RankActor\x1b[39m ValueError: bad", 1),
    ]
    error = root_failure(failures, "step x")
    assert error.rank == 2 and "\x1b" not in str(error) and "ValueError: bad" in str(error)


def test_root_failure_blames_the_silent_rank_when_peers_only_timed_out():
    echo = Failure(0, FailureKind.COMMUNICATION, "gloo: Timed out waiting 5000ms", 0)
    error = root_failure([echo], "step x", still_running=[1])
    assert error.rank == 1 and "hung" in error.where and "Timed out" in str(error)


# a rank's own gloo set-up error and a peer's echo, as Ray's str(RayTaskError) shows them
OWN_SETUP_ERROR = """ray::RankActor.start() (pid=15509, ip=10.213.7.2, actor_id=dcbf4b2)
  File "/repo/ep_runtime/launch/rank.py", line 151, in init_process_group
    dist.init_process_group(**options)
  File "/venv/torch/distributed/distributed_c10d.py", line 2169, in _new_process_group_helper
    backend_class = ProcessGroupGloo(
                    ^^^^^^^^^^^^^^^^^
RuntimeError: [enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find \
address for: eth0"""
PEER_ECHO = """ray::RankActor.step() (pid=15510, ip=10.213.7.1, actor_id=aa01)
  File "/repo/ep_runtime/launch/rank.py", line 222, in run_iters
    dispatched, t_dispatch = clock.time(
  File "/venv/torch/distributed/distributed_c10d.py", line 4410, in all_to_all_single
    work = group.alltoall_base(
RuntimeError: [gloo/transport/tcp/pair.cc:534] Read error [10.213.7.2]:41235: Connection reset \
by peer"""


def test_a_ranks_own_setup_error_is_not_taken_for_an_echo():
    """Every gloo set-up traceback passes through ``ProcessGroupGloo(``: only the exception's
    message decides (issue 15: rank 0 was blamed for host B's missing interface)."""
    assert "ProcessGroupGloo" in OWN_SETUP_ERROR
    assert classify_exception_text(OWN_SETUP_ERROR) is FailureKind.RAISED
    assert classify_exception_text(PEER_ECHO) is FailureKind.COMMUNICATION
    assert "ProcessGroupGloo" not in exception_messages(OWN_SETUP_ERROR)
    assert "Unable to find" in exception_messages(OWN_SETUP_ERROR)
    chained = f"{OWN_SETUP_ERROR}\n\nThe above exception was the direct cause of:\n\n{PEER_ECHO}"
    assert classify_exception_text(chained) is FailureKind.COMMUNICATION  # any message counts
    failures = [
        Failure(3, classify_exception_text(OWN_SETUP_ERROR), OWN_SETUP_ERROR, 0),
        Failure(0, FailureKind.COMMUNICATION, "gloo: Timed out waiting 30000ms", 1),
    ]
    error = root_failure(failures, "step process group init", still_running=[1, 2])
    assert error.rank == 3 and error.where == "raised during step process group init"


def test_usage_errors_become_one_line():
    assert usage_error_line(EPInputError("hidden_size", "a positive int", 0)) == (
        "EPInputError: hidden_size: expected a positive int, given 0"
    )
    refusal = BackendUnavailableError("dispatcher", "nope", {"nope": "unknown", "x": "no GPU"})
    line = usage_error_line(refusal)
    assert "\n" not in line and line.startswith("BackendUnavailableError: no dispatcher backend")
    assert "nope: unknown" in line and "x: no GPU" in line
    assert usage_error_line(RuntimeError("a bug")) is None


def test_failure_window_waits_only_while_just_echoes_are_known():
    echo = Failure(0, FailureKind.COMMUNICATION, "Connection reset by peer", 0)
    cause = Failure(1, FailureKind.RAISED, "ValueError", 1)
    assert not window_closed([], 0.0, 100.0)
    assert not window_closed([echo], 10.0, 10.5)  # wait for the cause
    assert window_closed([echo], 10.0, 10.0 + GRACE_S)  # but not forever
    assert window_closed([echo, cause], 10.0, 10.1)


def test_failure_injection_parsing():
    assert FailureInjection.parse("1:raise") == FailureInjection(1, "raise", 0)
    assert FailureInjection.parse("0:kill:3") == FailureInjection(0, "kill", 3)
    with pytest.raises(ValueError, match="inject-failure"):
        FailureInjection.parse("1:explode")


def test_env_rank_reads_torchrun_then_slurm():
    assert env_rank({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}).rank == 3
    slurm = env_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank) == (5, 16, 5)
    with pytest.raises(LaunchError, match="RANK and WORLD_SIZE"):
        env_rank({})


# CLI --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp", "3"], "--dp: expected a divisor of the 16 experts of tiny, given 3"),
        (["--model", "llama"], "--model: expected one of tiny, "),
        (["--dp", "2", "--top-k", "17"], "--top-k: expected <= num_experts (16), given 17"),
        (["--tokens", "-5"], "--tokens: expected >= 0, given -5"),
        (["--iters", "-1"], "--iters: expected >= 0, given -1"),
        (["--warmup", "-2"], "--warmup: expected >= 0, given -2"),
        (["--hidden", "0"], "--hidden: expected a positive int, given 0"),
        (["--activation", "relu2", "--intermediate", "-3"], "--intermediate: expected a positive"),
        (["--timeout", "0"], "--timeout: expected > 0 seconds, given 0"),
        (["--dispatcher", "nope"], "--dispatcher: expected one of auto, "),
        (["--experts", "nope"], "--experts: expected one of auto, "),
        (["--inject-failure", "5:raise"], "--inject-failure: expected a rank in [0, 2), given 5"),
        (["--json", "/nonexistent-dir/r.json"], "--json: expected a writable file, given "),
        (["--plot", "/"], "--plot: expected a writable file, given '/' (Is a directory)"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_launching(argv, message, capsys, monkeypatch):
    def no_launch(*args):
        raise AssertionError("a run was started")

    monkeypatch.setattr(cli, "_launch", no_launch)
    assert main(["--launcher", "spawn", *argv]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert out.startswith(f"error: {message}"), out
    assert out.count("\n") == 1, out  # one line


def test_dispatcher_and_experts_names_come_from_the_registries(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_launch", lambda *args: pytest.fail("a run was started"))
    main(["--launcher", "spawn", "--dispatcher", "nope"])
    named = capsys.readouterr().out
    for name in DISPATCHERS.names():
        assert name in named


def test_output_check_leaves_no_file_behind(tmp_path, monkeypatch):
    """The writability probe creates the file only to delete it again (an existing file is
    neither truncated nor deleted)."""
    report, kept = tmp_path / "r.json", tmp_path / "keep.json"
    kept.write_text("old")
    monkeypatch.setattr(cli, "_launch", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["--launcher", "spawn", "--json", str(report)]) == EXIT_INTERRUPTED
    assert not report.exists()
    assert main(["--launcher", "spawn", "--json", str(kept)]) == EXIT_INTERRUPTED
    assert kept.read_text() == "old"


def test_every_option_has_help_text():
    """``--help`` explains every option (argparse prints nothing for an option without help)."""
    missing = [
        action.option_strings
        for action in cli.build_parser()._actions
        if action.option_strings and not (action.help or "").strip()
    ]
    assert not missing
