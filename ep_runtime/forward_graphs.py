"""CUDA graphs of a layer's own eager forwards, at world size one with the checks on the device.

Such a forward (capacity mode, or exact mode with ``device_checks=True``, on CUDA, no peers)
reads nothing on the host: given its token count, the same kernels run on the same buffers
every time. So the layer runs the first forward of a count eagerly (kernels compile, tile
configs and buffers are sized), runs the second on a side stream and then captures a graph of
it there, and from the third on replays that graph: the host issues three copies in, one graph
launch and one copy out instead of every kernel and its Python. The replay's output is bitwise
the eager forward's (the same kernels and tile configs on the same data).

Memory: the graphs' inputs and output are shared by every layer with the same shapes
(``_StaticIO``, ``max_tokens`` rows, copied into before each replay and out of after it, in
stream order); what a forward allocates lives in one memory pool per device, shared by all
captures. So a device's layers run their forwards on one stream at a time (as a model's layers
do). Before a capture the experts drop their cached work buffers
(``Experts.release_workspace``) so the capture owns the ones it uses: a later forward that grows
them cannot free memory a graph still writes. New weights (``load_weights``, a rebalance) drop
the layer's graphs. A forward inside the caller's own capture, one timed by the launcher's phase
timer, of more than ``max_tokens`` tokens, or of a count beyond ``max_graphs`` runs eager; once
the caller has captured one of its forwards in its own graph the layer captures no more (that
graph holds its work buffers); a capture that fails turns this off for the layer with a warning
saying why (the device's pool is replaced: a failed capture leaves it unusable).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ep_runtime.types import EPInputError

# (x [T, H], ids [T, K], weights [T, K], out [T, H]) -> None: the layer's one-round forward
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class GraphPolicy:
    """Which eager forwards a layer replays as CUDA graphs (``EPMoE(forward_graphs=...)``)."""

    max_tokens: int = 512  # larger forwards (prefill) run eager: their graphs' memory is not free
    max_graphs: int = 8  # token counts captured per layer; forwards of other counts run eager

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EPInputError(f"forward_graphs.{name}", "an int >= 1", value)


DEFAULT_GRAPH_POLICY = GraphPolicy()


@dataclass(frozen=True)
class _Key:
    """What a graph is captured for besides the weights: the inputs' shapes and dtypes."""

    num_tokens: int
    top_k: int
    ids_dtype: torch.dtype
    weights_dtype: torch.dtype


