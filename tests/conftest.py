"""Session-wide test settings, inherited by the spawned rank processes."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.support.processes import Run

# Never start FlashInfer's CUTLASS JIT build (over 18 minutes) from a test: an unbuilt module
# is a refusal (skipped with its reason), even where a test names the backend.
os.environ.setdefault("EP_RUNTIME_FLASHINFER_CUTLASS_JIT", "0")

# Without a GPU the Triton kernels are tested under Triton's interpreter
# (tests/kernels/test_kernels.py).
# It must be on before triton is first imported: triton.language builds its own jit functions
# (tl.sum, tl.cumsum, …) at import, as interpreted or compiled functions.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the kernel tests' devices (the ``device`` fixture): no GPU, no cuda
KERNEL_DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


# Skips this machine may show, by reason. Any other skip fails the session: a broken probe that
# refuses a backend which should run here turns CI red instead of quietly skipping.
EXPECTED_SKIPS_WITHOUT_CUDA = [
    r"expected refusal: .*runs on \['cuda'\], not cpu",
    r"no CUDA device",
    r"needs a CUDA device",
    # tests/launch/test_launch_multihost.py off CI (CI runs as root, with iproute2 and util-linux)
    r"cannot simulate two hosts here: network namespaces need (root|Linux|the '\w+' command)",
    r"transformers' FP8 experts forward does not run on cpu",  # it needs CUDA kernels
]
EXPECTED_SKIPS_WITH_CUDA = [
    *EXPECTED_SKIPS_WITHOUT_CUDA,  # world sizes beyond the GPU count fall back to gloo ranks
    r"expected refusal: .*(needs SM \[100, 103\]|flashinfer is not importable)",
    r"expected refusal: .*(module is not built|deep_ep is not installed|NCCL)",
    r"expected refusal: .*(needs a group of >= 2 ranks|NVSHMEM is not available|bf16 only)",
    r"needs SM ?\[?\d+|no CUDA device|not usable here",  # the real-library test files
    r"flashinfer is not installed \(the `gpu` extra\)",  # its CPU-side test files
    r"FlashInfer's fused_moe_\w+ module is not built",  # CUTLASS real-kernel tests, unbuilt JIT
    r"ranks need \d+ GPUs, found \d+",  # a world size above this machine's GPU count
    r"imitation runs on CPU \(gloo\) ranks",  # the DeepEP imitation; real one is separate
    r"ray is not installed|needs ray\[default\]",  # GPU hosts without Ray
    # the gloo ranks of world sizes beyond the GPU count: compiled Triton needs CUDA tensors,
    # and a CUDA host runs the kernels compiled (no interpreter)
    r"expected refusal: .*triton: runs on CPU only under Triton's interpreter",
    # transformers' own fp8 experts need the `kernels` package and the Hub (the fp8 HF tests
    # then check each layer against the oracle instead)
    r"transformers' FP8 experts forward does not run on cuda: finegrained-fp8 kernel unavailable",
    r"checks a machine without CUDA",  # the error a CPU-only machine gives
]

# The transformers-integration tests skip where the 'hf' extra is missing; CI installs it, so
# there (CI set) that skip fails the session instead.
if not os.environ.get("CI"):
    EXPECTED_SKIPS_WITHOUT_CUDA.append(r"transformers is not installed \(the 'hf' extra\)")
    EXPECTED_SKIPS_WITH_CUDA.append(r"transformers is not installed \(the 'hf' extra\)")

_skips: list[tuple[str, str]] = []


@pytest.fixture(params=KERNEL_DEVICES)
def device(request) -> torch.device:
    """The device a kernel test runs on: CUDA (compiled) where there is one, else the CPU
    (Triton's interpreter)."""
    return torch.device(request.param)


@pytest.fixture
def fresh_self_check_results(monkeypatch) -> None:
    """The experts self-check's cache of verdicts starts empty (tests/test_flashinfer_*.py)."""
    from ep_runtime.experts import self_check

    monkeypatch.setattr(self_check, "_results", {})


@pytest.fixture
def skip_self_check(monkeypatch) -> None:
    from ep_runtime.experts import self_check

    monkeypatch.setenv(self_check.SKIP_ENV, "1")


@pytest.fixture
def probes_pass(monkeypatch) -> None:
    """FlashInfer's availability probes that read the disk or a CUDA device answer "present"
    (TRTLLM cubins, CUTLASS module), so ``unavailable_reason`` reaches the self-check on CPU."""
    from ep_runtime.experts import flashinfer_trtllm
    from ep_runtime.experts.flashinfer_cutlass import FlashInferCutlassExperts

    monkeypatch.setattr(flashinfer_trtllm, "trtllm_cubins_missing_reason", lambda: None)
    monkeypatch.setattr(FlashInferCutlassExperts, "_module_missing_reason", lambda setup: None)


@pytest.fixture
def launcher_runs() -> Iterator[Callable[..., Run]]:
    """``launcher_runs(*args)`` starts ``python -m ep_runtime.launch`` as a ``Run``; at teardown
    every process each run was seen to start is killed, even when the test failed half-way."""
    runs: list[Run] = []

    def start(*args: str, **options) -> Run:
        runs.append(Run(*args, **options))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


# The two-host test's module fixture (two network namespaces on one fixed subnet, a Ray cluster
# across them) cannot run twice at once: its tests run first, so that under `-n 2 --dist
# worksteal` (README, CI) the first worker takes them all at once and none is stolen away (a
# steal takes the tail of a worker's queue); it is the longest module too.
RUN_FIRST = ("tests/launch/test_launch_multihost.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RUN_FIRST)  # stable


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


@pytest.fixture
def triton_kernels() -> None:
    """Tests of Triton kernels (``pytestmark = pytest.mark.usefixtures("triton_kernels")``):
    compiled on CUDA, run by Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set above before
    anything imports triton); skipped where triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed")
