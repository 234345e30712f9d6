"""Checks shared by the fp8 experts backends built on a GEMM library (``scaled_mm``,
``deepgemm``): the adapter's forward on ``fp8_inputs`` in either layout (on CPU, with a stand-in
for the library), and the real layer against the twin; both against the fp64 oracle of the
contract (or of the variant a backend declares)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.experts.base import Experts
from ep_runtime.types import Dispatched, TopkLayout
from tests.test_fp8 import E, H, K, fp8_inputs, judge

# (layout, activation) of the adapter checks: both layouts, both activations where they differ
ADAPTER_CASES = [
    pytest.param(TopkLayout.STANDARD, "silu", id="standard-silu"),
    pytest.param(TopkLayout.STANDARD, "relu2", id="standard-relu2"),
    pytest.param(TopkLayout.EXPANDED, "silu", id="expanded-silu"),
]


def check_adapter_forward(
    backend_for: Callable[[str, tuple[torch.Tensor, ...]], Experts],
    layout: TopkLayout,
    activation: str,
    experts_with_rows: int = E,
    **oracle_options,
) -> None:
    """``backend_for(activation, weights)``'s forward: STANDARD on 40 tokens (one served by
    nobody: an exact zero row); EXPANDED with each served (token, slot) pair as one grouped row
    with its own weight, two padding rows of NaN after them (zero results). ``experts_with_rows``:
    as ``fp8_inputs``'."""
    if layout is TopkLayout.STANDARD:
        x, ids, topk_weights, weights = fp8_inputs(
            activation, torch.bfloat16, tokens=40, experts_with_rows=experts_with_rows
        )
        backend = backend_for(activation, weights)
        device = backend.setup.device
        inputs = (t.to(device) for t in (x, ids.int(), topk_weights.float()))
        out = backend.forward(Dispatched(*inputs, TopkLayout.STANDARD, None)).cpu()
        comparison = judge(out, x, ids, topk_weights, weights, activation, **oracle_options)
        assert comparison.passed, comparison.describe()
        assert not out[ids.size(0) // 2].any()
        return
    x, ids, topk_weights, weights = fp8_inputs(
        activation, torch.bfloat16, tokens=24, seed=4, experts_with_rows=experts_with_rows
    )
    backend = backend_for(activation, weights)
    device = backend.setup.device
    tokens, slots = (ids >= 0).nonzero(as_tuple=True)
    order = torch.sort(ids[tokens, slots], stable=True).indices
    tokens, slots = tokens[order], slots[order]
    expert_of = ids[tokens, slots].long()
    counts = torch.bincount(expert_of, minlength=E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    rows = torch.cat([x[tokens], torch.full((2, H), float("nan"), dtype=x.dtype)])
    row_weights = torch.cat([topk_weights[tokens, slots], torch.ones(2)]).float()[:, None]
    row_ids = torch.cat([expert_of, torch.full((2,), -1)])[:, None]
    inputs = (t.to(device) for t in (rows, row_ids.int(), row_weights))
    out = backend.forward(Dispatched(*inputs, TopkLayout.EXPANDED, offsets.to(device))).cpu()
    comparison = judge(
        out[:-2], rows[:-2], row_ids[:-2], row_weights[:-2], weights, activation,
        **oracle_options,
    )  # fmt: skip
    assert comparison.passed, comparison.describe()
    assert not out[-2:].any()


def check_layer_against_twin(
    experts: str,
    inputs: tuple,  # fp8_inputs(...)
    layout: str,
    mode: str,
    activation: str,
    twin_distance: float,
    **oracle_options,
) -> None:
    """The layer on ``experts`` and on the twin (``experts="reference"``) with the same weights:
    the first against the fp64 oracle (at the bf16 tolerance), a token served by nobody an exact
    zero row, and each served token's distance to the twin under ``twin_distance``."""
    x, ids, topk_weights, weights = inputs
    q13, s13, q2, s2 = weights
    hidden, width = q2.size(1), q2.size(2)
    outputs = {}
    for name in (experts, "reference"):
        config = MoEConfig(E, K, hidden, width, activation=activation, quantization="fp8_block")
        layer = EPMoE(
            config, max_tokens_per_rank=x.size(0), experts=name, device="cuda", layout=layout,
            mode=mode,
        )  # fmt: skip
        try:
            assert layer.choice.experts == name
            layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
            outputs[name] = layer(x.cuda(), ids.cuda(), topk_weights.cuda()).cpu()
        finally:
            layer.close()
    out, twin = outputs[experts], outputs["reference"]
    comparison = judge(out, x, ids, topk_weights, weights, activation, **oracle_options)
    assert comparison.passed, comparison.describe()
    assert not out[ids.size(0) // 2].any()
    served = (ids >= 0).any(dim=1)
    distance = (out.float() - twin.float()).norm(dim=1)[served] / twin.float().norm(dim=1)[served]
    assert distance.max() < twin_distance, distance.max()
