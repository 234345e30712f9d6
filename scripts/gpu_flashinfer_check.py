"""On a GPU machine: show how the FlashInfer experts backends are refused or chosen, and how fast.

Run from the repository root: ``python scripts/gpu_flashinfer_check.py``. On the H200 test
machine (SM90) it shows that
1. asking for ``flashinfer_trtllm`` is refused at once (well under a second, no download
   attempt) with the reason, where calling the kernel would retry downloads for about a minute;
2. the cubin probe (run directly, as on an SM100 machine without cubins) names the missing
   manifest and the ``FLASHINFER_CUBIN_DIR`` hint, also at once;
3. ``flashinfer_cutlass`` named explicitly: refused at once if flashinfer or its built module is
   missing, else accepted once its self-check (run while backends are chosen) passed. The script
   sets ``EP_RUNTIME_FLASHINFER_CUTLASS_JIT=0`` unless it is set: a named backend's self-check
   would otherwise start the module's JIT build (tens of minutes);
4. ``experts="auto"`` picks another backend, prints every refusal (``layer.choice.describe()``)
   and that backend matches ``reference_moe``.
Exit status 0 only if all four hold. Works with or without flashinfer installed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_runtime import BackendUnavailableError, EPMoE, MoEConfig, reference_moe
from ep_runtime.experts.flashinfer_common import flashinfer_missing_reason
from ep_runtime.experts.flashinfer_cutlass import ALLOW_JIT_ENV
from ep_runtime.tolerance import compare_per_token, tolerance_for

REFUSAL_BUDGET_S = 1.0
CONFIG = MoEConfig(
    num_experts=8, top_k=2, hidden_size=256, intermediate_size=192, max_tokens_per_rank=64
)


def cubin_probe() -> str | None:
    """FlashInfer's missing reason, else the TRTLLM cubin probe's (None: cubins on disk)."""
    from ep_runtime.experts.flashinfer_trtllm import trtllm_cubins_missing_reason

    return flashinfer_missing_reason() or trtllm_cubins_missing_reason()


def timed_refusal(experts: str) -> tuple[str, float]:
    """Build a layer that asks for ``experts``; the refusal message and the seconds it took."""
    start = time.monotonic()
    try:
        layer = EPMoE(CONFIG, experts=experts, device="cuda")
    except BackendUnavailableError as error:
        return str(error), time.monotonic() - start
    layer.close()
    return f"NOT refused: chose {layer.choice.experts}", time.monotonic() - start


def report(title: str, ok: bool, detail: str) -> bool:
    print(f"[{'ok' if ok else 'FAIL'}] {title}\n    " + detail.replace("\n", "\n    "))
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine")
        return 2
    major, minor = torch.cuda.get_device_capability()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, SM{major}{minor}")
    os.environ.setdefault(ALLOW_JIT_ENV, "0")
    print(f"{ALLOW_JIT_ENV}={os.environ[ALLOW_JIT_ENV]}")
    start = time.monotonic()
    try:
        import flashinfer

        print(f"flashinfer {flashinfer.__version__} (import {time.monotonic() - start:.2f} s)")
    except Exception as error:
        print(f"flashinfer not importable: {type(error).__name__}: {error}")
    results = []

    message, seconds = timed_refusal("flashinfer_trtllm")
    results.append(
        report(
            f"flashinfer_trtllm requested: refused in {seconds * 1e3:.1f} ms",
            seconds < REFUSAL_BUDGET_S and "flashinfer_trtllm" in message and "NOT" not in message,
            message,
        )
    )

    start = time.monotonic()
    reason = cubin_probe()  # what unavailable_reason asks past the arch check
    seconds = time.monotonic() - start
    results.append(
        report(
            f"TRTLLM cubin probe (arch check bypassed): {seconds * 1e3:.1f} ms",
            seconds < REFUSAL_BUDGET_S
            and (reason is None or "FLASHINFER_CUBIN_DIR" in reason or "flashinfer" in reason),
            str(reason or "cubins present on disk"),
        )
    )

    message, seconds = timed_refusal("flashinfer_cutlass")
    accepted = message.startswith("NOT refused")  # its self-check passed while choosing
    results.append(
        report(
            f"flashinfer_cutlass requested: answered in {seconds * 1e3:.1f} ms",
            accepted or seconds < REFUSAL_BUDGET_S,
            message,
        )
    )

    layer = EPMoE(CONFIG, experts="auto", device="cuda")
    try:
        generator = torch.Generator().manual_seed(0)
        w13 = torch.randn(8, CONFIG.w13_rows, 256, generator=generator) / 16
        w2 = torch.randn(8, 256, 192, generator=generator) / 192**0.5
        x = torch.randn(37, 256, generator=generator)
        ids = torch.rand(37, 8, generator=generator).topk(2, dim=1).indices
        weights = 0.25 + torch.rand(37, 2, generator=generator)
        w13, w2, x = (t.to(torch.bfloat16) for t in (w13, w2, x))
        layer.load_weights(w13, w2)
        out = layer(x.cuda(), ids.cuda(), weights.cuda())
        comparison = compare_per_token(
            out, reference_moe(x, ids, weights, w13, w2), tolerance_for(torch.bfloat16, 256)
        )
        describe = layer.choice.describe()
    finally:
        layer.close()
    results.append(
        report(
            f'experts="auto" chose {layer.choice.experts}',
            layer.choice.experts != "flashinfer_trtllm"
            and "refused experts:flashinfer_trtllm" in describe
            and comparison.passed,
            f"{describe}\nvs reference_moe: {comparison.describe()}",
        )
    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
