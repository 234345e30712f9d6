"""transformers models with FP8 experts (FineGrainedFP8, 128×128 blocks) in one process: the
random ``deepseek-v3-fp8`` model is transformers' own ``FP8Experts`` layout quantized from the bf16
model; ``patch_moe_blocks`` hands EPMoE those e4m3 tensors and scales unchanged; each patched
block matches the fp64 oracle of the contract (tests/support/hf_fp8_oracle.py) on the inputs it
saw; the
patched model's greedy tokens equal the unpatched model's (experts by the oracle, and by
transformers' own fp8 forward where it runs); FP8 settings the contract does not cover are named;
the launcher runs it. W = 2, 3: tests/multigpu/test_hf_fp8_generation.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ep_runtime.integrations.transformers import (
    UnsupportedMoEBlockError,
    build_random_model,
    greedy_generate,
    patch_moe_blocks,
    random_config,
)
from ep_runtime.launch.cli import EXIT_OK, EXIT_USAGE, main
from ep_runtime.launch.hf_report import reference_greedy
from ep_runtime.quantization import FP8_DTYPE
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support import fp8_oracle
from tests.support.hf_fp8_oracle import (
    block_oracle,
    fp8_experts_modules,
    transformers_fp8_unavailable,
    use_oracle_experts,
)
from tests.support.hf_oracle import hf_greedy, model_eos, needs_transformers

pytestmark = needs_transformers

NAME = "deepseek-v3-fp8"
SEED = 5
TOLERANCE = tolerance_for(torch.bfloat16, 128)  # fp8 is judged at the bf16 tolerance (issue 21)


def fp8_model(dtype: torch.dtype = torch.float32):
    return build_random_model(random_config(NAME), seed=SEED, dtype=dtype)


def prompt(length: int = 7, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_random_fp8_model_is_transformers_fp8_experts_quantized_from_bf16():
    from transformers.integrations.finegrained_fp8 import FP8Experts

    model = fp8_model()
    config = random_config(NAME)
    assert config.quantization_config.weight_block_size == [128, 128]
    assert config.hidden_size == config.moe_intermediate_size == 128
    experts = fp8_experts_modules(model)
    assert list(experts) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    for name, module in experts.items():
        assert isinstance(module, FP8Experts) and list(module.block_size) == [128, 128]
        assert module.gate_up_proj.shape == (12, 256, 128) and module.down_proj.shape == (
            12,
            128,
            128,
        )
        assert module.gate_up_proj_scale_inv.shape == (12, 2, 1)
        assert module.down_proj_scale_inv.shape == (12, 1, 1)
        assert module.down_proj_scale_inv.dtype == torch.float32
        # the quantized weights are the tests' own formula applied to the unquantized model's
        # weights (same seed, hidden and I grown to one block)
        source = build_random_model(
            random_config("deepseek-v3", hidden_size=128, moe_intermediate_size=128), seed=SEED
        ).get_submodule(name)
        q, s = fp8_oracle.quantize_blocks(source.gate_up_proj.detach())
        assert torch.equal(module.gate_up_proj.double(), q)
        assert torch.equal(module.gate_up_proj_scale_inv.double(), s)
    # everything else keeps its dtype (no FP8Linear: it would need CUDA kernels)
    others = {p.dtype for n, p in model.named_parameters() if ".experts." not in n}
    assert others == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patch_hands_epmoe_the_e4m3_tensors_and_scales(dtype):
    model = fp8_model(dtype)
    before = {
        name: (m.gate_up_proj.detach().clone(), m.down_proj_scale_inv.detach().clone())
        for name, m in fp8_experts_modules(model).items()
    }
    routed_bytes = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    report = patch_moe_blocks(model)
    try:
        assert [b.name for b in report.blocks] == [n.removesuffix(".experts") for n in before]
        for block, (w13, s2) in zip(report.blocks, before.values(), strict=True):
            ep = block.module.ep
            assert ep.config.quantization.value == "fp8_block" and ep.dtype == dtype
            held = ep.experts.fp8
            assert held.w13.dtype == FP8_DTYPE  # never dequantized
            assert torch.equal(held.w13.view(torch.uint8), w13.view(torch.uint8))
            assert torch.equal(held.w2_scale_inv, s2)
        assert report.held_expert_bytes() == routed_bytes  # W = 1: all of it, in e4m3 + scales
        assert not fp8_experts_modules(model)  # the HF expert tensors were released
    finally:
        for block in report.blocks:
            block.module.ep.close()


def record_blocks(report) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], list]:
    """Forward hooks on every EP block: each call's ``(x [T, H], out [T, H])``."""
    calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in report.blocks]
    handles = []
    for index, block in enumerate(report.blocks):

        def hook(module, args, output, index=index):
            hidden = args[0].reshape(-1, args[0].size(-1))
            if hidden.size(0):
                calls[index].append((hidden.detach().clone(), output.reshape(hidden.shape)))

        handles.append(block.module.register_forward_hook(hook))
    return calls, handles


