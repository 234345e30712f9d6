"""CUDA-only properties of capacity mode: no host sync, CUDA-graph capture equal to eager.

Skipped with the reason where there is no CUDA device (CPU CI). On a 1-GPU machine these run at
world size 1 over NCCL; with more GPUs, at 2 as well."""

from __future__ import annotations

import pytest
import torch

from tests.multigpu import cuda_cases
from tests.multigpu.rank_inputs import CaseSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WORLD_SIZES = [w for w in (1, 2) if torch.cuda.is_available() and torch.cuda.device_count() >= w]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("experts", ["grouped_mm", "triton"])
@pytest.mark.parametrize("forward_graphs", [True, False])
def test_capacity_forward_has_no_host_sync(
    pool_factory, world_size, layout, activation, experts, forward_graphs
) -> None:
    spec = CaseSpec(
        forward_graphs=forward_graphs,
        experts=experts,
        layout=layout,
        activation=activation,
        mode="capacity",
        hidden=128,
        intermediate=64,
    )
    for comparison in pool_factory(world_size).run_ok(
        cuda_cases.capacity_forward_without_sync, spec
    ):
        assert comparison.passed, comparison.describe()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("experts", ["grouped_mm", "triton"])
def test_cuda_graph_replay_equals_eager(pool_factory, world_size, layout, experts) -> None:
    spec = CaseSpec(
        experts=experts, layout=layout, mode="capacity", hidden=128, intermediate=64, cap=32
    )
    replays = pool_factory(world_size).run_ok(cuda_cases.cuda_graph_replay_matches_eager, spec)
    assert replays == [2] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_capacity_mode_records_bad_ids_on_the_device(pool_factory, world_size, layout) -> None:
    spec = CaseSpec(experts="grouped_mm", layout=layout, mode="capacity", tokens=(6, 6))
    for kind, message, next_ok in pool_factory(world_size).run_ok(
        cuda_cases.capacity_bad_ids_are_recorded, spec
    ):
        assert kind == "EPInputError", (kind, message)
        assert "2 out-of-range or repeated ids" in message, message
        assert next_ok