class _StaticIO:
    """A graph's inputs and output: ``max_tokens`` rows each, a graph of T tokens reads and
    writes the first T."""

    def __init__(self, rows: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        with torch.inference_mode(False):  # normal tensors: copied into under any grad mode
            self.x = x.new_empty(rows, x.size(1))  # [rows, H]
            self.ids = ids.new_empty(rows, ids.size(1))  # [rows, K]
            self.weights = weights.new_empty(rows, weights.size(1))  # [rows, K]
            self.out = x.new_empty(rows, x.size(1))  # [rows, H]

    def rows(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """(x, ids, weights, out) of a graph of ``num_tokens`` tokens: their first rows."""
        return tuple(t[:num_tokens] for t in (self.x, self.ids, self.weights, self.out))


_IO: dict[tuple, _StaticIO] = {}  # by (rows, device, H, x dtype, K, ids and weights dtypes)
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # warm-up and capture stream


class _Pool:
    """A device's graph memory pool, with a one-kernel graph of its own that keeps it alive: a
    pool whose graphs are all gone (new weights, a layer collected) cannot be captured into
    again under the same handle."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self._cell = torch.zeros(1, device=device)
        self._anchor = torch.cuda.CUDAGraph()
        capture_on(stream, self._anchor, self.handle, lambda: self._cell.add_(1))


_POOLS: dict[torch.device, _Pool] = {}  # one per device (replaced after a failed capture)


def _static_io(rows: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> _StaticIO:
    key = (rows, x.device, x.size(1), x.dtype, ids.size(1), ids.dtype, weights.dtype)
    io = _IO.get(key)
    if io is None:  # never replaced: captured graphs read and write it
        io = _IO[key] = _StaticIO(rows, x, ids, weights)
    return io


class ForwardGraphs:
    """One layer's captured forwards, by token count (and K and dtypes)."""

    @staticmethod
    def where_capturable(
        policy: GraphPolicy | None,
        dispatcher: Any,
        experts: Any,
        release_workspace: Callable[[], None],
    ) -> ForwardGraphs | None:
        """Graphs for a layer of ``dispatcher`` and ``experts`` where its forwards read nothing
        on the host (CUDA, no peers, checks on the device, both backends capturable)."""
        checks = dispatcher.protocol.checks
        if policy is None or dispatcher.comm.device.type != "cuda" or checks.peers:
            return None
        capturable = (
            type(dispatcher).capabilities.graph_capturable
            and type(experts).capabilities.graph_capturable
        )
        return ForwardGraphs(policy, release_workspace) if checks.on_device and capturable else None

    def __init__(self, policy: GraphPolicy, release_workspace: Callable[[], None]) -> None:
        self.policy = policy
        self.release_workspace = release_workspace
        self.disabled_because: str | None = None
        self._graphs: dict[_Key, tuple[torch.cuda.CUDAGraph, _StaticIO]] = {}
        self._seen: set[_Key] = set()  # counts met once (run eager; the next is captured)

    @property
    def captured_token_counts(self) -> list[int]:
        return sorted(key.num_tokens for key in self._graphs)

    def clear(self) -> None:
        """Forget every graph (new weights: the captured ones read the old)."""
        self._graphs.clear()
        self._seen.clear()

    def takes(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` goes through here (else the caller runs eager).
        Once the caller has captured a forward of this layer in a graph of its own, that graph
        holds the layer's work buffers: they must never be released again, so the layer
        captures nothing more."""
        if torch.cuda.is_current_stream_capturing():
            self.disabled_because = "the caller captures this layer's forwards in its own graph"
            return False  # (graphs cannot be destroyed mid-capture: dropped at the next call)
        if self.disabled_because is not None:
            self.clear()
            return False
        return 1 <= num_tokens <= self.policy.max_tokens

    def run(
        self,
        forward: Forward,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
        out: torch.Tensor,  # [T, H]
    ) -> None:
        """``forward`` into ``out``: eager, captured, or replayed (see the module's docstring)."""
        key = _Key(x.size(0), topk_ids.size(1), topk_ids.dtype, topk_weights.dtype)
        captured = self._graphs.get(key)
        if captured is not None:
            graph, io = captured
            static_x, static_ids, static_weights, static_out = io.rows(key.num_tokens)
            static_x.copy_(x)
            static_ids.copy_(topk_ids)
            static_weights.copy_(topk_weights)
            graph.replay()
            out.copy_(static_out)
            return
        if key not in self._seen or len(self._graphs) >= self.policy.max_graphs:
            self._seen.add(key)
            forward(x, topk_ids, topk_weights, out)
            return
        self._capture(key, forward, x, topk_ids, topk_weights, out)

    def _capture(
        self,
        key: _Key,
        forward: Forward,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """This forward, run on the side stream the graph is then captured on."""
        device = x.device
        io = _static_io(self.policy.max_tokens, x, topk_ids, topk_weights)
        side = _SIDE_STREAMS.get(device)
        if side is None:
            side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        pool = _POOLS.get(device)
        if pool is None:
            pool = _POOLS[device] = _Pool(device, side)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            forward(x, topk_ids, topk_weights, out)  # this call's result (lazy inits on side)
        current.wait_stream(side)
        self.release_workspace()
        graph = torch.cuda.CUDAGraph()
        try:
            capture_on(side, graph, pool.handle, lambda: forward(*io.rows(key.num_tokens)))
        except Exception as error:  # this layer's forwards stay eager
            if _POOLS.get(device) is pool:  # a failed capture leaves its pool unusable
                del _POOLS[device]
            self.disabled_because = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"EPMoE: a CUDA graph of the eager forward could not be captured "
                f"({self.disabled_because}); this layer's forwards run eager from now on",
                stacklevel=4,
            )
            return
        self._graphs[key] = (graph, io)


def capture_on(
    stream: torch.cuda.Stream, graph: torch.cuda.CUDAGraph, pool: Any, work: Callable[[], Any]
) -> None:
    """Capture ``work`` into ``graph`` on ``stream``. ``torch.cuda.graph`` would also run a full
    garbage collection and empty the allocator's cache first (tens of ms in a process holding a
    model, at every capture); instead the collector is paused while capturing, so no tensor is
    freed by it mid-capture. An error in ``work`` is raised as it is (ending the broken capture
    raises one of its own, dropped)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                work()
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
    finally:
        if collecting:
            gc.enable()
