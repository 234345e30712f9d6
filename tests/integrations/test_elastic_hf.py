"""The parts of elastic transformers models that need no group: the KV-cache rollback of a forward
that failed part-way and of a step another survivor did not finish, the expert sources a recovery
reads (a checkpoint's: only the experts asked for; the seeded random model's), and the refusal of
an ``expert_source`` without ``elastic``. The group run (a rank SIGKILLed mid-generation) is
tests/multigpu/test_elastic_hf_generation.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ep_runtime import EPInputError
from ep_runtime.integrations.transformers import (
    EPMoEBlock,
    RandomExpertSource,
    build_random_model,
    greedy_generate,
    patch_moe_blocks,
    random_config,
)
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support.checkpoint_files import set_values, write_checkpoint
from tests.support.hf_oracle import hf_greedy, moe_shape, needs_transformers

pytestmark = needs_transformers
SEED = 4
PROMPT = [7, 100, 3, 45, 250, 9]
BLOCK = "model.layers.2.mlp"  # qwen3-moe's second MoE block (layer 1 is dense)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return build_random_model(random_config("qwen3-moe"), seed=SEED)


class Interrupted(RuntimeError):
    pass


def decode_with_a_failed_step(model: torch.nn.Module, steps: int, crop: bool) -> torch.Tensor:
    """Greedy logits ``[steps, V]`` where the second step's first forward fails as layer 1's
    MLP starts (layers 0 and 1 have appended to the KV cache, layer 2 has not) and is run again,
    its cache cropped back first (``crop``) or not (the negative control)."""
    from ep_runtime.integrations.transformers.generation import _cache_lengths, _crop

    def fail(*_: object) -> None:
        raise Interrupted

    ids, cache, rows = torch.tensor([PROMPT]), None, []
    with torch.no_grad():
        for step in range(steps):
            if step == 1:
                lengths = _cache_lengths(cache)
                hook = model.model.layers[1].mlp.register_forward_pre_hook(fail)
                with pytest.raises(Interrupted):
                    model(input_ids=ids, cache=cache, use_cache=True)
                hook.remove()
                assert [layer.get_seq_length() for layer in cache.layers] == [
                    lengths[0] + 1,
                    lengths[1] + 1,
                    lengths[2],
                ]
                if crop:
                    _crop(cache, lengths)
            output = model(input_ids=ids, cache=cache, use_cache=True)
            cache = output.cache
            rows.append(output.logits[0, -1].float())
            ids = rows[-1].argmax().view(1, 1)
    return torch.stack(rows)


def test_a_failed_forwards_cache_entries_are_cropped_layer_by_layer(reference) -> None:
    tokens, expected = hf_greedy(reference, PROMPT, 4, [])
    _, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    cropped = decode_with_a_failed_step(reference, 4, crop=True)
    assert cropped.argmax(-1).tolist() == tokens
    assert compare_per_token(cropped, expected, tolerance).passed
    kept = decode_with_a_failed_step(reference, 4, crop=False)  # negative control
    assert not compare_per_token(kept, expected, tolerance).passed


@pytest.mark.parametrize("done", [1, 3], ids=["prefill", "decode"])
def test_a_step_another_survivor_did_not_finish_is_undone_and_run_again(
    reference, done: int
) -> None:
    """After a recovery the survivors go back to the last step all of them completed: here
    this rank finished step ``done``, another survivor failed inside it (``least``)."""
    from ep_runtime.integrations.transformers.generation import _Decoder

    model = copy.deepcopy(reference)
    report = patch_moe_blocks(model, dispatcher="torch_a2a")
    decoder = _Decoder(model, report, torch.tensor(PROMPT), 5, set())
    with torch.no_grad():
        for _ in range(done):
            assert decoder.step(None)
        report.least = lambda steps: steps - 1
        decoder.resume()
        assert (decoder.steps, len(decoder.tokens), decoder.retried_steps) == (done - 1,) * 2 + (2,)
        while decoder.step(None):
            pass
    tokens, expected = hf_greedy(reference, PROMPT, 5, [])
    assert decoder.tokens == tokens and decoder.steps == 5
    _, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    assert compare_per_token(torch.stack(decoder.rows), expected, tolerance).passed


def _checkpoint_source(path: Path, world_size: int):
    from ep_runtime.integrations.checkpoint import build_empty_model, plan_load
    from ep_runtime.integrations.checkpoint_experts import CheckpointExpertSource
    from ep_runtime.integrations.safetensors_index import CheckpointIndex

    index = CheckpointIndex.open(path)
    model = build_empty_model(random_config("qwen3-moe"), torch.float32)
    plan = plan_load(model, index, 0, world_size)
    return CheckpointExpertSource(index, plan.experts, 0, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("original", [True, False], ids=["per-expert", "fused"])
def test_the_checkpoint_source_reads_only_the_experts_asked_for(
    tmp_path: Path, reference, original: bool
) -> None:
    """Rank 0 of 3 holds experts 0-3; a recovery asks it for 7, 4 and 7 again (a replica)."""
    source = _checkpoint_source(write_checkpoint(reference, tmp_path, original=original), 3)
    w13, w2 = source(BLOCK, [7, 4, 7])
    hf = reference.get_submodule(BLOCK).experts
    assert torch.equal(w13, hf.gate_up_proj[[7, 4, 7]])
    assert torch.equal(w2, hf.down_proj[[7, 4, 7]])
    prefix = f"{BLOCK}.experts."
    if original:
        projections = ("gate_proj", "up_proj", "down_proj")
        expected = [(f"{prefix}{e}.{p}.weight", None) for e in (4, 7) for p in projections]
    else:  # one read per run of consecutive experts: rows 4 and 7 apart
        runs = ((4, 5), (7, 8))
        expected = [(prefix + p, rows) for p in ("gate_up_proj", "down_proj") for rows in runs]
    assert sorted((r.name, r.rows) for r in source.reads) == sorted(expected)


def test_a_nan_in_an_expert_a_recovery_reads_is_named_and_others_still_read(
    tmp_path: Path, reference
) -> None:
    path = write_checkpoint(reference, tmp_path)
    name = f"{BLOCK}.experts.7.up_proj.weight"
    shard = set_values(path, name, float("nan"), (0, 1))
    source = _checkpoint_source(path, 3)
    with pytest.raises(EPInputError, match=f"checkpoint tensor {name} in {shard}: .* 1 NaN"):
        source(BLOCK, [4, 7])
    w13, _ = source(BLOCK, [4, 5])  # the NaN expert is not read
    assert torch.equal(w13, reference.get_submodule(BLOCK).experts.gate_up_proj[[4, 5]])


def test_the_random_source_gives_the_seeded_models_experts_in_its_dtype() -> None:
    config = random_config("qwen3-moe")
    seeded = build_random_model(config, seed=SEED, dtype=torch.bfloat16)
    w13, w2 = RandomExpertSource(config, seed=SEED, dtype=torch.bfloat16)(BLOCK, [9, 2])
    hf = seeded.get_submodule(BLOCK).experts
    assert w13.dtype == torch.bfloat16
    assert torch.equal(w13, hf.gate_up_proj[[9, 2]]) and torch.equal(w2, hf.down_proj[[9, 2]])


def test_an_expert_source_without_elastic_is_refused_before_anything_is_patched(
    reference,
) -> None:
    model = copy.deepcopy(reference)
    with pytest.raises(EPInputError, match="expert_source: expected None without elastic="):
        patch_moe_blocks(model, expert_source=RandomExpertSource(model.config, seed=SEED))
    assert not any(isinstance(m, EPMoEBlock) for m in model.modules())
    report = patch_moe_blocks(model, dispatcher="torch_a2a")  # not elastic: nothing recovered
    result = greedy_generate(model, report, PROMPT, 2)
    assert report.elastic is None and report.recover() is None
    assert (result.recoveries, result.lost_ranks, result.retried_steps) == ((), (), 0)
