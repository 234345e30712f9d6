"""Session-wide test settings, inherited by the spawned rank processes."""

from __future__ import annotations

import os
import re

import pytest
import torch

# Never start FlashInfer's CUTLASS JIT build (over 18 minutes) from a test: an unbuilt module
# is a refusal (skipped with its reason), even where a test names the backend.
os.environ.setdefault("EP_RUNTIME_FLASHINFER_CUTLASS_JIT", "0")


# Skips this machine may show, by reason. Any other skip fails the session: a broken probe that
# refuses a backend which should run here turns CI red instead of quietly skipping.
EXPECTED_SKIPS_WITHOUT_CUDA = [
    r"expected refusal: .*runs on \['cuda'\], not cpu",
    r"no CUDA device",
    r"needs a CUDA device",
]
EXPECTED_SKIPS_WITH_CUDA = [
    *EXPECTED_SKIPS_WITHOUT_CUDA,  # world sizes beyond the GPU count fall back to gloo ranks
    r"expected refusal: .*(needs SM \[100, 103\]|flashinfer is not importable)",
    r"expected refusal: .*(module is not built|deep_ep is not installed|NCCL)",
    r"expected refusal: .*(needs a group of >= 2 ranks|NVSHMEM is not available|bf16 only)",
    r"needs SM ?\[?\d+|no CUDA device|not usable here",  # the real-library test files
    r"FlashInfer's fused_moe_\w+ module is not built",  # CUTLASS real-kernel tests, unbuilt JIT
    r"ranks need \d+ GPUs, found \d+",  # a world size above this machine's GPU count
    r"imitation runs on CPU \(gloo\) ranks",  # the DeepEP imitation; real one is separate
    r"ray is not installed|needs ray\[default\]",  # GPU hosts without Ray
]

_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        _skips.append((report.nodeid, str(report.longrepr[2])))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    allowed = EXPECTED_SKIPS_WITH_CUDA if torch.cuda.is_available() else EXPECTED_SKIPS_WITHOUT_CUDA
    unexpected = [
        (node, why)
        for node, why in _skips
        if not any(re.search(p, why, re.DOTALL) for p in allowed)
    ]
    if unexpected:
        lines = "\n".join(f"  {node}: {why}" for node, why in unexpected)
        print(f"\nUnexpected skips on this machine (see tests/conftest.py):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
