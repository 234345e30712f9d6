"""On one GPU with NVSHMEM: run torch_symm_mem's real transport at world size 1 against torch_a2a.

Run from the repository root: ``python scripts/gpu_symm_mem_check.py``. The dispatcher refuses
groups of one, so the script builds it directly on a one-rank NCCL group. At world size 1 only the
dispatch goes through ``all_to_all_vdev_2d`` (a combine within one rank moves nothing), so this
checks the NVSHMEM backend switch, symmetric allocation and rendezvous, the op's schema and its
one-bucket layout with one rank, for each mode and layout, over two forwards (the second smaller,
on the same buffers): the dispatched rows and the combine output must equal torch_a2a's, bit for
bit. It says nothing of two or more ranks. Exit status 0 only if every comparison holds.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_runtime.comm import Comm
from ep_runtime.dispatch.base import Dispatcher, DispatchSetup, LayerIdentity, PeerSetup
from ep_runtime.dispatch.peers import PeerIdentity
from ep_runtime.dispatch.torch_a2a import TorchAllToAll
from ep_runtime.dispatch.torch_symm_mem import TorchSymmMemDispatcher, symm_mem_problems
from ep_runtime.types import Dispatched, DispatchMode, TopkLayout

LAYER = LayerIdentity(fingerprint=1, index=0)
NUM_EXPERTS, HIDDEN, TOP_K, CAP = 8, 256, 3, 16


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]`` small integers, ``ids [T, K]`` distinct (one row unused), dyadic weights."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-15, 16, (num_tokens, HIDDEN), generator=generator).to(torch.bfloat16)
    ids = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).topk(TOP_K, dim=1).indices
    ids[num_tokens // 2] = -1
    weights = torch.randint(1, 5, ids.shape, generator=generator).float() / 8
    return x.cuda(), ids.cuda(), weights.cuda()


def weighted_identity(dispatched: Dispatched) -> torch.Tensor:
    served = dispatched.topk_ids >= 0
    weight = torch.where(served, dispatched.topk_weights, 0.0).sum(1, keepdim=True)
    rows = torch.where(served.any(1, keepdim=True), dispatched.hidden_states.float(), 0.0)
    return (weight * rows).to(dispatched.hidden_states.dtype)


def compare(mode: DispatchMode, layout: TopkLayout, comm: Comm) -> list[str]:
    """Differences between the two dispatchers over two forwards (empty: none)."""
    setup = DispatchSetup(comm, NUM_EXPERTS, HIDDEN, TOP_K, CAP, torch.bfloat16, mode)
    peer_setup = PeerSetup(f"check/{mode.value}/{layout.value}", [PeerIdentity.of_this_process()])
    dispatchers: list[Dispatcher] = [
        TorchAllToAll(setup, peer_setup),
        TorchSymmMemDispatcher(setup, peer_setup),
    ]
    problems = []
    try:
        for num_tokens, seed in ((CAP, 0), (3, 1)):
            x, ids, weights = inputs(num_tokens, seed)
            results = []
            for dispatcher in dispatchers:
                dispatched, _ = dispatcher.dispatch(x, ids, weights, layout, layer=LAYER)
                out = dispatcher.combine(weighted_identity(dispatched), dispatched)
                results.append((dispatched, out))
            (a, a_out), (b, b_out) = results
            for name in ("hidden_states", "topk_ids", "topk_weights", "expert_offsets"):
                left, right = getattr(a, name), getattr(b, name)
                if left is None and right is None:
                    continue
                if left.shape != right.shape or not torch.equal(bits(left), bits(right)):
                    problems.append(f"{num_tokens} tokens: {name} differs")
            if not torch.equal(a_out, b_out):
                problems.append(f"{num_tokens} tokens: combine output differs")
        torch.cuda.synchronize()
    finally:
        for dispatcher in dispatchers:
            dispatcher.close()
    return problems


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    missing = symm_mem_problems()
    if missing:
        print("not runnable here: " + "; ".join(missing))
        return 2
    torch.cuda.set_device(0)
    failures = 0
    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group(
            "nccl", init_method=f"file://{rendezvous.name}", rank=0, world_size=1
        )
        try:
            comm = Comm.create(dist.group.WORLD, torch.device("cuda", 0))
            for mode in DispatchMode:
                for layout in TopkLayout:
                    try:
                        problems = compare(mode, layout, comm)
                    except Exception as error:
                        problems = [f"raised {type(error).__name__}: {error}"]
                    verdict = "ok" if not problems else "FAIL"
                    print(f"[{verdict}] {mode.value} {layout.value}: " + ("; ".join(problems)))
                    failures += bool(problems)
        finally:
            dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
