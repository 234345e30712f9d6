"""On a CUDA machine: how ``"auto"`` treats DeepEP V2 and the FlashInfer experts there, and that
a backend which cannot run is refused at once (no download, no JIT build, no hang).

- DeepEP: on a one-rank NCCL group, ``dispatcher="auto"`` takes ``local`` (nothing to move in a
  world of one) and matches ``reference_moe``; where DeepEP V2 cannot run (the H200 as it comes:
  no deep_ep, NCCL 2.28.9) ``"deepep_v2"`` by name is refused naming every problem; where it
  can, the name is accepted.
- FlashInfer: ``flashinfer_trtllm`` refused within a second where the device's arch is not
  its own; the TRTLLM cubin probe answers within a second; ``flashinfer_cutlass`` named is
  accepted (its self-check passed) or refused within a second (``EP_RUNTIME_FLASHINFER_
  CUTLASS_JIT=0``, tests/conftest.py: never the JIT build); ``experts="auto"`` picks a
  backend that was not refused and matches ``reference_moe``.

Every test skips without CUDA (CPU CI: tests/dispatch/test_deepep_adapter.py and
tests/experts/test_flashinfer_self_check.py check the same refusals with the probes imitated).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ep_runtime import BackendUnavailableError, EPMoE, MoEConfig, reference_moe
from ep_runtime.tolerance import Comparison, compare_per_token, tolerance_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = MoEConfig(
    num_experts=8, top_k=2, hidden_size=256, intermediate_size=192, max_tokens_per_rank=64
)
REFUSAL_BUDGET_S = 1.0


def forward_against_reference(layer: EPMoE) -> Comparison:
    """The layer on 40 bf16 tokens (on the GPU) vs ``reference_moe`` of the same weights."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(8, CONFIG.w13_rows, 256, generator=g) / 16).bfloat16()
    w2 = (torch.randn(8, 256, 192, generator=g) / 192**0.5).bfloat16()
    layer.load_weights(w13, w2)
    x = torch.randn(40, 256, generator=g).bfloat16()
    ids = torch.rand(40, 8, generator=g).topk(2, dim=1).indices
    weights = 0.25 + torch.rand(40, 2, generator=g)
    out = layer(x.cuda(), ids.cuda(), weights.cuda()).cpu()
    reference = reference_moe(x, ids, weights, w13, w2, "silu")
    return compare_per_token(out, reference, tolerance_for(torch.bfloat16, 256))


def timed_refusal(**backends: str) -> tuple[str | None, float]:
    """Build a layer asking for ``backends``: the refusal (None: accepted) and the seconds."""
    start = time.monotonic()
    try:
        layer = EPMoE(CONFIG, device="cuda", **backends)
    except BackendUnavailableError as error:
        return str(error), time.monotonic() - start
    layer.close()
    return None, time.monotonic() - start


@pytest.fixture
def nccl_world_of_one(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a default process group already exists in this process")
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_auto_takes_local_and_deepep_by_name_is_as_its_probe_says(nccl_world_of_one) -> None:
    from ep_runtime.dispatch.deepep_v2 import deep_ep_problems, first_dispatch_problem

    problems = list(deep_ep_problems())
    if not problems:  # installed: the adapter still tries a first dispatch before trusting it
        probe = first_dispatch_problem(torch.cuda.current_device())
        problems += [probe] if probe else []
    layer = EPMoE(CONFIG, dispatcher="auto", device="cuda")
    try:
        comparison = forward_against_reference(layer)
        chosen, description = layer.choice.dispatcher, layer.choice.describe()
    finally:
        layer.close()
    assert comparison.passed, comparison.describe()
    assert chosen == "local", description  # a world of one: ahead of every transport
    refusal, _ = timed_refusal(dispatcher="deepep_v2")
    if problems:
        assert refusal is not None and "deepep_v2" in refusal
        assert [p for p in problems if p not in refusal] == [], refusal
    else:
        assert refusal is None


def test_flashinfer_trtllm_is_refused_at_once_off_its_arch() -> None:
    from ep_runtime.experts import EXPERTS

    major, minor = torch.cuda.get_device_capability()
    refusal, seconds = timed_refusal(experts="flashinfer_trtllm")
    if 10 * major + minor not in EXPERTS["flashinfer_trtllm"].capabilities.cuda_archs:
        assert refusal is not None, "flashinfer_trtllm accepted off its arch"
    if refusal is not None:
        assert seconds < REFUSAL_BUDGET_S and "flashinfer_trtllm" in refusal, (seconds, refusal)


def test_trtllm_cubin_probe_answers_at_once() -> None:
    """The probe past the arch check, as an SM100 machine without cubins would run it."""
    from ep_runtime.experts.flashinfer_common import flashinfer_missing_reason
    from ep_runtime.experts.flashinfer_trtllm import trtllm_cubins_missing_reason

    start = time.monotonic()
    reason = flashinfer_missing_reason() or trtllm_cubins_missing_reason()
    assert time.monotonic() - start < REFUSAL_BUDGET_S
    assert reason is None or "FLASHINFER_CUBIN_DIR" in reason or "flashinfer" in reason, reason


def test_flashinfer_cutlass_named_is_accepted_or_refused_at_once() -> None:
    refusal, seconds = timed_refusal(experts="flashinfer_cutlass")
    assert refusal is None or seconds < REFUSAL_BUDGET_S, (seconds, refusal)


def test_auto_experts_picks_a_backend_that_was_not_refused() -> None:
    from ep_runtime.experts import EXPERTS

    layer = EPMoE(CONFIG, experts="auto", device="cuda")
    try:
        comparison = forward_against_reference(layer)
        choice = layer.choice
    finally:
        layer.close()
    assert comparison.passed, comparison.describe()
    assert f"experts:{choice.experts}" not in choice.refused, choice.describe()
    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor not in EXPERTS["flashinfer_trtllm"].capabilities.cuda_archs:
        assert "experts:flashinfer_trtllm" in choice.refused, choice.describe()
