"""Sharded checkpoints loaded on real ranks: each rank reads only the dense part and its own
experts (counted by name against names worked out from the checkpoint alone), generates the
unpatched model's tokens, stays within dense + E/W experts of resident memory, and a damaged
checkpoint fails every rank with the same named error: before any rank communicates for a fault
in the metadata, once the ranks have shared what they read for NaN or Inf values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ep_runtime.integrations.transformers import build_random_model, random_config
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.checkpoint_cases import (
    group_still_works,
    load_and_generate_on_rank,
    load_and_measure_memory_on_rank,
    load_on_rank,
)
from tests.multigpu.pool import RankFailure, RankPool
from tests.support.checkpoint_files import (
    drop_tensor,
    expected_reads,
    reshape_tensor,
    set_values,
    write_checkpoint,
)
from tests.support.hf_oracle import hf_greedy, model_eos, moe_shape, needs_transformers

pytestmark = needs_transformers

ARCHITECTURES = ("qwen3-moe", "mixtral", "deepseek-v3", "deepseek-v2")
SEED = 11
REQUESTS = {2: [(4, 5), (7, 3)], 3: [(5, 4), (None, 0), (3, 6)]}  # (prompt length, new tokens)


def prompts_for(world_size: int, vocab: int) -> tuple[list[list[int] | None], list[int]]:
    prompts: list[list[int] | None] = []
    for rank, (length, _) in enumerate(REQUESTS[world_size]):
        generator = torch.Generator().manual_seed(200 + rank)
        ids = None if length is None else torch.randint(0, vocab, (length,), generator=generator)
        prompts.append(None if ids is None else ids.tolist())
    return prompts, [n for _, n in REQUESTS[world_size]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, bool], tuple[torch.nn.Module, Path]]:
    """(architecture, per-expert format) → (the unpatched model, its sharded checkpoint)."""
    made = {}
    for arch in ARCHITECTURES:
        model = build_random_model(random_config(arch), seed=SEED)
        for original in (True, False):
            directory = tmp_path_factory.mktemp(f"{arch}-{'orig' if original else 'fused'}")
            made[arch, original] = model, write_checkpoint(model, directory, original=original)
    return made


# the per-expert format (what the repositories ship) at W = 2 and 3; the fused one's row reads at 2
@pytest.mark.parametrize(
    ("original", "world_size"), [(True, 2), (True, 3), (False, 2)], ids=["2", "3", "fused-2"]
)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ranks_read_their_part_and_generate_the_unpatched_tokens(
    pool_factory, checkpoints, arch: str, original: bool, world_size: int
) -> None:
    reference, path = checkpoints[arch, original]
    eos = model_eos(reference)
    prompts, new_tokens = prompts_for(world_size, reference.config.vocab_size)
    pool = pool_factory(world_size)
    experts = "auto" if pool.backend == "nccl" else "grouped_mm"
    results = pool.run_ok(load_and_generate_on_rank, str(path), prompts, new_tokens, eos, experts)
    num_experts, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    shard = num_experts // world_size
    for rank, result in enumerate(results):
        local = range(rank * shard, (rank + 1) * shard)
        assert result["local_experts"] == (local.start, local.stop)
        reads = dict(result["reads"])
        assert len(reads) == len(result["reads"]), f"rank {rank} read a tensor twice"
        assert reads == expected_reads(path, local), f"rank {rank}"
        expert_bytes = sum(
            p.numel() * 4 for n, p in reference.named_parameters() if ".experts." in n
        )
        assert result["held_expert_bytes"] * world_size == expert_bytes
        if prompts[rank] is None:
            assert result["tokens"] == []
            continue
        tokens, logits = hf_greedy(reference, prompts[rank], new_tokens[rank], eos)
        assert result["tokens"] == tokens, f"rank {rank}: {result['tokens']} != {tokens}"
        comparison = compare_per_token(result["logits"], logits, tolerance)
        assert comparison.passed, f"rank {rank}: {comparison.describe()}"
    everything = expected_reads(path, range(num_experts))
    assert {n for r in results for n, _ in r["reads"]} == set(everything)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("damage", ["missing expert", "wrong shape", "NaN on the last rank"])
def test_a_damaged_checkpoint_fails_every_rank_with_the_named_error(
    pool_factory, tmp_path: Path, damage: str, world_size: int
) -> None:
    """Metadata faults raise before any collective; a NaN only the last rank reads (only it
    checks that tensor's values) is shared: every rank raises the same error, still in step."""
    path = write_checkpoint(build_random_model(random_config("qwen3-moe"), seed=SEED), tmp_path)
    name = "model.layers.2.mlp.experts.1.up_proj.weight"  # expert 1: rank 0's at W = 2 and 3
    if damage == "missing expert":
        drop_tensor(path, name)
        where = str(path / "model.safetensors.index.json")
    elif damage == "wrong shape":
        where = str(reshape_tensor(path, name))
    else:
        name = "model.layers.2.mlp.experts.11.up_proj.weight"  # the last rank's at W = 2 and 3
        where = f"{set_values(path, name, float('nan'))}: expected finite values"
    pool = pool_factory(world_size)
    results = pool.run(load_on_rank, str(path), timeout_s=60)
    assert all(isinstance(r, RankFailure) for r in results), results
    assert {r.type_name for r in results} == {"EPInputError"}
    assert len({r.message for r in results}) == 1, [r.message for r in results]
    assert name in results[0].message and where in results[0].message, results[0].message
    # every rank raised at the same point: the group is still in step
    assert pool.run_ok(group_still_works) == [world_size] * world_size


def test_rank_memory_is_the_dense_part_and_its_experts(tmp_path: Path) -> None:
    """64 experts of 3 MiB in each of 2 MoE layers (384 MiB of experts; fp32): a rank of 2
    must stay within dense + its 32 experts per layer + the slack below, well under the model.
    Measured on the CPU machine: both ranks' peak grew 228 MiB (dense 1 MiB + experts 192 MiB
    + 35 MiB), bound 247 MiB, the checkpoint 385 MiB; 196 MiB stay after the load."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=256,
        moe_intermediate_size=1024,
        num_hidden_layers=2,
        num_experts=64,
        num_experts_per_tok=4,
        tie_word_embeddings=False,
    )
    path = write_checkpoint(build_random_model(config, seed=1), tmp_path, shard_size="40MB")
    # the pages a rank touched of the shard it has open stay mapped until it closes it (at most
    # one shard file), and 16 MiB for the allocator, the EP layers' buffers and the rest
    slack = max(f.stat().st_size for f in path.glob("*.safetensors")) + 16 * 2**20
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset a process's peak resident size")
    pool = RankPool(2)
    try:
        results = pool.run_ok(load_and_measure_memory_on_rank, str(path), config, timeout_s=300)
    finally:
        pool.close()
    for rank, result in enumerate(results):
        bound = result["dense_bytes"] + result["expert_bytes"] + slack
        grown = result["peak"] - result["before"]
        assert result["expert_bytes"] * 2 == result["checkpoint_bytes"] - result["dense_bytes"]
        assert result["held_expert_bytes"] == result["expert_bytes"]
        assert bound < result["checkpoint_bytes"]  # the bound tells a whole-model load apart
        assert grown <= bound, (
            f"rank {rank}: peak RSS grew {grown / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB "
            f"(dense {result['dense_bytes'] / 2**20:.1f} + experts "
            f"{result['expert_bytes'] / 2**20:.0f} + slack {slack / 2**20:.0f}); {result}"
        )
