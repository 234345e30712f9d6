"""What the Triton data-path op tests (tests/test_kernels*.py, tests/dispatch/test_fp8_dispatch.py)
share: bitwise comparison, seeded inputs and control words. Their ``device`` fixture (CUDA
compiled, else the CPU under Triton's interpreter) is in tests/conftest.py."""

from __future__ import annotations

import torch

from ep_runtime.kernels.wire import CONTROL_INTS

CUDA = torch.cuda.is_available()
BF16, FP32 = torch.bfloat16, torch.float32
# silu vs torch's: bf16 results differ by at most one rounding flip; fp32 results carry the
# different exp() and the products' roundings (several ulp)
SILU_ULPS = {BF16: 2, FP32: 8}
ULP = {BF16: 2.0**-7, FP32: 2.0**-23}  # bound on one ulp relative to |x| (normal numbers)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit; a NaN matches any NaN."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        same = (a.view(bits) == e.view(bits)) | (a.isnan() & e.isnan())
    else:
        same = a == e
    if not bool(same.all()):
        where = (~same).nonzero()[:5].tolist()
        values = [(a[tuple(i)].item(), e[tuple(i)].item()) for i in where]
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {same.numel()} differ; first at {where}: "
            f"(triton, torch) = {values}"
        )


def new_control(device: torch.device, values: list[int]) -> torch.Tensor:
    return torch.tensor(values + [0] * (CONTROL_INTS - len(values)), dtype=torch.int32).to(device)


def routing_ids(
    num_tokens: int, top_k: int, num_experts: int, *, invalid: bool, seed: int
) -> torch.Tensor:
    """``[T, K]`` ids, -1 sprinkled in; ``invalid``: also out-of-range and repeated ids."""
    g = generator(seed)
    if invalid:
        ids = torch.randint(-3, num_experts + 3, (num_tokens, top_k), generator=g)
        if num_tokens and top_k > 1:
            ids[::3, 1] = ids[::3, 0]  # repeats in every third row
    else:
        ids = torch.randint(-1, num_experts, (num_tokens, top_k), generator=g)
    return ids
