"""Shard-aware checkpoint loading in one process: a model written by transformers'
``save_pretrained`` (sharded, both expert formats; one file) loaded back generates the unpatched
model's tokens; which tensors each rank of a larger world would read (the plan, checked against
names worked out from the checkpoint alone); damaged checkpoints refused naming the tensor and
the file; progress; the launcher's ``--hf-model DIR`` refusals (its sharded run, piped, is in
tests/launch/test_launch_output.py). The multi-rank loads are in
tests/multigpu/test_checkpoint_loading.py."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from ep_runtime import EPInputError
from ep_runtime.integrations.transformers import (
    RANDOM_MODELS,
    build_random_model,
    greedy_generate,
    random_config,
)
from tests.support.checkpoint_files import (
    INDEX,
    add_tensor,
    cast_tensor,
    drop_tensor,
    expected_reads,
    numel,
    reshape_tensor,
    set_values,
    weight_map,
    write_checkpoint,
)
from tests.support.hf_oracle import hf_greedy, model_eos, needs_transformers

pytestmark = needs_transformers
SEED = 5
PROMPT = [7, 100, 3, 45, 250, 9]
NAN, INF = float("nan"), float("inf")
EXPERT_3 = "model.layers.2.mlp.experts.3.up_proj.weight"  # qwen3-moe: [I, H], rank 0's of 2


@pytest.fixture(scope="module")
def references() -> dict[str, torch.nn.Module]:
    return {arch: build_random_model(random_config(arch), seed=SEED) for arch in RANDOM_MODELS}


def load(path: Path, **options):
    from ep_runtime.integrations.checkpoint import load_sharded

    return load_sharded(path, dtype=torch.float32, dispatcher="torch_a2a", **options)


def assert_generates_like(reference: torch.nn.Module, loaded) -> None:
    eos = model_eos(reference)
    tokens, _ = hf_greedy(reference, PROMPT, 5, eos)
    result = greedy_generate(loaded.model, loaded.patch, PROMPT, 5, eos_token_id=eos)
    assert result.tokens == tokens


@pytest.mark.parametrize("original", [True, False], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", RANDOM_MODELS)
def test_a_saved_model_loads_back_and_generates_its_tokens(
    tmp_path: Path, references, arch: str, original: bool
) -> None:
    reference = references[arch]
    path = write_checkpoint(reference, tmp_path, original=original)
    assert len(set(weight_map(path).values())) >= 3  # several shards and the index
    loaded = load(path)
    assert_generates_like(reference, loaded)
    reads = {r.name: r.rows for r in loaded.load.reads}
    assert len(reads) == len(loaded.load.reads)  # no tensor read twice
    assert reads == expected_reads(path, range(12))  # a world of one reads everything
    assert loaded.load.bytes_read == loaded.load.checkpoint_bytes
    assert loaded.load.ignored == ()


def test_the_per_expert_names_are_what_transformers_writes(tmp_path: Path, references) -> None:
    """transformers 5.x writes the repositories' own per-expert names (Mixtral: w1/w2/w3 under
    block_sparse_moe) by default, and its fused in-memory names with save_original_format=False."""
    write_checkpoint(references["mixtral"], tmp_path / "o")
    write_checkpoint(references["qwen3-moe"], tmp_path / "q", original=False)
    mixtral, qwen = weight_map(tmp_path / "o"), weight_map(tmp_path / "q")
    assert "model.layers.1.block_sparse_moe.experts.11.w3.weight" in mixtral
    assert "model.layers.1.block_sparse_moe.gate.weight" in mixtral
    assert "model.layers.0.mlp.experts.gate_up_proj" in qwen
    assert not any(re.search(r"experts\.\d+\.", name) for name in qwen)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("original", [True, False], ids=["per-expert", "fused"])
def test_each_rank_plans_exactly_the_dense_part_and_its_experts(
    tmp_path: Path, references, original: bool, world_size: int
) -> None:
    from ep_runtime.integrations.checkpoint import build_empty_model, plan_load
    from ep_runtime.integrations.safetensors_index import CheckpointIndex

    reference = references["deepseek-v3"]
    path = write_checkpoint(reference, tmp_path, original=original)
    index = CheckpointIndex.open(path)
    model = build_empty_model(reference.config, torch.float32)
    shard = 12 // world_size
    for rank in range(world_size):
        plan = plan_load(model, index, rank, world_size)
        local = range(rank * shard, (rank + 1) * shard)
        assert plan.local == tuple(local)
        planned = {d.info.name: None for d in plan.dense}
        for block in plan.experts.values():
            rows = None if block.fused is None else (local.start, local.stop)
            planned.update({t.name: rows for t in block.tensors(plan.local)})
        assert planned == expected_reads(path, local)


@pytest.mark.parametrize("original", [True, False], ids=["per-expert", "fused"])
def test_replicated_experts_are_read_once_and_copied_into_each_slot(
    tmp_path: Path, references, original: bool
) -> None:
    """A block's experts read for a placement with redundant slots (experts 5, 1, 2, 5 on one
    rank): each distinct expert read once (fused: one read per run of consecutive experts)."""
    from ep_runtime.integrations.checkpoint import build_empty_model, plan_load
    from ep_runtime.integrations.safetensors_index import CheckpointIndex, TensorReader

    reference = references["qwen3-moe"]
    path = write_checkpoint(reference, tmp_path, original=original)
    index = CheckpointIndex.open(path)
    model = build_empty_model(reference.config, torch.float32)
    slots = (5, 1, 2, 5)
    plan = plan_load(model, index, 0, 1)
    block = "model.layers.0.mlp"
    reader = TensorReader(index, 0, 1, 1, progress=lambda _: None)
    hf = reference.get_submodule(block).experts
    w13, w2 = plan.experts[block].read(slots, reader, torch.device("cpu"), torch.float32)
    assert torch.equal(w13, hf.gate_up_proj[list(slots)])
    assert torch.equal(w2, hf.down_proj[list(slots)])
    reads = sorted((r.name, r.rows) for r in reader.reads)
    prefix = f"{block}.experts."
    if original:
        projections = ("gate_proj", "up_proj", "down_proj")
        expected = [(f"{prefix}{e}.{p}.weight", None) for e in (1, 2, 5) for p in projections]
    else:
        runs = ((1, 3), (5, 6))
        expected = [(prefix + p, rows) for p in ("gate_up_proj", "down_proj") for rows in runs]
    assert reads == sorted(expected)


def test_a_single_file_loads_with_its_config_beside_it_or_given(tmp_path: Path, references):
    reference = references["qwen3-moe"]
    write_checkpoint(reference, tmp_path / "one", shard_size="1GB")
    single = tmp_path / "one" / "model.safetensors"
    assert single.is_file() and not (tmp_path / "one" / "model.safetensors.index.json").exists()
    assert_generates_like(reference, load(tmp_path / "one"))  # the directory
    assert_generates_like(reference, load(single))  # the file, config.json beside it
    moved = tmp_path / "elsewhere.safetensors"
    shutil.move(single, moved)
    assert_generates_like(reference, load(moved, config=tmp_path / "one"))


def test_tied_embeddings_load_once_under_both_names(tmp_path: Path) -> None:
    reference = build_random_model(random_config("qwen3-moe", tie_word_embeddings=True), seed=1)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    path = write_checkpoint(reference, tmp_path)
    assert "lm_head.weight" not in weight_map(path)
    loaded = load(path)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert_generates_like(reference, loaded)


# damaged checkpoints ------------------------------------------------------------------------------
def refusal(path: Path) -> str:
    with pytest.raises(EPInputError) as caught:
        load(path)
    return str(caught.value)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_a_missing_expert_tensor_is_named_with_the_index(tmp_path: Path, references, arch: str):
    path = write_checkpoint(references[arch], tmp_path)
    down = ("down_proj", "w2")
    name = next(n for n in weight_map(path) if ".experts.7." in n and n.split(".")[-2] in down)
    drop_tensor(path, name)
    message = refusal(path)
    assert name in message and str(path / "model.safetensors.index.json") in message
    assert "missing" in message and "expert 7 of 12" in message


def test_a_tensor_the_index_lists_but_its_file_lacks_is_named_with_the_file(
    tmp_path: Path, references
) -> None:
    path = write_checkpoint(references["deepseek-v2"], tmp_path)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    shard = drop_tensor(path, name, from_index=False)
    message = refusal(path)
    assert name in message and str(shard) in message and "missing" in message


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.mlp.experts.11.gate_proj.weight", "model.layers.0.self_attn.o_proj.weight"],
)
def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(
    tmp_path: Path, references, name: str
) -> None:
    path = write_checkpoint(references["deepseek-v3"], tmp_path)
    shape = list(references["deepseek-v3"].state_dict().get(name, torch.empty(32, 64)).shape)
    shard = reshape_tensor(path, name)
    message = refusal(path)
    assert name in message and str(shard) in message, message
    assert f"shape {shape}" in message and f"shape {[shape[0] - 1, *shape[1:]]}" in message


def test_a_missing_dense_tensor_is_named(tmp_path: Path, references) -> None:
    path = write_checkpoint(references["mixtral"], tmp_path)
    drop_tensor(path, "model.layers.1.block_sparse_moe.gate.weight")
    message = refusal(path)
    # named as the original checkpoints spell it (the model calls it model.layers.1.mlp.gate)
    assert "model.layers.1.block_sparse_moe.gate.weight" in message and "missing" in message


def test_an_fp8_tensor_is_refused_with_the_reason(tmp_path: Path, references) -> None:
    path = write_checkpoint(references["deepseek-v3"], tmp_path)
    name = "model.layers.2.mlp.experts.0.down_proj.weight"
    shard = cast_tensor(path, name, torch.float8_e4m3fn)
    message = refusal(path)
    assert name in message and str(shard) in message and "no fp8 weight path" in message


@pytest.mark.parametrize(
    ("original", "name", "what"),
    [
        (True, EXPERT_3, "expert 3 of 12"),
        (False, "model.layers.0.mlp.experts.gate_up_proj", "the fused experts"),
        (True, "model.norm.weight", "a tensor"),
    ],
    ids=["per-expert", "fused", "dense"],
)
def test_an_integer_tensor_where_the_model_has_floats_is_refused_naming_it(
    tmp_path: Path, references, original: bool, name: str, what: str
) -> None:
    """An int32 expert was cast to the model's dtype and served as weights."""
    path = write_checkpoint(references["qwen3-moe"], tmp_path, original=original)
    shard = cast_tensor(path, name, torch.int32)
    assert refusal(path) == (
        f"checkpoint tensor {name} in {shard}: expected {what} in a floating-point dtype "
        "(BF16, F16, F32, F64, F8_E4M3, F8_E5M2), given I32"
    )


