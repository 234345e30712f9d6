"""On a GPU machine: what the NCCL/GIN probe sees, and how ``dispatcher="auto"`` treats DeepEP V2.

Run from the repository root: ``python scripts/gpu_deepep_check.py``. It
1. prints the probe's one line (``python -m ep_runtime.dispatch.nccl_probe`` prints the same);
2. builds a one-rank NCCL process group and an ``EPMoE(..., dispatcher="auto")`` on CUDA, prints
   ``layer.choice.describe()`` and checks the layer against ``reference_moe``;
3. asks for ``dispatcher="deepep_v2"`` by name and prints the refusal (or that it was accepted).
Where deep_ep V2 cannot run (e.g. the H200 test machine as it comes: NCCL 2.28.9, no deep_ep) it
checks that "auto" fell back to torch_a2a and that the reason names the problems; where it can
run (there, with the source build in docs/deepep.md), that "auto" chose it. Exit status 0 only if
those checks hold.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_runtime import BackendUnavailableError, EPMoE, MoEConfig, reference_moe
from ep_runtime.dispatch.deepep_v2 import deep_ep_problems, first_dispatch_problem
from ep_runtime.dispatch.nccl_probe import describe_machine
from ep_runtime.tolerance import compare_per_token, tolerance_for

CONFIG = MoEConfig(
    num_experts=8, top_k=2, hidden_size=256, intermediate_size=192, max_tokens_per_rank=64
)


def report(title: str, ok: bool, detail: str) -> bool:
    print(f"[{'ok' if ok else 'FAIL'}] {title}\n    " + detail.replace("\n", "\n    "))
    return ok


def run_auto_layer() -> tuple[str, str, bool, str]:
    """(chosen dispatcher, choice description, matches the oracle, comparison line)."""
    layer = EPMoE(CONFIG, dispatcher="auto", device="cuda")
    try:
        generator = torch.Generator().manual_seed(0)
        w13 = torch.randn(8, 2 * 192, 256, generator=generator) / 16
        w2 = torch.randn(8, 256, 192, generator=generator) / 14
        layer.load_weights(w13, w2)
        x = torch.randn(40, 256, generator=generator).to(torch.bfloat16)
        ids = torch.rand(40, 8, generator=generator).topk(2, dim=1).indices
        weights = 0.25 + torch.rand(40, 2, generator=generator)
        out = layer(x.cuda(), ids.cuda(), weights.cuda()).cpu()
        ref = reference_moe(x, ids, weights, w13.bfloat16(), w2.bfloat16(), "silu")
        comparison = compare_per_token(out, ref, tolerance_for(torch.bfloat16, 256))
        return (
            layer.choice.dispatcher,
            layer.choice.describe(),
            comparison.passed,
            comparison.describe(),
        )
    finally:
        layer.close()


def named_deepep() -> str:
    start = time.monotonic()
    try:
        layer = EPMoE(CONFIG, dispatcher="deepep_v2", device="cuda")
    except BackendUnavailableError as error:
        return f"refused in {time.monotonic() - start:.2f} s:\n{error}"
    layer.close()
    return f"accepted ({layer.choice.describe().splitlines()[0]})"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"nccl_probe: {describe_machine()}")
    problems = list(deep_ep_problems())
    if not problems:  # installed: the adapter still tries a first dispatch before trusting it
        probe = first_dispatch_problem(torch.cuda.current_device())
        problems += [probe] if probe else []
    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group(
            "nccl", init_method=f"file://{rendezvous.name}", rank=0, world_size=1
        )
        try:
            chosen, description, matches, comparison = run_auto_layer()
            named = named_deepep()
        finally:
            dist.destroy_process_group()
    checks = [report("auto layer matches reference_moe", matches, comparison)]
    if problems:
        reason_ok = chosen == "torch_a2a" and all(p in description for p in problems)
        checks.append(
            report("auto fell back to torch_a2a, with DeepEP's reason", reason_ok, description)
        )
        checks.append(report("deepep_v2 by name is refused", named.startswith("refused"), named))
    else:
        checks.append(report("auto chose deepep_v2", chosen == "deepep_v2", description))
        checks.append(report("deepep_v2 by name is accepted", named.startswith("accepted"), named))
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
