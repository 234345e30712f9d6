"""CUDA graphs of the EP blocks' decode forwards (``patch_moe_blocks(..., cuda_graph_tokens=N)``).

Each ``EPMoEBlock`` captures its whole forward (the router, the capacity-mode
``EPMoE`` and the shared experts) once per token count it meets, up to ``N`` tokens, and replays
it from then on: a decode step's MoE host work becomes one graph launch per block. Inputs of
more tokens (prefill) and of none (an idle rank) run eager. The replay runs the same kernels on
the same buffers as the eager forward, so its output is bitwise the eager one's.

Conditions, checked by ``check_graph_option`` before any layer is built: capacity mode (static
buffers, nothing read on the host), a CUDA device, a world of one (a capture of a multi-rank
forward would need every rank to replay the same collectives in step, which lockstep
generation with ranks of different token counts does not give), ``N`` within the cap (the
default 256 where none is given), and no expert load balancing (a rebalance moves the weights
a graph has captured, and its interval is counted by eager forwards only). The two eager
warm-up calls before each capture are forwards like any other (the expert load counts them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ep_runtime.config import DEFAULT_MAX_TOKENS_PER_RANK
from ep_runtime.experts import EXPERTS
from ep_runtime.forward_graphs import capture_on
from ep_runtime.types import DispatchMode, EPInputError

OPTION = "cuda_graph_tokens"
WARMUP_CALLS = 2  # eager calls on a side stream before a capture (lazy inits, allocator)


def check_graph_option(
    tokens: int | None,
    layer_options: dict[str, Any],
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> None:
    """Refuse ``cuda_graph_tokens`` where a block's forward cannot be a CUDA graph, naming why."""
    if tokens is None:
        return
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise EPInputError(OPTION, "an int >= 1 (the most tokens a captured forward takes)", tokens)
    mode = layer_options.get("mode", DispatchMode.EXACT)
    if mode not in (DispatchMode.CAPACITY, DispatchMode.CAPACITY.value):
        raise EPInputError(
            OPTION, "mode='capacity' (static buffers, no host reads)", f"mode={mode!r}"
        )
    experts = layer_options.get("experts", "auto")
    if experts in EXPERTS.names() and not EXPERTS[experts].capabilities.graph_capturable:
        raise EPInputError(
            OPTION, "experts whose forward reads nothing on the host", f"experts={experts!r}"
        )
    target = torch.device(layer_options.get("device") or device)
    if target.type != "cuda":
        raise EPInputError(OPTION, "a CUDA device", f"device={target}")
    world = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    if world != 1:
        raise EPInputError(OPTION, "a world of one rank", f"a group of {world} ranks")
    balancing = {
        name: layer_options.get(name)
        for name in ("num_redundant_experts", "eplb_interval")
        if layer_options.get(name)
    }
    if balancing:
        raise EPInputError(
            OPTION, "no expert load balancing (a rebalance moves captured weights)", balancing
        )
    cap = layer_options.get("max_tokens_per_rank") or DEFAULT_MAX_TOKENS_PER_RANK
    if isinstance(cap, int) and tokens > cap:
        raise EPInputError(OPTION, f"<= max_tokens_per_rank ({cap})", tokens)


@dataclass(frozen=True)
class _Capture:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [T, H] the graph's input, copied into before each replay
    out: torch.Tensor  # [T, H] the graph's output


class BlockGraphs:
    """One block's forward ``run(x [T, H]) -> [T, H]`` as CUDA graphs, one per token count
    ``1 <= T <= max_tokens``, captured at the first call with that count (``capture_on``: no
    garbage collection and cache flush per capture); the graphs of every block share one memory
    pool."""

    def __init__(
        self, run: Callable[[torch.Tensor], torch.Tensor], max_tokens: int, pool: Any
    ) -> None:
        self.run = run
        self.max_tokens = max_tokens
        self.pool = pool
        self._captures: dict[int, _Capture] = {}

    @property
    def captured_token_counts(self) -> list[int]:
        return sorted(self._captures)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens = x.size(0)
        if not 1 <= num_tokens <= self.max_tokens or torch.cuda.is_current_stream_capturing():
            return self.run(x)
        with torch.cuda.device(x.device):
            capture = self._captures.get(num_tokens)
            if capture is None:
                capture = self._captures[num_tokens] = self._capture(x)
            capture.x.copy_(x)
            capture.graph.replay()
            return capture.out.clone()  # the next replay overwrites the graph's output

    def _capture(self, x: torch.Tensor) -> _Capture:
        with torch.inference_mode(False):  # a normal tensor: copied into under any grad mode
            static_x = x.clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.run(static_x)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        outputs: list[torch.Tensor] = []
        capture_on(side, graph, self.pool, lambda: outputs.append(self.run(static_x)))
        return _Capture(graph, static_x, outputs[0])
