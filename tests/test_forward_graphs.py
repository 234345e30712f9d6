"""The layer's CUDA graphs of its own eager forwards (ep_runtime/forward_graphs.py).

The oracle for a replay is the same layer's eager forward: a twin layer built with
``forward_graphs=None`` on the same weights, compared bitwise, and ``reference_moe`` within the
bf16 tolerance. CUDA cases are skipped with the reason on a machine without a CUDA device; the
option's checks and where graphs are (not) used run everywhere."""

from __future__ import annotations

import pytest
import torch

from ep_runtime import EPInputError, EPMoE, GraphPolicy, MoEConfig, reference_moe, route
from ep_runtime.forward_graphs import DEFAULT_GRAPH_POLICY
from ep_runtime.tolerance import compare_per_token, tolerance_for

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

E, K, H, I = 16, 4, 256, 128  # noqa: E741


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=generator) / H**0.5
    w2 = torch.randn(E, H, I, generator=generator) / I**0.5
    return w13, w2


def _inputs(tokens: int, seed: int, device: torch.device, ids_dtype: torch.dtype = torch.int64):
    generator = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(tokens, H, generator=generator).to(torch.bfloat16)
    ids, weights = route(torch.randn(tokens, E, generator=generator), top_k=K)
    if tokens:
        ids[0, -1] = -1  # an unused slot
    return x.to(device), ids.to(ids_dtype).to(device), weights.to(device)


def _pair(experts: str, layout: str, mode: str, policy: GraphPolicy | None = None, seed=0):
    """(layer with graphs, twin without) on the same weights."""
    options = dict(
        dispatcher="torch_a2a",
        experts=experts,
        layout=layout,
        mode=mode,
        device="cuda",
        device_checks=mode == "exact",
        max_tokens_per_rank=64 if mode == "capacity" else None,
    )
    config = MoEConfig(E, K, H, I, dtype=torch.bfloat16)
    graphed = EPMoE(config, forward_graphs=policy or DEFAULT_GRAPH_POLICY, **options)
    eager = EPMoE(config, forward_graphs=None, **options)
    for layer in (graphed, eager):
        layer.load_weights(*_weights(seed))
    return graphed, eager


def _captured(experts: str, layout: str, mode: str, tokens: int, policy=None):
    """``_pair`` after three forwards of ``tokens`` tokens: eager, captured, replayed."""
    graphed, eager = _pair(experts, layout, mode, policy)
    for step in range(3):
        graphed(*_inputs(tokens, step, torch.device("cuda")))
    assert graphed.graphs.captured_token_counts == [tokens]
    return graphed, eager


def _check_against_reference(out: torch.Tensor, x, ids, weights, seed: int) -> None:
    w13, w2 = _weights(seed)
    ref, scale = reference_moe(
        x.cpu(), ids.cpu(), weights.cpu(), w13, w2, "silu", return_scale=True
    )
    comparison = compare_per_token(out.cpu(), ref, tolerance_for(torch.bfloat16, H), scale)
    assert comparison.passed, comparison.describe()


def test_forward_graphs_option_is_checked() -> None:
    config = MoEConfig(E, K, H, I)
    with pytest.raises(EPInputError, match="forward_graphs"):
        EPMoE(config, forward_graphs=True)  # type: ignore[arg-type]
    with pytest.raises(EPInputError, match=r"forward_graphs\.max_tokens"):
        GraphPolicy(max_tokens=0)
    with pytest.raises(EPInputError, match=r"forward_graphs\.max_graphs"):
        GraphPolicy(max_graphs=True)  # type: ignore[arg-type]


def test_no_graphs_off_cuda() -> None:
    layer = EPMoE(MoEConfig(E, K, H, I), device="cpu", mode="capacity")
    assert layer.graphs is None  # CPU: every forward eager


@needs_cuda
def test_no_graphs_where_the_host_reads_the_forward() -> None:
    layer = EPMoE(MoEConfig(E, K, H, I), device="cuda", experts="grouped_mm")
    assert layer.graphs is None  # exact mode without device_checks reads ids on the host


@needs_cuda
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("experts", ["triton", "grouped_mm"])
def test_replays_equal_eager_forwards(experts: str, layout: str, mode: str) -> None:
    graphed, eager = _pair(experts, layout, mode)
    assert graphed.graphs is not None
    counts = [5, 5, 5, 17, 5, 17, 17, 1, 1, 1, 64, 64, 64, 0]
    for step, tokens in enumerate(counts):
        x, ids, weights = _inputs(tokens, step, torch.device("cuda"))
        out = graphed(x, ids, weights)
        expected = eager(x, ids, weights)
        assert torch.equal(out, expected), (step, tokens)
        if tokens:
            _check_against_reference(out, x, ids, weights, 0)
    assert graphed.graphs.captured_token_counts == [1, 5, 17, 64]
    graphed.check()


