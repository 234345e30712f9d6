"""The transformers integration in one process (a world of 1): every supported block's output
and routing against the HF block's own, generation against transformers' ``generate`` on the
unpatched model, what patching keeps and frees, and the refusals (each naming what it refuses).
The multi-rank runs are in tests/multigpu/test_hf_generation.py."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from ep_runtime import EPInputError, route
from ep_runtime.integrations.transformers import (
    RANDOM_MODELS,
    EPMoEBlock,
    UnsupportedMoEBlockError,
    build_random_model,
    find_moe_blocks,
    greedy_generate,
    patch_moe_blocks,
    random_config,
)
from ep_runtime.routing import GroupScoring
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support.hf_oracle import hf_greedy, moe_shape, needs_transformers, routed_expert_numel

pytestmark = needs_transformers


def patched_pair(arch: str, dtype: torch.dtype = torch.float32, **overrides):
    """(unpatched model, patched copy, patch report), same seeded weights."""
    reference = build_random_model(random_config(arch, **overrides), seed=1, dtype=dtype)
    model = copy.deepcopy(reference)
    return reference, model, patch_moe_blocks(model, dispatcher="torch_a2a")


def by_expert_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' ids ascending, weights along (HF's DeepSeek routers return ids unsorted)."""
    ordered, order = ids.long().sort(dim=-1)
    return ordered, weights.float().gather(1, order)


