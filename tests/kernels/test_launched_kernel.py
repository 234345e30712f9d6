"""``LaunchedKernel`` (kernels/triton_common.py): our kernels' launch path around Triton's.

A call must run exactly the variant ``JITFunction.run`` would pick for its arguments (Triton
specializes on integer values of 1 and multiples of 16, pointer alignment and dtypes), so each
case below changes one of those and compares the result with torch. On CUDA the fast path is
also checked to be taken (no ``JITFunction.run`` after a variant's first call) and to share
Triton's cache (no new variant when Triton's own launcher runs the same call). On CPU the
kernels run under the interpreter, which always takes Triton's launcher.
"""

from __future__ import annotations

import pytest
import torch

from ep_runtime.kernels.triton_common import _FAST_LAUNCH, kernel, rounded, tl

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@kernel
def _axpy_kernel(x, y, out, n, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x_values = tl.load(x + offsets, mask=mask).to(tl.float32)
    y_values = tl.load(y + offsets, mask=mask).to(tl.float32)
    result = rounded(alpha * x_values + y_values, out.dtype.element_ty)  # the interpreter truncates
    tl.store(out + offsets, result, mask=mask)


def axpy(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(y)
    n = y.numel()
    _axpy_kernel[(-(-n // 64),)](x, y, out, n, alpha, BLOCK=64)
    return out


# (length, offset into the buffers, dtype): a multiple of 16, not one, exactly 1, unaligned
CASES = [
    (64, 0, torch.float32),
    (37, 0, torch.float32),
    (1, 0, torch.float32),
    (48, 1, torch.float32),
    (48, 0, torch.bfloat16),
    (33, 3, torch.bfloat16),
]


def run_cases() -> None:
    g = torch.Generator().manual_seed(0)
    for n, offset, dtype in CASES:
        x_buffer = torch.randn(n + offset, generator=g).to(dtype).to(DEVICE)
        y_buffer = torch.randn(n + offset, generator=g).to(dtype).to(DEVICE)
        x, y = x_buffer[offset:], y_buffer[offset:]
        want = (0.5 * x.float() + y.float()).to(dtype)
        got = axpy(x, y, 0.5)
        assert torch.equal(got.cpu(), want.cpu()), (n, offset, dtype)


def test_each_specialization_gets_its_own_variant():
    run_cases()
    run_cases()  # now from the compiled variants


@pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (the interpreter always takes Triton's own launcher)"
)
def test_fast_path_is_taken_and_shares_tritons_cache(monkeypatch):
    assert _FAST_LAUNCH, "the fast path is off for this Triton version"
    run_cases()  # every variant compiled
    fn = _axpy_kernel.fn
    variants = len(fn.device_caches[torch.cuda.current_device()][0])
    assert variants >= len({(n == 1, n % 16 == 0, o == 0, d) for n, o, d in CASES})
    slow_calls = []
    original = type(fn).run

    def counting_run(self, *args, **kwargs):
        slow_calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(fn), "run", counting_run)
    run_cases()
    assert slow_calls == []
    monkeypatch.undo()
    x = torch.randn(37, device=DEVICE)
    out = torch.empty_like(x)
    fn[(1,)](x, x, out, 37, 2.0, BLOCK=64)  # Triton's own launcher: the same cache key
    assert len(fn.device_caches[torch.cuda.current_device()][0]) == variants
    assert torch.equal(out, 3.0 * x)
