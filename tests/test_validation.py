"""Bad input raises ValueError naming the argument, the expected and the given value, before
any rank communicates (the multi-rank variants are in tests/multigpu/test_suite.py)."""

from __future__ import annotations

import pytest
import torch

from ep_runtime import ClosedError, EPInputError, EPMoE, MoEConfig
from ep_runtime.dispatch.setup import DEVICE_CHECKS_ENV
from ep_runtime.placement import ExpertPlacement

CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4, dtype=torch.float32)


def make_layer(**kwargs) -> EPMoE:
    layer = EPMoE(CFG, experts="reference", device="cpu", **kwargs)
    layer.load_weights(torch.randn(4, 8, 8), torch.randn(4, 8, 4))
    return layer


def good_inputs(tokens: int = 3):
    return (
        torch.randn(tokens, 8),
        torch.tensor([[0, 1], [2, 3], [1, -1]])[:tokens],
        torch.rand(tokens, 2),
    )


BAD = {
    "x_wrong_hidden": ("x", lambda x, i, w: (torch.randn(3, 9), i, w)),
    "x_one_dim": ("x", lambda x, i, w: (x.flatten(), i, w)),
    "x_fp16": ("x", lambda x, i, w: (x.half(), i, w)),
    "x_bf16_for_fp32_layer": ("x", lambda x, i, w: (x.bfloat16(), i, w)),
    "ids_out_of_range": (
        "topk_ids",
        lambda x, i, w: (x, torch.tensor([[0, 4], [1, 2], [3, -1]]), w),
    ),
    "ids_below_minus_one": (
        "topk_ids",
        lambda x, i, w: (x, torch.tensor([[0, -2], [1, 2], [3, -1]]), w),
    ),
    "ids_duplicated": ("topk_ids", lambda x, i, w: (x, torch.tensor([[1, 1], [1, 2], [3, -1]]), w)),
    "ids_float": ("topk_ids", lambda x, i, w: (x, i.float(), w)),
    "ids_rows_mismatch": ("topk_ids", lambda x, i, w: (x, i[:2], w)),
    "k_above_top_k": (
        "topk_ids",
        lambda x, i, w: (x, torch.tensor([[0, 1, 2]] * 3), torch.rand(3, 3)),
    ),
    "weights_shape": ("topk_weights", lambda x, i, w: (x, i, w[:, :1])),
    "weights_int": ("topk_weights", lambda x, i, w: (x, i, torch.ones(3, 2, dtype=torch.int64))),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_forward_input_names_argument(case: str) -> None:
    argument, corrupt = BAD[case]
    layer = make_layer()
    with pytest.raises(ValueError, match=rf"^{argument}: expected .+, given .+") as info:
        layer(*corrupt(*good_inputs()))
    assert isinstance(info.value, EPInputError) and info.value.argument == argument


def test_capacity_mode_rejects_more_tokens_than_cap() -> None:
    layer = make_layer(mode="capacity", max_tokens_per_rank=2)
    with pytest.raises(EPInputError, match=r"^x: expected at most max_tokens_per_rank=2"):
        layer(*good_inputs(3))


@pytest.mark.parametrize(
    ("w13_shape", "w2_shape", "argument"),
    [((4, 7, 8), (4, 8, 4), "w13"), ((4, 8, 8), (4, 8, 5), "w2"), ((3, 8, 8), (3, 8, 4), "w13")],
)
def test_bad_weight_shapes(w13_shape, w2_shape, argument) -> None:
    layer = EPMoE(CFG, experts="reference", device="cpu")
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        layer.load_weights(torch.randn(w13_shape), torch.randn(w2_shape))


def test_experts_not_divisible_by_world() -> None:
    with pytest.raises(ValueError, match=r"^num_experts: expected a multiple of the world size 3"):
        ExpertPlacement(num_experts=4, rank=0, world_size=3)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(num_experts=0), "num_experts"),
        (dict(top_k=5), "top_k"),
        (dict(activation="gelu"), "activation"),
        (dict(dtype=torch.float16), "dtype"),
        (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
    ],
)
def test_bad_config(kwargs, argument) -> None:
    base = dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4)
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        MoEConfig(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "argument"), [(dict(mode="fast"), "mode"), (dict(layout="wide"), "layout")]
)
def test_bad_layer_options(kwargs, argument) -> None:
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        EPMoE(CFG, experts="reference", device="cpu", **kwargs)