def route_as_settings(logits: torch.Tensor, block: EPMoEBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """``route()`` with the arguments read from the block's HF router (its ``RouterSettings``)."""
    settings = block.router
    ids, weights = route(
        logits,
        settings.top_k,
        scoring=settings.scoring,
        renormalize=settings.renormalize,
        correction_bias=block.gate.e_score_correction_bias
        if settings.uses_correction_bias
        else None,
        num_expert_groups=settings.num_expert_groups,
        num_topk_groups=settings.num_topk_groups,
        group_scoring=settings.group_scoring,
        routed_scaling_factor=settings.routed_scaling_factor,
    )
    if settings.weights_in_logits_dtype:
        weights = weights.to(logits.dtype).float()
    return ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", RANDOM_MODELS)
def test_block_output_and_routing_match_the_hf_block(arch: str, dtype: torch.dtype) -> None:
    reference, _, report = patched_pair(arch, dtype)
    _, hidden, intermediate = moe_shape(reference)
    x = torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
    hf_blocks = find_moe_blocks(reference)
    assert [b.name for b in report.blocks] == [name for name, _ in hf_blocks]
    for (_, hf_block), patched in zip(hf_blocks, report.blocks, strict=True):
        with torch.no_grad():  # inference, as EPMoE is forward-only
            expected, got = hf_block(x), patched.module(x)
        assert type(got) is type(expected) and got.shape == expected.shape
        assert got.dtype == expected.dtype
        comparison = compare_per_token(
            got.reshape(-1, hidden),
            expected.reshape(-1, hidden),
            tolerance_for(dtype, intermediate),
        )
        assert comparison.passed, comparison.describe()
        logits, hf_weights, hf_ids = hf_block.gate(x.reshape(-1, hidden))
        ids, weights = route_as_settings(logits, patched.module)
        hf_ids, hf_weights = by_expert_id(hf_ids, hf_weights)
        ids, weights = by_expert_id(ids, weights)
        assert torch.equal(ids, hf_ids)
        assert torch.equal(weights, hf_weights)  # route() reproduces the router bit for bit


@pytest.mark.parametrize("arch", RANDOM_MODELS)
def test_patch_keeps_the_rest_of_the_model_and_frees_the_hf_experts(arch: str) -> None:
    reference = build_random_model(random_config(arch), seed=1)
    model = copy.deepcopy(reference)
    hf_tensors = [weakref.ref(t) for _, b in find_moe_blocks(model) for t in b.experts.parameters()]
    report = patch_moe_blocks(model)
    gc.collect()
    assert all(ref() is None for ref in hf_tensors), "an HF expert tensor is still alive"
    kept = dict(model.named_parameters())
    expected = {
        name: p for name, p in reference.named_parameters() if ".experts." not in name
    }  # everything but the routed experts (router, shared experts, attention, ...) stays
    assert set(kept) == set(expected)  # same names: gate and shared_experts keep theirs
    for name, param in expected.items():
        assert torch.equal(kept[name], param), name
    assert report.held_expert_bytes() == routed_expert_numel(reference) * 4  # W = 1: all
    assert all(isinstance(b.module, EPMoEBlock) for b in report.blocks)
    assert report.expert_params_kept == report.expert_params_freed == routed_expert_numel(reference)


def test_generation_matches_transformers_generate_and_stops_at_eos() -> None:
    reference, model, report = patched_pair("qwen3-moe")
    prompt = [7, 100, 3, 42, 9]
    free_run, _ = hf_greedy(reference, prompt, 8, [])
    eos = free_run[3]  # a token the model emits: both loops must stop right after it
    expected_tokens, expected_logits = hf_greedy(reference, prompt, 8, [eos])
    assert expected_tokens[-1] == eos and len(expected_tokens) == free_run.index(eos) + 1
    result = greedy_generate(model, report, prompt, 8, eos_token_id=eos)
    assert result.tokens == expected_tokens
    _, hidden, intermediate = moe_shape(reference)
    comparison = compare_per_token(
        result.logits, expected_logits, tolerance_for(torch.float32, max(hidden, intermediate))
    )
    assert comparison.passed, comparison.describe()
    assert result.steps == len(expected_tokens) and result.idle_steps == 0
    assert 0 < result.moe_s < result.total_s


def test_a_wrong_router_setting_fails_the_logits_check() -> None:
    """Negative control: the same model with one block's router renormalisation flipped (the
    router module's own setting: the block uses its top-k) must fail."""
    reference, model, report = patched_pair("qwen3-moe")
    gate = report.blocks[0].module.gate
    gate.norm_topk_prob = not gate.norm_topk_prob
    prompt = [7, 100, 3, 42, 9]
    _, expected_logits = hf_greedy(reference, prompt, 1, [])
    result = greedy_generate(model, report, prompt, 1)
    comparison = compare_per_token(result.logits, expected_logits, tolerance_for(torch.float32))
    assert not comparison.passed, comparison.describe()


def test_no_request_runs_no_step_alone() -> None:
    _, model, report = patched_pair("deepseek-v3")
    result = greedy_generate(model, report, None, 5)
    assert result.tokens == [] and result.steps == 0 and result.logits.numel() == 0


def test_a_zero_token_step_runs_every_block() -> None:
    _, _, report = patched_pair("deepseek-v3")
    calls: list[str] = []
    for block in report.blocks:
        block.module.register_forward_hook(lambda m, a, out, n=block.name: calls.append(n))
    with torch.no_grad():
        report.forward_idle()
    assert calls == [b.name for b in report.blocks]


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_router_logits_are_still_recorded(arch: str) -> None:
    """The router module still runs on the rank: ``output_router_logits`` keeps working (the
    first layer's bit for bit; later ones carry the earlier MoE layers' rounding)."""
    reference, model, _ = patched_pair(arch)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = reference(ids, output_router_logits=True).router_logits
        got = model(ids, output_router_logits=True).router_logits
    assert len(got) == len(expected) > 0
    assert torch.equal(got[0], expected[0])
    _, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    for a, b in zip(got, expected, strict=True):
        assert compare_per_token(a, b, tolerance).passed


def test_an_unsupported_block_is_named_and_nothing_is_patched() -> None:
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = build_random_model(config)
    expected = (
        r"^model: expected sparse-MoE blocks of .*DeepseekV3MoE.*, "
        r"given Qwen2MoeSparseMoeBlock at 'model\.layers\.0\.mlp'$"
    )
    with pytest.raises(UnsupportedMoEBlockError, match=expected):
        patch_moe_blocks(model)
    assert not any(isinstance(m, EPMoEBlock) for m in model.modules())


def test_a_model_without_moe_blocks_is_refused() -> None:
    model = build_random_model(random_config("qwen3-moe", mlp_only_layers=[0, 1, 2]))
    with pytest.raises(UnsupportedMoEBlockError, match="a model with sparse-MoE blocks"):
        patch_moe_blocks(model)


def test_deepseek_v2_group_limited_routing_matches_the_hf_block() -> None:
    """DeepSeek-V2's "group_limited_greedy" (groups ranked by their best score): the block and
    ``route()`` with the settings read from the router both match transformers."""
    config = random_config(
        "deepseek-v2", topk_method="group_limited_greedy", n_group=4, topk_group=2
    )
    reference = build_random_model(config, seed=3)
    model = copy.deepcopy(reference)
    report = patch_moe_blocks(model)
    _, hidden, intermediate = moe_shape(reference)
    x = torch.randn(2, 7, hidden, generator=torch.Generator().manual_seed(1))
    for (_, hf_block), patched in zip(find_moe_blocks(reference), report.blocks, strict=True):
        assert patched.module.router.group_scoring is GroupScoring.MAX
        with torch.no_grad():
            expected, got = hf_block(x), patched.module(x)
            logits, hf_weights, hf_ids = hf_block.gate(x.reshape(-1, hidden))
        comparison = compare_per_token(
            got.reshape(-1, hidden),
            expected.reshape(-1, hidden),
            tolerance_for(x.dtype, intermediate),
        )
        assert comparison.passed, comparison.describe()
        ids, weights = by_expert_id(*route_as_settings(logits, patched.module))
        hf_ids, hf_weights = by_expert_id(hf_ids, hf_weights)
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
        top2_ids, _ = by_expert_id(
            *route(
                logits,
                patched.module.router.top_k,
                scoring="softmax",
                renormalize=False,
                num_expert_groups=4,
                num_topk_groups=2,
            )
        )
        assert not torch.equal(top2_ids, hf_ids), "the top-2-sum ranking chose the same: no test"


def test_experts_not_silu_are_refused() -> None:
    model = build_random_model(random_config("mixtral", hidden_act="gelu"))
    with pytest.raises(UnsupportedMoEBlockError, match=r"experts.act_fn: expected SiLU"):
        patch_moe_blocks(model)


def test_training_mode_is_refused() -> None:
    _, model, _ = patched_pair("mixtral")
    model.train()
    with pytest.raises(RuntimeError, match=r"inference-only.*model.eval\(\)"):
        model(torch.tensor([[1, 2, 3]]))


def test_bad_generation_arguments_are_named() -> None:
    _, model, report = patched_pair("mixtral")
    with pytest.raises(EPInputError, match=r"^max_new_tokens: expected an int >= 0, given -1"):
        greedy_generate(model, report, [1, 2], -1)
    with pytest.raises(EPInputError, match=r"^prompt: expected a 1-D sequence"):
        greedy_generate(model, report, [[1, 2]], 3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(cuda_graph_tokens=0), r"^cuda_graph_tokens: expected an int >= 1.*given 0"),
        (dict(cuda_graph_tokens=8), r"^cuda_graph_tokens: expected mode='capacity'.*'exact'"),
        (
            dict(cuda_graph_tokens=8, mode="capacity"),
            r"^cuda_graph_tokens: expected a CUDA device, given device=cpu",
        ),
    ],
    ids=["zero", "exact_mode", "cpu"],
)
def test_cuda_graph_option_is_refused_where_it_cannot_run(options, message) -> None:
    """Refused before any layer is built, naming the option, what it needs and what it got."""
    model = build_random_model(random_config("qwen3-moe"), seed=1)
    with pytest.raises(EPInputError, match=message):
        patch_moe_blocks(model, dispatcher="torch_a2a", **options)
    assert not any(isinstance(m, EPMoEBlock) for m in model.modules())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(max_tokens_per_rank=4, cuda_graph_tokens=8), r"<= max_tokens_per_rank \(4\)"),
        (dict(cuda_graph_tokens=300), r"<= max_tokens_per_rank \(256\)"),  # the default cap
        (dict(cuda_graph_tokens=8, num_redundant_experts=2), r"no expert load balancing"),
        (dict(cuda_graph_tokens=8, eplb_interval=4), r"no expert load balancing"),
        # the scaled_mm experts read the per-expert row counts on the host each forward
        (dict(cuda_graph_tokens=8, experts="scaled_mm"), r"reads nothing on the host"),
    ],
    ids=["cap", "default_cap", "redundant_experts", "eplb_interval", "host_reading_experts"],
)
def test_cuda_graph_option_refuses_what_a_capture_cannot_hold(options, message) -> None:
    """Checked before any layer is built, on the arguments alone (so also without a GPU)."""
    model = build_random_model(random_config("qwen3-moe"), seed=1)
    with pytest.raises(EPInputError, match=rf"^cuda_graph_tokens: expected .*{message}"):
        patch_moe_blocks(model, mode="capacity", device="cuda", **options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
def test_cuda_graph_decode_equals_the_eager_decode_bitwise(arch: str) -> None:
    """The blocks' decode forwards replayed as CUDA graphs give the eager run's logits bit for
    bit (same kernels, same buffers), step after step, and one graph per block is captured."""
    reference = build_random_model(random_config(arch), seed=1, dtype=torch.bfloat16).cuda()
    options = dict(dispatcher="torch_a2a", mode="capacity", max_tokens_per_rank=16)
    eager, graphed = copy.deepcopy(reference), copy.deepcopy(reference)
    eager_report = patch_moe_blocks(eager, **options)
    graph_report = patch_moe_blocks(graphed, cuda_graph_tokens=1, **options)
    prompt = [7, 100, 3, 42, 9]
    expected = greedy_generate(eager, eager_report, prompt, 6, time_moe=False)
    got = greedy_generate(graphed, graph_report, prompt, 6, time_moe=False)
    assert got.tokens == expected.tokens
    assert torch.equal(got.logits, expected.logits)
    for block in graph_report.blocks:  # the prompt ran eager (5 tokens > 1), decode replayed
        assert block.module.graphs.captured_token_counts == [1]
