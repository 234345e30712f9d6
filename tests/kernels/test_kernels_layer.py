"""Whole layers run on the Triton data-path ops against ``reference_moe`` (both layouts and
modes, launches per forward counted), and their capacity forward captured as a CUDA graph.
Devices as in tests/kernels/test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig, reference_moe
from ep_runtime.kernels import route as route_op
from ep_runtime.kernels.ops import KERNELS_ENV
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.support.kernel_checks import (
    BF16,
    CUDA,
    assert_bitwise,
    generator,
)

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

# --------------------------------------------------------------------------- whole layer
LAUNCHES_PER_FORWARD = {"standard": 9, "expanded": 8}  # Triton launches, world size 1


class LaunchCounter:
    """Counts Triton kernel launches (``kernel[grid](...)``, every kernel a ``LaunchedKernel``)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        kernel_class = type(route_op._route_kernel)
        original = kernel_class.launch

        def counting_launch(kernel, *args, **kwargs):
            self.count += 1
            return original(kernel, *args, **kwargs)

        monkeypatch.setattr(kernel_class, "launch", counting_launch)


def layer_case(device: torch.device, activation: str):
    dtype = BF16
    config = MoEConfig(6, 3, 32, 16, activation=activation, dtype=dtype, max_tokens_per_rank=16)
    g = generator(11)
    w13 = (torch.randn(6, config.w13_rows, 32, generator=g) / 32**0.5).to(dtype)
    w2 = (torch.randn(6, 32, 16, generator=g) / 16**0.5).to(dtype)
    x = torch.randn(13, 32, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(13)])
    ids[torch.rand(13, 3, generator=g) < 0.2] = -1
    ids[4] = -1  # a token with no experts
    weights = torch.rand(13, 3, generator=g)
    tensors = [t.to(device) for t in (x, ids, weights)]
    return config, w13, w2, tensors


def run_layer(config, w13, w2, tensors, device, layout, mode, poison):
    layer = EPMoE(
        config,
        dispatcher="torch_a2a",
        experts="grouped_mm",
        layout=layout,
        mode=mode,
        device=device,
        poison=poison,
    )
    try:
        layer.load_weights(w13, w2)
        return layer(*tensors)
    finally:
        layer.close()


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_layer_on_triton_ops(device, monkeypatch, layout, mode, activation) -> None:
    """World size 1, every data-path op from ``triton_ops`` (forced on CPU): matches
    ``reference_moe``; with relu², bitwise equal to the same layer on the torch twins."""
    config, w13, w2, tensors = layer_case(device, activation)
    poison = mode == "capacity"
    monkeypatch.setenv(KERNELS_ENV, "torch")  # resolved when the layer is built
    on_torch = run_layer(config, w13, w2, tensors, device, layout, mode, poison)
    monkeypatch.setenv(KERNELS_ENV, "triton")
    launches = LaunchCounter(monkeypatch)
    on_triton = run_layer(config, w13, w2, tensors, device, layout, mode, poison)
    assert launches.count == LAUNCHES_PER_FORWARD[layout]
    x, ids, weights = (t.cpu() for t in tensors)
    ref = reference_moe(x, ids, weights, w13, w2, activation)
    comparison = compare_per_token(on_triton.float(), ref, tolerance_for(config.dtype, 32))
    assert comparison.passed, comparison.describe()
    if activation == "relu2":
        assert_bitwise(on_triton, on_torch, "layer output, triton vs torch ops")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_capacity_forward_is_graph_capturable(layout) -> None:
    """Capacity mode on CUDA: no host sync (sync debug mode errors on one), and a forward
    captured in a CUDA graph replays to the eager result."""
    device = torch.device("cuda")
    config, w13, w2, (x, ids, weights) = layer_case(device, "silu")
    layer = EPMoE(
        config,
        dispatcher="torch_a2a",
        experts="grouped_mm",
        layout=layout,
        mode="capacity",
        device=device,
    )
    try:
        layer.load_weights(w13, w2)
        eager = layer(x, ids, weights)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x, ids, weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, ids, weights, out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, eager, "graph replay vs eager")
        layer.check()
    finally:
        layer.close()
