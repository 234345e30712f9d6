"""Selection-time self-check for experts backends that may never have run on the user's hardware.

When: the first time the backend is considered for a layer on a device (per process and
activation), while backends are chosen, so every layer (the first one too) gets the same answer
and "auto" moves on from a backend that fails it.

What: the backend runs a small hand-made problem for a virtual rank (rank 1 of 3, so the expert
offset is > 0) in both layouts, with local, non-local and -1 ids, a padding row of NaN, NaN
weights on -1 slots and an intermediate size that needs padding, and is compared per token to
``reference_moe`` with the derived tolerance (on the rows that hold data). A mismatch (or an
exception) refuses the backend with the numbers. Skip it with ``EP_RUNTIME_SKIP_SELF_CHECK=1``.

``make_check_problem`` is also what the real-kernel tests feed the backends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ep_runtime.config import MoEConfig
from ep_runtime.experts.base import Experts, ExpertsSetup
from ep_runtime.experts.reference import ReferenceExperts
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import BLOCK, Fp8BlockWeights, Quantization, quantize_weight_blocks
from ep_runtime.reference import reference_moe
from ep_runtime.tolerance import compare_per_token, tolerance_for
from ep_runtime.types import Activation, Dispatched, TopkLayout

SKIP_ENV = "EP_RUNTIME_SKIP_SELF_CHECK"

# The check problem: small, fast, and reaching every branch the contract names.
CHECK_NUM_EXPERTS = 6
CHECK_WORLD_SIZE = 3
CHECK_RANK = 1  # expert offset 2: an adapter that ignores the offset fails
CHECK_TOP_K = 3
CHECK_HIDDEN = 128
CHECK_INTERMEDIATE = 96  # not a multiple of 128: TRTLLM's padding is exercised
CHECK_TOKENS = 12
CHECK_TOKEN_CAP = 256  # what the check's backends size their buffers for (a small capacity cap)
# fp8 block scales: the blocks tile I, and TRTLLM's fp8 routing needs E % 4 == 0 (offset still 2)
FP8_CHECK_SHAPE = dict(num_experts=8, world_size=4, intermediate=BLOCK)

# (backend, device, activation, quantization) -> None = passed, else why not
_results: dict[tuple[str, str, Activation, Quantization | None], str | None] = {}


@dataclass(frozen=True)
class CheckProblem:
    """A hand-made ``Dispatched`` for one virtual rank, with its local weights and oracle."""

    setup: ExpertsSetup
    dispatched: Dispatched
    w13: torch.Tensor  # [L, 2I | I, H] local experts, [gate; up] when gated
    w2: torch.Tensor  # [L, H, I]
    reference: torch.Tensor  # [R, H] float32: reference_moe on the dispatched rows
    fp8: Fp8BlockWeights | None = None  # quantization="fp8_block": w13, w2 quantized per block


def check_setup(
    activation: Activation,
    device: torch.device,
    *,
    num_experts: int = CHECK_NUM_EXPERTS,
    world_size: int = CHECK_WORLD_SIZE,
    rank: int = CHECK_RANK,
    top_k: int = CHECK_TOP_K,
    hidden: int = CHECK_HIDDEN,
    intermediate: int = CHECK_INTERMEDIATE,
    quantization: Quantization | None = None,
) -> ExpertsSetup:
    """A bf16 ``ExpertsSetup`` for virtual rank ``rank`` of ``world_size``."""
    config = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=intermediate,
        activation=activation,
        dtype=torch.bfloat16,
        quantization=quantization,
    )
    placement = ExpertPlacement(num_experts, rank, world_size)
    return ExpertsSetup(config, placement, device, torch.bfloat16, token_cap=CHECK_TOKEN_CAP)


def make_check_problem(
    setup: ExpertsSetup, layout: TopkLayout, num_tokens: int = CHECK_TOKENS, seed: int = 0
) -> CheckProblem:
    """Deterministic rows for ``setup``'s virtual rank (of a world of >= 2), in ``layout``.

    STANDARD: ``[T, K]`` global ids mixing local, non-local and -1 slots; row ``T // 2`` is
    padding (all -1, hidden NaN). EXPANDED: one row per (token, local slot), grouped by local
    expert, each group followed by one padding row (offsets include it). Weights are distinct,
    unnormalised, NaN on -1 slots. With fp8 block quantization the weights are quantized per
    block and the oracle is the fp8 contract's plain-torch twin (the ``reference`` experts).
    """
    config, placement = setup.config, setup.placement
    dtype, device = setup.dtype, setup.device
    num_local, offset = placement.num_local_experts, placement.local_expert_offset
    generator = torch.Generator().manual_seed(seed)
    hidden, intermediate = config.hidden_size, config.intermediate_size
    w13 = torch.randn(num_local, config.w13_rows, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(num_local, hidden, intermediate, generator=generator) / intermediate**0.5
    x = torch.randn(num_tokens, hidden, generator=generator)
    scores = torch.rand(num_tokens, config.num_experts, generator=generator)
    ids = scores.topk(config.top_k, dim=1).indices  # [T, K] distinct global ids per row
    ids[0] = -1  # row 0: one local slot and one non-local slot for certain
    ids[0, 0] = offset + num_local - 1
    if config.top_k > 1:
        ids[0, 1] = (offset + num_local) % config.num_experts
    unused = torch.rand(num_tokens, config.top_k, generator=generator) < 0.2
    ids = torch.where(unused, -1, ids)
    ids[num_tokens // 2] = -1
    x[num_tokens // 2] = float("nan")
    weights = 0.25 + 1.5 * torch.rand(num_tokens, config.top_k, generator=generator)
    weights = torch.where(ids >= 0, weights, float("nan"))

    local = ids - offset
    served = (ids >= 0) & (local >= 0) & (local < num_local)
    if layout is TopkLayout.EXPANDED:
        x, weights, local, served, offsets = _expand(x, local, weights, served, num_local)
        ids = torch.where(served, local + offset, -1)
    else:
        offsets = None
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    local_ids = torch.where(served, local, -1)
    dispatched = Dispatched(
        hidden_states=x.to(device),
        topk_ids=ids.to(torch.int32).to(device),
        topk_weights=weights.to(device),
        layout=layout,
        expert_offsets=None if offsets is None else offsets.to(device),
    )
    if config.quantization is None:
        reference = reference_moe(x, local_ids, weights, w13, w2, config.activation)
        return CheckProblem(setup, dispatched, w13.to(device), w2.to(device), reference)
    fp8 = Fp8BlockWeights(*quantize_weight_blocks(w13), *quantize_weight_blocks(w2)).to(device)
    twin = ReferenceExperts(setup)  # the fp8 contract's plain-torch twin
    twin.load_quantized_weights(fp8)
    reference = twin.forward(dispatched).float().cpu()
    return CheckProblem(setup, dispatched, w13.to(device), w2.to(device), reference, fp8)


def _expand(
    x: torch.Tensor,  # [T, H]
    local: torch.Tensor,  # [T, K] local index (meaningful where served)
    weights: torch.Tensor,  # [T, K]
    served: torch.Tensor,  # [T, K] bool
    num_local: int,
) -> tuple[torch.Tensor, ...]:
    """EXPANDED rows grouped by local expert, a NaN padding row closing each group:
    ``(x [N, H], weights [N, 1], local [N, 1], served [N, 1] bool, offsets [L + 1] int32)``."""
    pad_x = torch.full((1, x.size(1)), float("nan"))
    rows, row_weights, row_local, row_served, offsets = [], [], [], [], [0]
    for expert in range(num_local):
        token, slot = (served & (local == expert)).nonzero(as_tuple=True)
        count = token.numel()
        rows += [x[token], pad_x]
        row_weights += [weights[token, slot], torch.tensor([float("nan")])]
        row_local += [torch.full((count + 1,), expert)]
        row_served += [torch.ones(count, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]
        offsets.append(offsets[-1] + count + 1)
    return (
        torch.cat(rows),
        torch.cat(row_weights).unsqueeze(1),
        torch.cat(row_local).unsqueeze(1),
        torch.cat(row_served).unsqueeze(1),
        torch.tensor(offsets, dtype=torch.int32),
    )


def check_backend(cls: type[Experts], setup: ExpertsSetup) -> str | None:
    """Run ``cls`` on the check problem in both layouts; a failure description, or None.
    Rows without a served slot (padding) are not compared: nothing reads them."""
    for layout in TopkLayout:
        problem = make_check_problem(setup, layout)
        backend = cls(setup)
        if problem.fp8 is None:
            backend.load_weights(problem.w13, problem.w2)
        else:
            backend.load_quantized_weights(problem.fp8)
        result = backend.forward(problem.dispatched)
        served = (problem.dispatched.topk_ids >= 0).any(dim=1).cpu()
        hidden = problem.dispatched.hidden_states.size(1)
        tolerance = tolerance_for(setup.dtype, max(hidden, setup.config.intermediate_size))
        comparison = compare_per_token(result.cpu()[served], problem.reference[served], tolerance)
        if not comparison.passed:
            c = setup.config
            oracle = "reference_moe" if problem.fp8 is None else "the fp8 twin"
            return (
                f"self-check against {oracle} failed ({layout.value} layout, virtual rank "
                f"{setup.placement.rank} of {setup.placement.world_size}, E={c.num_experts}, "
                f"H={c.hidden_size}, I={c.intermediate_size}, {c.activation.value}): "
                f"{comparison.describe()}"
            )
    return None


def self_check_refusal(
    cls: type[Experts],
    device: torch.device,
    activation: Activation,
    quantization: Quantization | None = None,
) -> str | None:
    """Why ``cls`` fails its self-check here (run once per backend, device, activation and
    quantization in this process), or None."""
    if os.environ.get(SKIP_ENV) == "1":
        return None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (cls.name, str(device), activation, quantization)
    if key not in _results:
        try:
            shape = (
                {} if quantization is None else {**FP8_CHECK_SHAPE, "quantization": quantization}
            )
            failure = check_backend(cls, check_setup(activation, device, **shape))
        except Exception as error:  # a kernel that raises is refused like a wrong one
            failure = f"self-check raised {type(error).__name__}: {error}"
        _results[key] = None if failure is None else f"{failure} (set {SKIP_ENV}=1 to skip it)"
    return _results[key]