FUSED_UP = "model.layers.0.mlp.experts.gate_up_proj"  # [E, 2I, H]
FUSED_DOWN = "model.layers.2.mlp.experts.down_proj"  # [E, H, I]


@pytest.mark.parametrize(
    ("original", "name", "value", "at", "expected"),
    [  # expected: NaN and Inf counted by hand, and the experts (fused rows) holding them
        (True, EXPERT_3, NAN, slice(None), ("all", 0, [])),
        (True, EXPERT_3, INF, (1, 2), (0, 1, [])),
        (False, FUSED_DOWN, -INF, (5, 0, 3), (0, 1, [5])),
        (False, FUSED_UP, NAN, slice(7, 9), ("2 of 12 rows", 0, [7, 8])),
        (True, "model.norm.weight", NAN, 4, (1, 0, [])),
    ],
    ids=["nan-expert", "inf-expert", "inf-fused", "nan-fused-rows", "nan-dense"],
)
def test_nan_or_inf_values_are_refused_naming_the_tensor_and_counting_them(
    tmp_path: Path, references, original: bool, name: str, value: float, at, expected
) -> None:
    """They ran: the output wrong (exit 1, blamed on EP) or, unrouted, not noticed at all."""
    path = write_checkpoint(references["qwen3-moe"], tmp_path, original=original)
    shard = set_values(path, name, value, at)
    values = numel(path, name)
    nan, inf, experts = expected
    nan = {"all": values, "2 of 12 rows": 2 * values // 12}.get(nan, nan)
    where = f" (in experts {experts})" if experts else ""
    assert refusal(path) == (
        f"checkpoint tensor {name} in {shard}: expected finite values (as loaded in float32), "
        f"given {nan} NaN and {inf} Inf among its {values} values{where}"
    )


def test_the_value_check_reads_each_tensor_once_and_counts_nothing_when_clean(
    tmp_path: Path, references
) -> None:
    from ep_runtime.integrations.safetensors_index import all_finite

    loaded = load(write_checkpoint(references["mixtral"], tmp_path))
    assert len({r.name for r in loaded.load.reads}) == len(loaded.load.reads)
    for tensor in (torch.ones(3), torch.empty(0), torch.arange(4)):
        assert all_finite(tensor)
    for value in (NAN, INF, -INF):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            tensor = torch.zeros(1000, dtype=dtype)
            tensor[999] = value
            assert not all_finite(tensor) and not all_finite(tensor.view(10, 100).t())


def test_a_checkpoint_tensor_the_model_has_no_place_for_is_reported_not_read(
    tmp_path: Path, references
) -> None:
    path = write_checkpoint(references["qwen3-moe"], tmp_path)
    extra = "model.layers.3.mtp.weight"  # e.g. DeepSeek-V3's multi-token-prediction layer
    add_tensor(path, extra, torch.ones(4, 4))
    loaded = load(path)
    assert loaded.load.ignored == (extra,)
    assert extra not in {r.name for r in loaded.load.reads}


def test_a_path_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    from ep_runtime.integrations.safetensors_index import CheckpointIndex

    with pytest.raises(EPInputError, match=re.escape("model.safetensors.index.json")):
        CheckpointIndex.open(tmp_path)


# progress -----------------------------------------------------------------------------------------
def test_progress_counts_up_to_what_the_rank_reads(tmp_path: Path, references) -> None:
    path = write_checkpoint(references["mixtral"], tmp_path)
    seen = []
    loaded = load(path, progress=seen.append)
    assert [p.done for p in seen] == [False] * (len(seen) - 1) + [True]
    read = [p.bytes_read for p in seen]
    assert read == sorted(read) and read[-1] == seen[-1].bytes_total == loaded.load.bytes_read
    assert seen[-1].tensors_read == seen[-1].tensors_total == len(loaded.load.reads)


def test_the_default_printer_prints_at_most_every_interval(capsys) -> None:
    from ep_runtime.integrations.safetensors_index import LoadProgress, ProgressPrinter

    printer = ProgressPrinter(interval_s=5.0)
    for elapsed in (1.0, 3.0, 6.0, 8.0, 10.5, 12.0):
        printer(LoadProgress(0, int(elapsed * 1e9), 20 * 10**9, 1, 2, elapsed, done=False))
    printer(LoadProgress(0, 20 * 10**9, 20 * 10**9, 2, 2, 13.0, done=True))
    lines = capsys.readouterr().err.splitlines()
    ends = [line.split(", ")[-1] for line in lines]
    assert ends == ["6 s (1000 MB/s)", "12 s (1000 MB/s)", "done"]
    assert lines[0].startswith("[rank 0] checkpoint: 6.00 of 20.00 GB, 1/2 tensors")
    quiet = ProgressPrinter(interval_s=5.0)  # a short load prints nothing, not even "done"
    quiet(LoadProgress(0, 1, 1, 1, 1, 0.5, done=True))
    assert capsys.readouterr().err == ""


# the launcher -------------------------------------------------------------------------------------
def _no_launch(*args):
    raise AssertionError("a rank was started")


@pytest.mark.parametrize("damage", ["missing shard", "integer expert", "missing tensor"])
def test_the_launcher_checks_the_checkpoint_before_any_rank_starts(
    tmp_path: Path, references, capsys, monkeypatch, damage: str
) -> None:
    """Issue 47: a missing shard was found only once Ray and the ranks had started (10.8 s);
    now the launcher's own checks find it, with every other metadata fault, before (the default
    launcher, Ray, is never reached: ``_launch`` fails the test if called)."""
    from ep_runtime.launch import cli

    monkeypatch.setattr(cli, "_launch", _no_launch)
    path = write_checkpoint(references["qwen3-moe"], tmp_path)
    shard, index = path / weight_map(path)[EXPERT_3], path / INDEX
    if damage == "missing shard":
        shard.unlink()
        line = f"checkpoint file {shard.name}: expected a file named in {index}, given missing"
    elif damage == "integer expert":
        cast_tensor(path, EXPERT_3, torch.int32)
        line = (
            f"checkpoint tensor {EXPERT_3} in {shard}: expected expert 3 of 12 in a "
            "floating-point dtype (BF16, F16, F32, F64, F8_E4M3, F8_E5M2), given I32"
        )
    else:
        drop_tensor(path, EXPERT_3)
        line = (
            f"checkpoint tensor {EXPERT_3}: expected expert 3 of 12 of shape [32, 64] in "
            f"{index}, given missing"
        )
    assert cli.main(["--dp", "2", "--device", "cpu", "--hf-model", str(path)]) == cli.EXIT_USAGE
    assert capsys.readouterr().out.splitlines() == [f"error: {line}"]


def test_the_launcher_refuses_a_directory_without_a_config(tmp_path: Path, capsys, monkeypatch):
    from ep_runtime.launch import cli

    monkeypatch.setattr(cli, "_launch", _no_launch)
    assert cli.main(["--device", "cpu", "--hf-model", str(tmp_path)]) == cli.EXIT_USAGE
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith(
        f"error: --hf-model: expected a checkpoint directory with a transformers config.json, "
        f"given '{tmp_path}' ("
    ), line


def test_the_launcher_refuses_nan_and_inf_weights_naming_them_exit_2(
    tmp_path: Path, references, capsys
) -> None:
    """Before: exit 1, "a rank's output was wrong" (or exit 0 where no token was routed to the
    bad expert). A NaN expert on rank 1 and one Inf in an expert of rank 0: one line, exit 2,
    naming rank 0's tensor first (its file, the count) and rank 1's after it, whichever rank's
    error the launcher reports (every rank raises the same)."""
    from ep_runtime.launch.cli import EXIT_USAGE, main

    path = write_checkpoint(references["qwen3-moe"], tmp_path)
    nan_name = "model.layers.2.mlp.experts.9.down_proj.weight"  # expert 9: rank 1's of 2
    set_values(path, nan_name, NAN)
    shard = set_values(path, EXPERT_3, INF, (1, 2))
    argv = ["--launcher", "spawn", "--dp", "2", "--device", "cpu", "--hf-model", str(path)]
    assert main(argv) == EXIT_USAGE
    errors = [line for line in capsys.readouterr().out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: rank "), errors
    assert errors[0].endswith(
        f"EPInputError: checkpoint tensor {EXPERT_3} in {shard}: expected finite values (as "
        f"loaded in float32), given 0 NaN and 1 Inf among its 2048 values; NaN or Inf in 1 "
        f"more: {nan_name}"
    ), errors[0]