@needs_cuda
def test_layers_sharing_the_graph_inputs_keep_their_own_results() -> None:
    first, first_eager = _pair("triton", "standard", "exact", seed=1)
    second, second_eager = _pair("triton", "standard", "exact", seed=2)
    results = []
    for step in range(4):  # interleaved as a model's layers, same token count
        x, ids, weights = _inputs(9, step, torch.device("cuda"))
        a, b = first(x, ids, weights), second(x, ids, weights)
        results.append((a, b, first_eager(x, ids, weights), second_eager(x, ids, weights)))
    for a, b, a_eager, b_eager in results:  # compared after all ran: outputs are not aliased
        assert torch.equal(a, a_eager) and torch.equal(b, b_eager)
        assert not torch.equal(a, b)
    assert first.graphs.captured_token_counts == second.graphs.captured_token_counts == [9]


@needs_cuda
def test_a_larger_eager_forward_does_not_break_a_captured_graph() -> None:
    graphed, eager = _captured("triton", "standard", "exact", 6, GraphPolicy(max_tokens=32))
    device = torch.device("cuda")
    big = _inputs(3000, 10, device)  # above max_tokens: eager, grows the work buffers
    assert torch.equal(graphed(*big), eager(*big))
    torch.cuda.empty_cache()  # memory freed by the growth goes back to the driver
    junk = torch.full((3000 * K, H), float("nan"), dtype=torch.bfloat16, device=device)
    for step in range(3, 6):
        inputs = _inputs(6, step, device)
        assert torch.equal(graphed(*inputs), eager(*inputs)), step
    del junk
    assert graphed.graphs.captured_token_counts == [6]


@needs_cuda
def test_new_weights_drop_the_graphs() -> None:
    graphed, eager = _captured("triton", "expanded", "capacity", 7)
    device = torch.device("cuda")
    for layer in (graphed, eager):
        layer.load_weights(*_weights(5))
    assert graphed.graphs.captured_token_counts == []
    for step in range(4):  # captured again (the device's pool outlives the dropped graphs)
        inputs = _inputs(7, step, device)
        assert torch.equal(graphed(*inputs), eager(*inputs))
        _check_against_reference(graphed(*inputs), *inputs, 5)
    assert graphed.graphs.captured_token_counts == [7]
    assert graphed.graphs.disabled_because is None


@needs_cuda
def test_policy_bounds_and_the_callers_own_capture() -> None:
    graphed, eager = _pair("grouped_mm", "standard", "exact", GraphPolicy(16, max_graphs=2))
    device = torch.device("cuda")
    for tokens in (3, 3, 4, 4, 5, 5, 5, 40, 40, 40):
        inputs = _inputs(tokens, tokens, device, ids_dtype=torch.int32)
        assert torch.equal(graphed(*inputs), eager(*inputs)), tokens
    assert graphed.graphs.captured_token_counts == [3, 4]  # 5: beyond max_graphs; 40: too big


@needs_cuda
def test_the_callers_own_capture_keeps_the_layers_buffers() -> None:
    graphed, eager = _pair("triton", "standard", "capacity")
    device = torch.device("cuda")
    graphed(*_inputs(32, 0, device))
    static = _inputs(8, 0, device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the second: the layer captures a graph of its own
            graphed(*static)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):  # the caller's capture: the layer's forward inside it, eager
        static_out = graphed(*static)
    assert "caller captures" in graphed.graphs.disabled_because
    for step in range(3):  # eager from now on: nothing the caller's graph holds is released
        inputs = _inputs(8, 10 + step, device)
        assert torch.equal(graphed(*inputs), eager(*inputs))
    junk = [torch.full((64, H), 7.0, device=device) for _ in range(200)]
    fresh = _inputs(8, 1, device)
    for held, new in zip(static, fresh, strict=True):
        held.copy_(new)
    graph.replay()
    assert torch.equal(static_out, eager(*fresh))
    assert all(bool((tensor == 7.0).all()) for tensor in junk)
    assert graphed.graphs.captured_token_counts == []


@needs_cuda
def test_bad_ids_in_a_replay_are_recorded() -> None:
    graphed, eager = _captured("triton", "standard", "capacity", 6)
    device = torch.device("cuda")
    x, ids, weights = _inputs(6, 9, device)
    ids[2, 0] = E + 3  # out of range: dropped on the device and counted
    graphed(x, ids, weights)
    with pytest.raises(EPInputError, match="1 out-of-range or repeated ids"):
        graphed.check()
    inputs = _inputs(6, 10, device)
    assert torch.equal(graphed(*inputs), eager(*inputs))