def test_each_patched_block_matches_the_oracle_and_tokens_match_the_unpatched_model():
    model, reference = fp8_model(), fp8_model()
    assert use_oracle_experts(reference) == 2
    report = patch_moe_blocks(model)
    calls, handles = record_blocks(report)
    ids = prompt()
    result = greedy_generate(model, report, ids, 8, eos_token_id=model_eos(reference))
    for handle in handles:
        handle.remove()
    for block in report.blocks:
        block.module.ep.close()
    # per layer: every call of every block against the oracle on the same inputs
    for block, block_calls in zip(report.blocks, calls, strict=True):
        assert len(block_calls) == len(result.tokens)  # prefill + one per decode step
        unpatched = reference.get_submodule(block.name)
        for x, out in block_calls:
            expected, scale = block_oracle(unpatched, x)
            comparison = compare_per_token(out, expected, TOLERANCE, scale)
            assert comparison.passed, f"{block.name}: {comparison.describe()}"
    # whole model: the unpatched model (experts by the oracle) generates the same tokens
    tokens, logits = hf_greedy(reference, ids, 8, model_eos(reference))
    assert result.tokens == tokens
    comparison = compare_per_token(result.logits, logits, TOLERANCE)
    assert comparison.passed, comparison.describe()


def test_oracle_check_fails_scales_of_the_wrong_experts():
    """Negative control: the patched blocks with each expert given its neighbour's scales."""
    model, reference = fp8_model(), fp8_model()
    for experts in fp8_experts_modules(model).values():
        experts.gate_up_proj_scale_inv.data = experts.gate_up_proj_scale_inv.data.roll(1, 0)
    report = patch_moe_blocks(model)
    calls, handles = record_blocks(report)
    greedy_generate(model, report, prompt(), 1)
    for handle in handles:
        handle.remove()
    block = report.blocks[0]
    block.module.ep.close()
    report.blocks[1].module.ep.close()
    x, out = calls[0][0]
    expected, scale = block_oracle(reference.get_submodule(block.name), x)
    assert not compare_per_token(out, expected, TOLERANCE, scale).passed


def test_tokens_match_transformers_own_fp8_forward_where_it_runs():
    """On a GPU with transformers' FP8 kernels (DeepGEMM or the finegrained-fp8 hub kernel)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = build_random_model(
        random_config(NAME), seed=SEED, dtype=torch.bfloat16, device=device
    )
    unavailable = transformers_fp8_unavailable(reference)
    if unavailable:
        pytest.skip(unavailable)
    model = build_random_model(random_config(NAME), seed=SEED, dtype=torch.bfloat16, device=device)
    report = patch_moe_blocks(model)
    ids, eos = prompt(), model_eos(reference)
    result = greedy_generate(model, report, ids, 8, eos_token_id=eos)
    for block in report.blocks:
        block.module.ep.close()
    assert result.tokens == reference_greedy(reference, ids, 8, eos)[0]


def _set(attribute: str, value):
    def change(experts):
        setattr(experts, attribute, value)

    return change


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        (_set("block_size", (64, 64)), "model.layers.1.mlp.experts.block_size"),
        (_set("activation_scheme", "static"), "model.layers.1.mlp.experts.activation_scheme"),
        (_set("limit", 7.0), "model.layers.1.mlp.experts.limit"),
        (
            lambda e: setattr(e, "gate_up_proj_scale_inv", torch.nn.Parameter(
                e.gate_up_proj_scale_inv.detach().bfloat16(), requires_grad=False)),
            "model.layers.1.mlp.experts.gate_up_proj_scale_inv",
        ),
        (
            lambda e: setattr(e, "down_proj_scale_inv", torch.nn.Parameter(
                e.down_proj_scale_inv.detach()[:, :, :0], requires_grad=False)),
            "model.layers.1.mlp.experts.down_proj_scale_inv",
        ),
    ],
    ids=["block_size", "static_activations", "clamped_swiglu", "bf16_scales", "scale_shape"],
)  # fmt: skip
def test_fp8_settings_outside_the_contract_are_named(change, argument):
    model = fp8_model()
    change(model.get_submodule("model.layers.1.mlp.experts"))
    with pytest.raises(UnsupportedMoEBlockError) as raised:
        patch_moe_blocks(model)
    assert raised.value.argument == argument, str(raised.value)


def test_launcher_runs_the_fp8_model_expert_parallel(tmp_path: Path, capsys):
    path = tmp_path / "report.json"
    argv = ["--launcher", "spawn", "--dp", "2", "--device", "cpu", "--hf-model", NAME]
    code = main([*argv, "--hf-new-tokens", "4", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    report = json.loads(path.read_text())
    assert report["passed"] and report["tolerance"] == TOLERANCE
    reference = build_random_model(random_config(NAME), seed=0)  # the launcher's seed
    unavailable = transformers_fp8_unavailable(reference)
    if unavailable:  # the launcher said so, and used the contract's math
        assert "transformers' fp8 forward does not run here" in report["experts_reference"]
        use_oracle_experts(reference)
    else:
        assert report["experts_reference"] == "FP8 experts: transformers' own fp8 forward"
    routed_bytes = sum(p.nbytes for n, p in reference.named_parameters() if ".experts." in n)
    for rank in report["per_rank"]:
        tokens, _ = hf_greedy(
            reference, rank["prompt"], rank["max_new_tokens"], model_eos(reference)
        )
        assert rank["tokens"] == tokens
        assert rank["held_expert_bytes"] * 2 == routed_bytes


def test_launcher_refuses_quantization_with_an_hf_model(capsys):
    argv = ["--launcher", "spawn", "--hf-model", NAME, "--quantization", "fp8_block"]
    assert main(argv) == EXIT_USAGE
    assert "--quantization: expected none with --hf-model" in capsys.readouterr().out
