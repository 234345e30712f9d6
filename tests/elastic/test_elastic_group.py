"""An elastic layer in a world of one (in this process): it builds, serves, and rebuilds on a
re-formed group (``recover()`` with no rank lost walks the whole rebuild path), against
``reference_moe`` and its own slot weights; and what ``elastic=`` refuses, by name. Losing a rank
is tested with real processes in tests/multigpu/test_elastic.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from ep_runtime import EPMoE, MoEConfig, reference_moe, route
from ep_runtime.dispatch.base import DISPATCHERS
from ep_runtime.dispatch.setup import DispatchSetup
from ep_runtime.elastic import ElasticGroup
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store
from ep_runtime.tolerance import compare_per_token, tolerance_for
from ep_runtime.types import BackendUnavailableError, DispatchMode, EPInputError

# H 256: every dispatcher serves it (DeepEP V2 needs H % 256); bf16 on CUDA, fp32 on CPU
CONFIG = MoEConfig(num_experts=6, top_k=2, hidden_size=256, intermediate_size=64)
# (device, dispatcher): NCCL on a GPU for every dispatcher that rebuilds, gloo on CPU
WHERE = [("cpu", "torch_a2a"), ("cpu", "local")] + (
    [("cuda", "torch_a2a"), ("cuda", "local"), ("cuda", "deepep_v2")]
    if torch.cuda.is_available()
    else []
)


def elastic_group(device: str) -> ElasticGroup:
    server = host_store(LOOPBACK, None, 30)
    elastic = ElasticGroup(join_store(LOOPBACK, server.port, None, 30), 0, 1, device=device)
    elastic.server = server  # the store's server lives as long as the group
    return elastic


@pytest.fixture
def group():
    yield elastic_group("cpu")
    if dist.is_initialized():
        dist.destroy_process_group()


def weights(device, dtype):
    generator = torch.Generator().manual_seed(3)
    w13 = torch.randn(6, 128, 256, generator=generator) / 16
    w2 = torch.randn(6, 256, 64, generator=generator) / 8
    return w13.to(device, dtype), w2.to(device, dtype)


def matches(layer, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 256, generator=generator).to(layer.device, layer.dtype)
    ids, gate = route(torch.randn(20, 6, generator=generator), top_k=2)
    ids, gate = ids.to(layer.device), gate.to(layer.device)
    w13, w2 = weights(layer.device, layer.dtype)
    out = layer(x, ids, gate)
    layer.check()
    expected = reference_moe(x, ids, gate, w13, w2)
    return compare_per_token(out, expected, tolerance_for(layer.dtype, 256)).passed


@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize(("device", "dispatcher"), WHERE)
def test_a_layer_rebuilds_on_a_reformed_group_and_still_serves(device, dispatcher, mode):
    if device == "cuda":
        torch.cuda.set_device(0)
    group = elastic_group(device)
    try:
        serve_rebuild_serve(group, dispatcher, mode)
    finally:
        dist.destroy_process_group()


def serve_rebuild_serve(group: ElasticGroup, dispatcher: str, mode: str) -> None:
    try:
        layer = EPMoE(
            CONFIG,
            dispatcher=dispatcher,
            mode=mode,
            max_tokens_per_rank=32,
            num_redundant_experts=2,
            elastic=group,
            weight_source=lambda ids: tuple(w[list(ids)] for w in weights("cpu", torch.float32)),
        )
    except BackendUnavailableError as error:
        pytest.skip(f"expected refusal: {error}")
    w13, w2 = weights(layer.device, layer.dtype)
    layer.load_weights(w13, w2)
    assert matches(layer, 1)
    dispatcher = layer.dispatcher
    recovery = group.recover()
    assert (recovery.generation, recovery.lost, recovery.members) == (1, (), (0,))
    assert group.generation == 1 and group.world_size == 1
    assert layer.dispatcher is not dispatcher and dispatcher._closed
    assert matches(layer, 2)
    slot13, slot2 = layer.eplb.slot_weights
    for slot, expert in enumerate(layer.placement.experts_on_rank(0)):
        assert torch.equal(slot13[slot], w13[expert]) and torch.equal(slot2[slot], w2[expert])
    assert recovery.origins()["source"] == 0  # nothing was lost: every slot came from itself
    layer.close()


def test_elastic_refuses_a_group_argument_and_quantized_weights(group):
    with pytest.raises(EPInputError, match="group"):
        EPMoE(CONFIG, group=dist.group.WORLD, elastic=group)
    fp8 = dataclasses.replace(CONFIG, intermediate_size=128, quantization="fp8_block")
    with pytest.raises(EPInputError, match="elastic"):
        EPMoE(fp8, elastic=group)


def test_a_second_group_in_an_initialised_process_is_refused(group):
    with pytest.raises(EPInputError, match=r"torch\.distributed"):
        ElasticGroup(group.store, 0, 1, device="cpu")


def test_every_dispatcher_says_whether_it_rebuilds_and_elastic_refuses_those_that_cannot(group):
    declared = {cls.name: cls.capabilities.rebuilds_on_new_group for cls in DISPATCHERS}
    assert declared["torch_a2a"] and declared["local"] and declared["deepep_v2"]
    assert not declared["torch_symm_mem"]
    cls = DISPATCHERS["torch_symm_mem"]
    runnable_here = dataclasses.replace(
        cls.capabilities,
        device_types=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        min_world_size=1,
    )
    layer = EPMoE(CONFIG, dispatcher="torch_a2a", elastic=group)
    setup = dataclasses.replace(layer.dispatcher.setup, mode=DispatchMode.EXACT)
    assert isinstance(setup, DispatchSetup) and setup.elastic
    assert "re-formed group" in runnable_here.refusal(setup, None)
    assert runnable_here.refusal(dataclasses.replace(setup, elastic=False), None) is None
    layer.close()
