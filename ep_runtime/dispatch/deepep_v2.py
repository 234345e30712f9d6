"""DeepEP V2 ``ElasticBuffer`` dispatcher (NCCL Device API: NVLink load/store, GIN RDMA).

One buffer per dispatcher, shared by all layers through ``acquire_dispatcher``; hybrid mode and
multiple reduction off (one fp32 reduction per token, at its source). DeepEP's own collectives
cannot carry a rank's status, so every dispatch starts with a small header all-to-all
``(status, chunk count, K)`` on the same group: read on the host in exact mode (and on CPU), kept
on the device in capacity mode on CUDA, where ``check()`` raises it.

What DeepEP hands back, and what this adapter makes of it (reference/deepep.md §2.2–2.4):
- STANDARD (``do_expand=False``): ``[R, K]`` *local* ids, -1 for other ranks' experts -> global
  int32 ids; rows past ``psum_num_recv_tokens_per_scaleup_rank[-1]`` are uninitialised -> padding.
- EXPANDED (``do_expand=True``): no ids, 1-D weights, rows grouped by local expert and padded to
  ``expert_alignment`` -> ``[N, 1]`` global ids from the group offsets (``searchsorted``); the valid
  bound is ``psum_num_recv_tokens_per_expert[-1]``.
- exact mode: ``do_cpu_sync=True`` (exact sizes). capacity mode: ``do_cpu_sync=False``, worst-case
  sizes, ``num_max_tokens_per_rank`` rounded up to a power of two (DeepEP JIT-compiles one kernel
  per value); the user's own cap is what inputs are checked against.

The library is injected (``load_library``), so the same adapter runs against an imitation in CPU
tests and against the real ``deep_ep`` on GPUs.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.dispatch.base import (
    DISPATCHERS,
    Dispatcher,
    DispatcherCapabilities,
    DispatchSetup,
    ForwardStatus,
    Pending,
)
from ep_runtime.dispatch.nccl_probe import (
    GinQuery,
    mapped_libnccl_paths,
    probe_library,
    query_gin,
)
from ep_runtime.expand import count_per_expert
from ep_runtime.experts.base import local_expert_index
from ep_runtime.types import (
    Dispatched,
    DispatchMode,
    EPInputError,
    TopkLayout,
)

# JIT compilation on one rank's first call stalls the others: vLLM uses 1800 s for the same reason.
TIMEOUT_SECS = 1800
# DeepEP's SM auto-detection falls to 4 SMs when `nvidia-smi nvlink -s` fails (containers,
# deepep.md §2.6). 24 is the README's "min #SM" EP8 row (643/675 GB/s on SM100).
DEFAULT_NUM_SMS = 24
NUM_SMS_ENV = "EP_RUNTIME_DEEPEP_NUM_SMS"
DISABLE_GIN_ENV = "EP_DISABLE_GIN"
HEADER_FIELDS = 3  # status, num_local_chunks, K


@dataclass(frozen=True)
class DeepEPLibrary:
    """The parts of ``deep_ep`` the adapter uses; CPU tests inject an imitation instead."""

    name: str
    buffer_class: Callable[..., Any]  # deep_ep.ElasticBuffer
    topk_idx_dtype: torch.dtype  # deep_ep.topk_idx_t: int64 by default, int32 by build option


class DeepEPUnavailableError(RuntimeError):
    """deep_ep is importable but is not DeepEP V2."""


def load_deep_ep() -> DeepEPLibrary:
    """Import ``deep_ep`` and check it is V2 (has ``ElasticBuffer``)."""
    import deep_ep

    version = getattr(deep_ep, "__version__", "(no __version__)")
    if not hasattr(deep_ep, "ElasticBuffer"):
        raise DeepEPUnavailableError(
            f"deep_ep {version} has no ElasticBuffer (a V1 build; DeepEP V2 >= 2.0 is needed)"
        )
    return DeepEPLibrary(f"deep_ep {version}", deep_ep.ElasticBuffer, deep_ep.topk_idx_t)


@functools.cache
def deep_ep_problems() -> tuple[str, ...]:
    """Why the real DeepEP V2 cannot run in this process (cached: imports once)."""
    problems = []
    nccl = probe_library()
    try:
        load_deep_ep()
    except ModuleNotFoundError as error:
        problems.append(f"deep_ep is not installed ({error}; see docs/deepep.md)")
    except Exception as error:  # undefined NCCL symbols, check_nccl_so() asserting, V1 only
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        problems.append(f"deep_ep V2 is not usable: {type(error).__name__}: {first_line}")
    loaded = mapped_libnccl_paths()
    if len(loaded) > 1:
        problems.append(f"torch and deep_ep load different libnccl files: {', '.join(loaded)}")
    if not (nccl.meets_deepep_minimum and nccl.has_query_properties):
        problems.append(nccl.describe())
    return tuple(problems)


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def default_num_sms(device: torch.device) -> int:
    """SMs for DeepEP's kernels: ``$EP_RUNTIME_DEEPEP_NUM_SMS``, else 24 (even, <= the device's)."""
    if NUM_SMS_ENV in os.environ:
        return int(os.environ[NUM_SMS_ENV])
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    device_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(DEFAULT_NUM_SMS, device_sms - device_sms % 2)


@dataclass(frozen=True)
class RankGin:
    """What one rank contributes to the GIN decision."""

    host: str
    gin: GinQuery
    disable_gin_env: str | None


def must_disable_gin(ranks: Sequence[RankGin]) -> bool:
    """Whether to set ``EP_DISABLE_GIN=1``; every rank sees the same ``ranks``, so decides alike.

    DeepEP asserts GIN for a group unless ``EP_DISABLE_GIN=1`` (nccl.cu:86-89): on one NVLink
    node that is fine (DeepEP#630), across nodes there is no path between them without GIN.
    """
    num_hosts = len({rank.host for rank in ranks})
    settings = {rank.disable_gin_env for rank in ranks}
    if len(settings) > 1:
        raise RuntimeError(
            f"{DISABLE_GIN_ENV} differs across ranks ({sorted(map(str, settings))}); "
            "DeepEP V2 needs the same value on every rank"
        )
    if settings == {"1"}:
        if num_hosts > 1:
            raise RuntimeError(
                f"{DISABLE_GIN_ENV}=1 is set, but the group spans {num_hosts} hosts: "
                "DeepEP V2 reaches other nodes only through NCCL GIN"
            )
        return True
    missing = [index for index, rank in enumerate(ranks) if not rank.gin.available]
    if not missing:
        return False
    if num_hosts == 1:
        return True
    first = missing[0]
    raise RuntimeError(
        f"DeepEP V2 across {num_hosts} hosts needs NCCL GIN on every rank; rank {first} "
        f"({ranks[first].host}): {ranks[first].gin.describe()}. GIN needs IBGDA-capable NICs "
        "(MLNX_OFED with libmlx5 >= MLX5_1.25, DeepEP#628) and NCCL >= 2.30.4"
    )


def prepare_gin(comm: Comm) -> str:
    """Probe GIN on every rank of the (warmed, NCCL) group; set ``EP_DISABLE_GIN=1`` on all of
    them on a single node without GIN, raise across nodes without it. Returns what was decided."""
    if comm.group is None or "nccl" not in comm.backend:
        return f"GIN not probed (group backend {comm.backend})"
    own = RankGin(socket.gethostname(), query_gin(comm.group), os.environ.get(DISABLE_GIN_ENV))
    ranks: list[RankGin] = comm.all_gather_object(own)  # type: ignore[assignment]
    if must_disable_gin(ranks):
        os.environ[DISABLE_GIN_ENV] = "1"
        return f"{own.gin.describe()}; single node: {DISABLE_GIN_ENV}=1 on every rank (NVLink)"
    return own.gin.describe()


@dataclass
class _Handle:
    buffer_handle: Any  # deep_ep.EPHandle
    num_tokens: int  # this rank's rows (DeepEP was given at least one)


@DISPATCHERS.register
class DeepEPV2Dispatcher(Dispatcher):
    """DeepEP V2 ``ElasticBuffer``: NVLink within a node, GIN RDMA across nodes."""

    name = "deepep_v2"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),  # combine is bf16-only (buffer.hpp combine)
    )
    auto_priority = 10
    expert_alignment: ClassVar[int] = 1  # EXPANDED group alignment (DeepEP's expert_alignment)

    @classmethod
    def load_library(cls) -> DeepEPLibrary:
        return load_deep_ep()

    @classmethod
    def environment_problems(cls, setup: DispatchSetup) -> list[str]:
        """Packages, NCCL, process group and GPUs (the real library's needs)."""
        problems = list(deep_ep_problems())
        comm = setup.comm
        if comm.group is None:
            problems.append("needs an initialised NCCL process group, even for one rank")
        elif "nccl" not in comm.backend:
            problems.append(f"needs an NCCL process group, this one is {comm.backend}")
        if comm.world_size > 1 and torch.cuda.device_count() < 2:
            problems.append(
                f"a group of {comm.world_size} ranks needs >= 2 GPUs, "
                f"this host has {torch.cuda.device_count()}"
            )
        return problems

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        problems = cls.environment_problems(setup)
        if (setup.hidden_size * setup.dtype.itemsize) % 16:
            problems.append(f"hidden_size={setup.hidden_size}: rows must be multiples of 16 bytes")
        return "; ".join(problems) or None

    def __init__(self, setup: DispatchSetup) -> None:
        super().__init__(setup)
        self.library = self.load_library()
        self.num_local = self.placement.num_local_experts
        self.local_offset = self.placement.local_expert_offset
        exact = setup.mode is DispatchMode.EXACT
        cap = setup.max_tokens_per_rank
        self.buffer_tokens = cap if exact else next_power_of_two(cap)
        self.num_sms = default_num_sms(setup.device)
        if self.comm.group is not None:  # torch creates communicators lazily: warm the group
            dist.all_reduce(torch.zeros(1, device=self.comm.device), group=self.comm.group)
        self.gin = prepare_gin(self.comm)
        self.buffer = self.library.buffer_class(
            self.comm.group,
            num_max_tokens_per_rank=self.buffer_tokens,
            hidden=setup.hidden_size,
            num_topk=setup.max_top_k,
            # the deterministic receive order sorts with boolean masks (a host sync): exact only
            deterministic=exact,
            allow_hybrid_mode=False,
            allow_multiple_reduction=False,
            prefer_overlap_with_compute=False,
            num_cpu_timeout_secs=TIMEOUT_SECS,
            num_gpu_timeout_secs=TIMEOUT_SECS,
            explicitly_destroy=True,
        )
        atexit.register(self._destroy_buffer)

    # ----------------------------------------------------------------- status header
    def _exchange_header(
        self, status: ForwardStatus, num_local_chunks: int, top_k: int
    ) -> torch.Tensor:
        """``[W, 3]`` int64: every rank's (status, chunk count, K), one all-to-all, no host sync."""
        send = torch.zeros(
            self.comm.world_size, HEADER_FIELDS, dtype=torch.int64, device=self.comm.device
        )
        send[:, 0] = int(status)
        send[:, 1] = num_local_chunks
        send[:, 2] = top_k
        received = torch.empty_like(send)
        self.comm.all_to_all_single(received, send)
        return received

    def _check_header(self, received: torch.Tensor, top_k: int) -> int:
        """Raise for any failed rank or a K that differs; returns the forward's chunk count.
        Capacity mode on CUDA records the statuses on the device instead (returns 1)."""
        if not self.host_reads_free:
            self.peer_status.record_on_device(received, top_k)
            return 1
        return self.peer_status.raise_on_host(received.tolist(), top_k)

    # ----------------------------------------------------------------- DeepEP calls
    def _dispatch_buffer(
        self,
        x: torch.Tensor,  # [T, H] bf16
        topk_ids: torch.Tensor,  # [T, K] global ids, -1 = unused
        topk_weights: torch.Tensor,  # [T, K] float32
        layout: TopkLayout,
    ) -> Dispatched:
        """Hand the rows to DeepEP: ids padded to the buffer's top-k with -1 (one JIT variant),
        at least one row (DeepEP's own tests never dispatch zero tokens: an empty rank sends one
        row routed nowhere)."""
        num_tokens, top_k = topk_ids.shape
        num_rows, device = max(num_tokens, 1), x.device
        ids = torch.full(
            (num_rows, self.setup.max_top_k), -1, dtype=self.library.topk_idx_dtype, device=device
        )
        ids[:num_tokens, :top_k] = topk_ids
        weights = torch.zeros(num_rows, self.setup.max_top_k, dtype=torch.float32, device=device)
        weights[:num_tokens, :top_k] = topk_weights
        rows = x.contiguous() if num_tokens else x.new_zeros(1, self.setup.hidden_size)
        recv_x, recv_ids, recv_weights, handle, _ = self.buffer.dispatch(
            rows,
            topk_idx=ids,
            topk_weights=weights,
            num_experts=self.setup.num_experts,
            num_max_tokens_per_rank=self.buffer_tokens,
            expert_alignment=self.expert_alignment,
            num_sms=self.num_sms,
            do_cpu_sync=self.setup.mode is DispatchMode.EXACT,
            do_expand=layout is TopkLayout.EXPANDED,
        )
        if layout is TopkLayout.STANDARD:
            dispatched = self._standard(
                recv_x, recv_ids[:, :top_k], recv_weights[:, :top_k], handle
            )
        else:
            dispatched = self._expanded(recv_x, recv_weights, handle)
        dispatched.handle = _Handle(handle, num_tokens)
        return dispatched

    def _filler(self) -> float:
        return float("nan") if self.setup.poison else 0.0

    def _standard(
        self,
        hidden: torch.Tensor,  # [R, H]
        local_ids: torch.Tensor,  # [R, K] local ids, -1 = another rank's expert
        weights: torch.Tensor,  # [R, K] float32
        handle: Any,
    ) -> Dispatched:
        num_rows = hidden.size(0)
        # 0-d: rows past it are uninitialised
        valid_rows = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
        row_valid = torch.arange(num_rows, device=hidden.device) < valid_rows  # [R]
        local = local_ids.to(torch.int64)
        served = (local >= 0) & row_valid.unsqueeze(1)  # [R, K]
        global_ids = torch.where(served, local + self.local_offset, torch.full_like(local, -1))
        global_ids = global_ids.to(torch.int32)
        weights = torch.where(served, weights.float(), torch.full_like(weights, self._filler()))
        if self.setup.poison:
            hidden = torch.where(row_valid.unsqueeze(1), hidden, torch.full_like(hidden, torch.nan))
        counts = count_per_expert(local_expert_index(global_ids, self.placement), self.num_local)
        return self._dispatched(
            hidden, global_ids, weights, TopkLayout.STANDARD, None, counts, valid_rows
        )

    def _expanded(
        self,
        hidden: torch.Tensor,  # [N, H] grouped by local expert, groups aligned
        weights: torch.Tensor,  # [N] float32
        handle: Any,
    ) -> Dispatched:
        """``[N, 1]`` global ids from the group offsets: ``psum[i]`` is expert i's aligned start
        plus its unaligned count (EPHandle docstring, elastic.py:25-57), no host sync."""
        psum = handle.psum_num_recv_tokens_per_expert.to(torch.int64)  # [L]
        alignment = self.expert_alignment
        aligned_ends = (psum + alignment - 1) // alignment * alignment
        starts = torch.cat([psum.new_zeros(1), aligned_ends[:-1]])  # [L] group starts
        rows = torch.arange(hidden.size(0), device=hidden.device)
        expert = torch.searchsorted(starts, rows, right=True) - 1  # [N] in [0, L)
        valid = rows < psum[expert]  # past a group's count: alignment padding or unused rows
        ids = torch.where(valid, expert + self.local_offset, torch.full_like(expert, -1))
        weights = torch.where(valid, weights.float(), torch.full_like(weights, self._filler()))
        if self.setup.poison:
            hidden = torch.where(valid.unsqueeze(1), hidden, torch.full_like(hidden, torch.nan))
        offsets = torch.cat([starts, psum[-1:]]).to(torch.int32)  # [L + 1], last = valid bound
        return self._dispatched(
            hidden,
            ids.to(torch.int32).unsqueeze(1),
            weights.unsqueeze(1),
            TopkLayout.EXPANDED,
            offsets,
            psum - starts,
            psum[-1],
        )

    def _dispatched(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        layout: TopkLayout,
        offsets: torch.Tensor | None,
        counts: torch.Tensor,  # [L]
        valid_bound: torch.Tensor,  # 0-d
    ) -> Dispatched:
        exact = self.setup.mode is DispatchMode.EXACT
        counts = counts.to(torch.int32)
        return Dispatched(
            hidden_states=hidden,
            topk_ids=ids,
            topk_weights=weights,
            layout=layout,
            expert_offsets=offsets,
            expert_num_tokens=counts,
            expert_num_tokens_cpu=counts.tolist() if exact else None,
            num_valid_rows=hidden.size(0) if exact else valid_bound,
            handle=None,
        )

    # ----------------------------------------------------------------- protocol
    def dispatch_async(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: TopkLayout,
        *,
        num_local_chunks: int = 1,
    ) -> Pending[Dispatched]:
        self._check_open()
        cap = self.setup.max_tokens_per_rank
        if x.size(0) > cap:  # the user's cap, not the (larger) power of two DeepEP is built for
            self.abort(
                EPInputError("x", f"at most max_tokens_per_rank={cap} rows", x.size(0)), layout
            )
        top_k = topk_ids.size(1)
        num_chunks = self._check_header(
            self._exchange_header(ForwardStatus.OK, num_local_chunks, top_k), top_k
        )
        dispatched = self._dispatch_buffer(x, topk_ids, topk_weights, layout)
        dispatched.num_chunks = num_chunks
        return Pending.completed(dispatched)

    def combine_async(
        self, expert_output: torch.Tensor, dispatched: Dispatched, out: torch.Tensor | None = None
    ) -> Pending[torch.Tensor]:
        """DeepEP's combine: an unweighted bf16 sum (experts applied the router weights)."""
        self._check_open()
        handle: _Handle = dispatched.handle
        combined, _, _ = self.buffer.combine(expert_output.contiguous(), handle.buffer_handle)
        combined = combined[: handle.num_tokens]  # [T, H]
        if out is None:
            return Pending.completed(combined)
        out.copy_(combined)
        return Pending.completed(out)

    def abort(self, error: BaseException, layout: TopkLayout) -> NoReturn:
        """Carry ``error``'s status in this forward's header, then raise it.

        exact, or capacity on CPU: every rank reads the header and raises (peers name this rank).
        capacity on CUDA (no host sync): peers cannot know yet, so this rank also takes part in
        DeepEP's dispatch (no rows routed) and combine (zeros), then raises; peers raise at
        their next ``check()``.
        """
        self._check_open()
        received = self._exchange_header(ForwardStatus.of(error), 1, self.setup.max_top_k)
        if self.host_reads_free:
            self.peer_status.raise_on_host(received.tolist(), self.setup.max_top_k, error)
        device, top_k = self.comm.device, self.setup.max_top_k
        dispatched = self._dispatch_buffer(
            torch.zeros(0, self.setup.hidden_size, dtype=self.setup.dtype, device=device),
            torch.full((0, top_k), -1, dtype=torch.int32, device=device),
            torch.zeros(0, top_k, dtype=torch.float32, device=device),
            layout,
        )
        self.combine(torch.zeros_like(dispatched.hidden_states), dispatched)
        raise error

    def _destroy_buffer(self) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.destroy()

    def close(self) -> None:
        """Destroy the DeepEP buffer (``explicitly_destroy=True``); also done at exit."""
        if not self._closed:
            atexit.unregister(self._destroy_buffer)
            self._destroy_buffer()
        super().close()
