"""Experts for a virtual rank r ≠ 0 of W on one process, fed hand-made ``Dispatched`` inputs with
local, non-local and -1 ids and NaN padding: reaches expert offset > 0 without a second rank."""

from __future__ import annotations

import pytest
import torch

from ep_runtime import MoEConfig, reference_moe
from ep_runtime.experts import EXPERTS
from ep_runtime.experts.base import ExpertsSetup
from ep_runtime.experts.triton import interpreting
from ep_runtime.placement import ExpertPlacement
from ep_runtime.tolerance import compare_per_token, tolerance_for
from ep_runtime.types import Dispatched, TopkLayout

NUM_EXPERTS, WORLD, RANK = 8, 4, 2  # local experts 4 and 5
# triton runs on CPU tensors only under Triton's interpreter (set by conftest without a GPU)
CPU_BACKENDS = ["reference", "grouped_mm", *(["triton"] if interpreting() else [])]


def setup_for(activation: str, dtype: torch.dtype) -> ExpertsSetup:
    cfg = MoEConfig(NUM_EXPERTS, 3, 32, 16, activation=activation, dtype=dtype)
    return ExpertsSetup(
        cfg, ExpertPlacement(NUM_EXPERTS, RANK, WORLD), torch.device("cpu"), dtype, token_cap=64
    )


def global_weights(setup: ExpertsSetup):
    g = torch.Generator().manual_seed(3)
    cfg = setup.config
    w13 = torch.randn(NUM_EXPERTS, cfg.w13_rows, 32, generator=g) / 32**0.5
    w2 = torch.randn(NUM_EXPERTS, 32, 16, generator=g) / 16**0.5
    return w13.to(setup.dtype), w2.to(setup.dtype)


def make_backend(name: str, setup: ExpertsSetup):
    backend = EXPERTS[name](setup)
    w13, w2 = global_weights(setup)
    placement = setup.placement
    local = slice(placement.local_expert_offset, placement.local_expert_offset + 2)
    backend.load_weights(w13[local].contiguous(), w2[local].contiguous())
    return backend, w13, w2


def oracle_local_only(x, ids, weights, w13, w2, activation):
    """reference_moe over the slots this rank serves (ids 4, 5); the rest count as -1."""
    local = (ids >= 4) & (ids < 6)
    return reference_moe(x, torch.where(local, ids, -1), weights, w13, w2, activation)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_standard_rows_virtual_rank(name, activation, dtype) -> None:
    setup = setup_for(activation, dtype)
    backend, w13, w2 = make_backend(name, setup)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g).to(dtype)
    ids = torch.tensor(
        [[4, 0, -1], [5, 4, 7], [1, 2, 3], [-1, -1, -1], [5, -1, 6], [4, 5, -1]], dtype=torch.int64
    )  # int64 on purpose: the backend casts at its boundary
    weights = 0.25 + torch.rand(6, 3, generator=g)
    weights[ids == -1] = float("nan")
    x[3] = float("nan")  # padding row: nothing reads it, and it must not leak into others
    dispatched = Dispatched(x, ids, weights, TopkLayout.STANDARD, None)
    out = backend.forward(dispatched)
    assert out.shape == (6, 32) and out.dtype == dtype
    served = torch.tensor([True, True, False, False, True, True])  # rows 2, 3: nothing local
    clean_x = torch.where(torch.isnan(x), 0.0, x.float()).to(dtype)
    ref = oracle_local_only(clean_x, ids, weights, w13, w2, activation)
    result = compare_per_token(out[served], ref[served], tolerance_for(dtype, 32))
    assert result.passed, result.describe()


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_expanded_aligned_groups_with_padding(name, activation) -> None:
    """Groups padded to an alignment of 4 (as DeepEP lays them out): 3 rows for expert 4,
    1 for expert 5, NaN padding inside the groups and after the last one."""
    dtype = torch.bfloat16
    setup = setup_for(activation, dtype)
    backend, w13, w2 = make_backend(name, setup)
    g = torch.Generator().manual_seed(9)
    rows = torch.randn(10, 32, generator=g).to(dtype)
    ids = torch.tensor([4, 4, 4, -1, 5, -1, -1, -1, -1, -1], dtype=torch.int32).unsqueeze(1)
    weights = 0.25 + torch.rand(10, 1, generator=g)
    padding = ids[:, 0] < 0
    rows[padding] = float("nan")
    weights[padding] = float("nan")
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32)
    dispatched = Dispatched(rows, ids, weights, TopkLayout.EXPANDED, offsets)
    out = backend.forward(dispatched)
    valid = ~padding  # padding rows' results are never read: only the valid ones must be right
    ref = reference_moe(rows[valid], ids[valid].long(), weights[valid], w13, w2, activation)
    result = compare_per_token(out[valid], ref, tolerance_for(dtype, 32))
    assert result.passed, result.describe()
    assert dispatched.top_k == 1  # the K the kernel is told comes from the tensor