def test_unknown_backend_lists_registered_ones() -> None:
    with pytest.raises(RuntimeError, match=r"registered: .*reference"):
        EPMoE(CFG, experts="nonexistent", device="cpu")


def test_use_after_close_is_a_clear_error() -> None:
    layer = make_layer()
    layer.close()
    with pytest.raises(ClosedError, match="after close"):
        layer(*good_inputs())


def test_forward_before_load_weights() -> None:
    layer = EPMoE(CFG, experts="reference", device="cpu")
    with pytest.raises(RuntimeError, match="load_weights"):
        layer(*good_inputs())


def test_capacity_mode_drops_out_of_range_and_repeated_ids_on_device(monkeypatch) -> None:
    """The CUDA capacity path cannot sync to reject ids: it turns bad ones into -1 and counts
    them; ``check()`` then raises with the count (that path forced on here, on CPU)."""
    monkeypatch.setenv(DEVICE_CHECKS_ENV, "1")
    layer = make_layer(mode="capacity", max_tokens_per_rank=4)
    x, _, weights = good_inputs()
    ids = torch.tensor([[1, 1], [0, 9], [3, -1]])
    out = layer(x, ids, weights)
    kept = torch.tensor([[1, -1], [0, -1], [3, -1]])
    expected = layer(x, kept, weights)
    assert torch.equal(out, expected)
    with pytest.raises(EPInputError, match=r"^topk_ids: .* 2 out-of-range or repeated ids"):
        layer.check()
    layer.check()  # the count was reset


@pytest.mark.parametrize("max_tokens_per_rank", [None, 2], ids=["one_round", "two_rounds"])
def test_exact_mode_with_device_checks_alone_defers_the_id_verdict(
    monkeypatch, max_tokens_per_rank
) -> None:
    """``device_checks=True`` at world size 1 (the path forced on here, on CPU): bad ids do not
    raise in the forward (no host read); they are dropped to -1 and ``check()`` names them.
    Every round of a chunked forward runs (its output equals the host-checked layer's)."""
    monkeypatch.setenv(DEVICE_CHECKS_ENV, "1")
    layer = make_layer(device_checks=True, max_tokens_per_rank=max_tokens_per_rank)
    checked = make_layer(max_tokens_per_rank=max_tokens_per_rank)
    try:
        checked.load_weights(layer.experts.w13, layer.experts.w2)
        x, ids, weights = good_inputs()
        assert torch.equal(layer(x, ids, weights), checked(x, ids, weights))
        layer.check()  # nothing recorded
        bad = torch.tensor([[1, 1], [0, 9], [3, -1]])
        out = layer(x, bad, weights)
        assert torch.equal(out, checked(x, torch.tensor([[1, -1], [0, -1], [3, -1]]), weights))
        with pytest.raises(EPInputError, match=r"^topk_ids: .* 2 out-of-range or repeated ids"):
            layer.check()
        with pytest.raises(EPInputError, match=r"^topk_ids:"):  # the default: raised at once
            checked(x, bad, weights)
    finally:
        layer.close()
        checked.close()


def test_device_checks_on_cpu_keep_the_host_check() -> None:
    """Off CUDA reading the verdict costs nothing: the forward still raises at once."""
    layer = make_layer(device_checks=True)
    x, _, weights = good_inputs()
    try:
        with pytest.raises(EPInputError, match=r"^topk_ids:"):
            layer(x, torch.tensor([[0, 4], [1, 2], [3, -1]]), weights)
    finally:
        layer.close()


def test_out_tensor_must_match_x() -> None:
    layer = make_layer()
    x, ids, w = good_inputs()
    with pytest.raises(EPInputError, match=r"^out: expected shape \[3, 8\], dtype torch.float32"):
        layer(x, ids, w, out=torch.empty(3, 8, dtype=torch.bfloat16))
