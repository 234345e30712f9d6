"""The oracle itself: a literal hand-computed case, and its independence from the runtime."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig, reference_moe

SILU_1 = 1.0 / (1.0 + math.exp(-1.0))  # silu(1) = 1 · sigmoid(1)


def literal_case(activation: str):
    """H = 2, I = 1, two experts, one token x = [1, 2] routed to both with weights 0.5, 0.25."""
    x = torch.tensor([[1.0, 2.0]])
    ids = torch.tensor([[0, 1]])
    weights = torch.tensor([[0.5, 0.25]])
    if activation == "silu":
        # rows [0, I) are the gate, [I, 2I) the up projection
        w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]])
        w2 = torch.tensor([[[1.0], [3.0]], [[2.0], [-1.0]]])
        # expert 0: gate = x0 = 1, up = x1 = 2 -> silu(1)·2 ; expert 1: gate = 2, up = 1
        h0, h1 = SILU_1 * 2.0, 2.0 / (1.0 + math.exp(-2.0)) * 1.0
    else:
        w13 = torch.tensor([[[1.0, -1.0]], [[2.0, 0.5]]])
        w2 = torch.tensor([[[1.0], [3.0]], [[2.0], [-1.0]]])
        # expert 0: relu(1 - 2)² = 0 ; expert 1: relu(2 + 1)² = 9
        h0, h1 = 0.0, 9.0
    expected = 0.5 * h0 * torch.tensor([1.0, 3.0]) + 0.25 * h1 * torch.tensor([2.0, -1.0])
    return x, ids, weights, w13, w2, expected.unsqueeze(0)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_literal_hand_computed_case(activation: str) -> None:
    x, ids, weights, w13, w2, expected = literal_case(activation)
    out = reference_moe(x, ids, weights, w13, w2, activation)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_layer_reproduces_literal_case(activation: str) -> None:
    x, ids, weights, w13, w2, expected = literal_case(activation)
    cfg = MoEConfig(2, 2, 2, 1, activation=activation, dtype=torch.float32)
    layer = EPMoE(cfg, experts="reference", device="cpu")
    layer.load_weights(w13, w2)
    torch.testing.assert_close(layer(x, ids, weights), expected, rtol=1e-6, atol=1e-6)


def test_gate_up_order_is_pinned() -> None:
    """Swapping the gate and up rows changes the literal result: the order is observable."""
    x, ids, weights, w13, w2, expected = literal_case("silu")
    swapped = torch.cat([w13[:, 1:], w13[:, :1]], dim=1)
    assert not torch.allclose(reference_moe(x, ids, weights, swapped, w2, "silu"), expected)


def test_minus_one_slots_ignored_even_with_nan_weight() -> None:
    x, ids, weights, w13, w2, _ = literal_case("silu")
    ids = torch.tensor([[0, -1], [-1, -1]])
    x = torch.cat([x, x])
    weights = torch.tensor([[0.5, float("nan")], [float("nan"), float("nan")]])
    out = reference_moe(x, ids, weights, w13, w2, "silu")
    torch.testing.assert_close(out[0], 0.5 * SILU_1 * 2.0 * torch.tensor([1.0, 3.0]))
    assert torch.equal(out[1], torch.zeros(2))


def test_reference_imports_nothing_from_the_runtime() -> None:
    source = Path(__file__).parents[1] / "ep_runtime" / "reference.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    forbidden = {m for m in imported if m.startswith("ep_runtime")}
    assert not forbidden, f"reference.py imports {forbidden}"
