"""DeepEP V2 ``ElasticBuffer`` dispatcher (NCCL Device API: NVLink load/store, GIN RDMA).

One buffer per dispatcher, shared by all layers through ``acquire_dispatcher``; hybrid mode and
multiple reduction off (one fp32 reduction per token, at its source). The forward header goes
through the base's all-to-all before DeepEP's dispatch; DeepEP's combine cannot carry a rank's
status, so a small status all-to-all on the same group follows it.

What DeepEP hands back, and what this adapter makes of it:
- STANDARD (``do_expand=False``): ``[R, K]`` *local* ids, -1 for other ranks' experts -> global
  int32 ids; rows past ``psum_num_recv_tokens_per_scaleup_rank[-1]`` are uninitialised -> padding.
- EXPANDED (``do_expand=True``): no ids, 1-D weights, rows grouped by local expert and padded to
  ``expert_alignment`` -> ``[N, 1]`` global ids from the group offsets (``searchsorted``); the valid
  bound is ``psum_num_recv_tokens_per_expert[-1]``.
- fp8 block-scaled experts: the rows go as the contract's ``q(x)`` (e4m3 and one fp32 scale per
  128 columns, quantized here by the ops' ``quantize_rows``), DeepEP's ``(x, sf)`` pair with
  ``use_fp8_dispatch=True``, and arrive as ``Dispatched.hidden_states_scale``; combine stays bf16.
- exact mode: ``do_cpu_sync=True`` (exact sizes), a buffer of the user's ``max_tokens_per_rank``
  or ``EXACT_BUFFER_TOKENS`` without one, declared as the layer's bound per round. capacity
  mode: ``do_cpu_sync=False``, worst-case sizes, ``num_max_tokens_per_rank`` rounded up to a
  power of two (DeepEP JIT-compiles one kernel per value); the layer checks inputs against the
  user's own cap.

The library is injected (``load_library``), so the same adapter runs against an imitation in CPU
tests and against the real ``deep_ep`` on GPUs. The SM count and GIN policy are in
``deepep_environment.py``.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher
from ep_runtime.dispatch.deepep_environment import default_num_sms, prepare_gin
from ep_runtime.dispatch.nccl_probe import mapped_libnccl_paths, probe_library
from ep_runtime.dispatch.protocol import Agreed
from ep_runtime.dispatch.setup import DispatcherCapabilities, DispatchSetup, PeerSetup
from ep_runtime.kernels import Route
from ep_runtime.quantization import BLOCK, FP8_DTYPE
from ep_runtime.types import Dispatched, DispatchMode, TopkLayout

EXACT_BUFFER_TOKENS = 4096  # exact mode without the user's bound: tokens per rank per round
# JIT compilation on one rank's first call stalls the others: vLLM uses 1800 s for the same reason.
TIMEOUT_SECS = 1800


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


# DeepEP V2's combine kernel moves a token's bf16 row as one warp's lanes x 16 bytes per step
# and static_asserts that H is a multiple of that (its JIT compile fails otherwise).
COMBINE_LANES = 32
COMBINE_BYTES_PER_LANE = 16
COMBINE_HIDDEN_MULTIPLE = COMBINE_LANES * COMBINE_BYTES_PER_LANE // torch.bfloat16.itemsize
PROBE_ENV = "EP_RUNTIME_DEEPEP_PROBE"  # "0": trust DeepEP's first dispatch without trying it
PROBE_TIMEOUT_S = 600  # the probe's dispatch JIT-compiles DeepEP's kernels
# A world of one on one GPU: build a small ElasticBuffer as the adapter does, dispatch one token
# and combine it. Run in a child process, so a crash there refuses the backend instead of
# killing the rank.
PROBE_SCRIPT = f"""
import os, tempfile, torch, torch.distributed as dist, deep_ep
torch.cuda.set_device(0)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("nccl", store=store, rank=0, world_size=1)
dist.all_reduce(torch.zeros(1, device="cuda"))
buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=8,
    hidden={COMBINE_HIDDEN_MULTIPLE}, num_topk=2, allow_hybrid_mode=False,
    allow_multiple_reduction=False, explicitly_destroy=True)
ids = torch.tensor([[0, -1]], dtype=deep_ep.topk_idx_t, device="cuda")
x = torch.zeros(1, {COMBINE_HIDDEN_MULTIPLE}, dtype=torch.bfloat16, device="cuda")
recv = buffer.dispatch(x, topk_idx=ids,
    topk_weights=torch.ones(1, 2, device="cuda"), num_experts=2, num_max_tokens_per_rank=8,
    expert_alignment=1, num_sms=2, do_cpu_sync=True, do_expand=False)
buffer.combine(recv[0], recv[3])
buffer.destroy()
dist.destroy_process_group()
"""
PROBE_COMMAND = [sys.executable, "-c", PROBE_SCRIPT]


@functools.cache
def first_dispatch_problem(device_index: int) -> str | None:
    """Why DeepEP's first dispatch cannot be trusted here, or None. A build of deep_ep that
    carries its own static copy of libstdc++ imports and constructs its buffer, then crashes the
    process in its first dispatch, on the host, in its JIT (docs/deepep.md): a rank must not
    find that out in the middle of a forward. So it is tried once per process and GPU, in a
    child process."""
    if os.environ.get(PROBE_ENV) == "0":
        return None
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(device_index)}
    try:
        done = subprocess.run(
            PROBE_COMMAND, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"DeepEP's first dispatch did not finish in {PROBE_TIMEOUT_S} s in a probe process"
    if done.returncode == 0:
        return None
    hint = f"(docs/deepep.md; {PROBE_ENV}=0 skips this probe)"
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        cause = (
            " (a known cause: deep_ep built with a compiler that links libstdc++ statically;"
            " rebuild it with the system g++)"
            if name == "SIGSEGV"
            else ""
        )
        return f"DeepEP's first dispatch killed a probe process with {name}{cause} {hint}"
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return (
        f"DeepEP's first dispatch failed in a probe process (exit {done.returncode}: {last}) {hint}"
    )


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


@dataclass(frozen=True)
class DeepEPPacked:
    """This rank's rows, with ids cleaned by the route."""

    x: torch.Tensor  # [T, H] bf16, or e4m3 q(x) with fp8 dispatch
    scale: torch.Tensor | None  # [T, H/128] fp32 scales of q(x) (fp8 dispatch), else None
    topk_ids: torch.Tensor  # [T, K] int32 global ids, -1 = unused (invalid ones dropped)
    topk_weights: torch.Tensor  # [T, K] float


@dataclass(frozen=True)
class DeepEPHandle:
    """What combine needs of a dispatch."""

    buffer_handle: Any  # deep_ep.EPHandle
    num_tokens: int  # this rank's rows (DeepEP was given at least one)


@DISPATCHERS.register
class DeepEPV2Dispatcher(Dispatcher[DeepEPPacked, DeepEPHandle, torch.Tensor]):
    """DeepEP V2 ``ElasticBuffer``: NVLink within a node, GIN RDMA across nodes."""

    name = "deepep_v2"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),  # combine is bf16-only (buffer.hpp combine)
        rebuilds_on_new_group=True,
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
    def first_dispatch_problems(cls, setup: DispatchSetup) -> list[str]:
        """Whether DeepEP's first dispatch survives here (a child-process probe, cached)."""
        problem = first_dispatch_problem(setup.device.index or 0)
        return [problem] if problem else []

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        problems = cls.environment_problems(setup)
        if setup.hidden_size % COMBINE_HIDDEN_MULTIPLE:
            problems.append(
                f"hidden_size={setup.hidden_size}: DeepEP V2's combine needs a multiple of "
                f"{COMBINE_HIDDEN_MULTIPLE} ({COMBINE_LANES} lanes x {COMBINE_BYTES_PER_LANE} "
                "bytes of bf16 per step)"
            )
        if not problems:  # everything else is fine: the probe last, it can take minutes
            problems += cls.first_dispatch_problems(setup)
        return "; ".join(problems) or None

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        super().__init__(setup, peer_setup)
        self.library = self.load_library()
        self.local = self.placement.local
        exact = setup.mode is DispatchMode.EXACT
        cap = setup.max_tokens_per_rank
        if exact:
            self.buffer_tokens = EXACT_BUFFER_TOKENS if cap is None else cap
            self.max_round_tokens = self.buffer_tokens
        else:
            assert cap is not None  # capacity mode always has its cap
            self.buffer_tokens = next_power_of_two(cap)
        self.num_sms = default_num_sms(setup.device)
        self.fp8_dispatch = setup.quantization is not None
        if self.comm.group is not None:  # torch creates communicators lazily: warm the group
            dist.all_reduce(torch.zeros(1, device=self.comm.device), group=self.comm.group)
        self.gin = prepare_gin(self.comm)
        self.buffer = self.library.buffer_class(
            self.comm.group,
            num_max_tokens_per_rank=self.buffer_tokens,
            hidden=setup.hidden_size,
            num_topk=setup.max_top_k,
            use_fp8_dispatch=self.fp8_dispatch,
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

    # ----------------------------------------------------------------- dispatch
    def _pack(self, x: torch.Tensor, topk_weights: torch.Tensor, route: Route) -> DeepEPPacked:
        """The rows as they go: bf16, or ``q(x)`` with fp8 dispatch."""
        if not self.fp8_dispatch:
            return DeepEPPacked(x, None, route.ids, topk_weights)
        num_tokens, hidden = x.shape
        q = torch.empty(num_tokens, hidden, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(num_tokens, hidden // BLOCK, dtype=torch.float32, device=x.device)
        self.ops.quantize_rows(x.contiguous(), q, scale)
        return DeepEPPacked(q, scale, route.ids, topk_weights)

    def _rows(self, packed: DeepEPPacked) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """DeepEP's ``x``: at least one row (an empty rank sends one zero row routed nowhere),
        with its scales as the ``(e4m3, sf)`` pair under fp8 dispatch."""
        hidden = self.setup.hidden_size
        if packed.x.size(0):
            rows, scale = packed.x.contiguous(), packed.scale
        else:
            rows = torch.zeros(1, hidden, dtype=packed.x.dtype, device=packed.x.device)
            scale = None if packed.scale is None else packed.scale.new_ones(1, hidden // BLOCK)
        return rows if scale is None else (rows, scale)

    def _exchange_dispatch(
        self, packed: DeepEPPacked, agreed: Agreed, layout: TopkLayout
    ) -> tuple[Dispatched, DeepEPHandle]:
        """Hand the rows to DeepEP: ids in ``topk_idx_t`` padded to the buffer's top-k with -1
        (one JIT variant), weights zero on unused slots, at least one row (DeepEP's own tests
        never dispatch zero tokens)."""
        top_k = agreed.top_k
        num_tokens, own_k = packed.topk_ids.shape
        num_rows, max_k, device = max(num_tokens, 1), self.setup.max_top_k, packed.x.device
        ids = torch.full((num_rows, max_k), -1, dtype=self.library.topk_idx_dtype, device=device)
        ids[:num_tokens, :own_k] = packed.topk_ids
        weights = torch.zeros(num_rows, max_k, dtype=torch.float32, device=device)
        weights[:num_tokens, :own_k] = torch.where(
            packed.topk_ids >= 0, packed.topk_weights.float(), 0.0
        )
        recv_x, recv_ids, recv_weights, buffer_handle, _ = self.buffer.dispatch(
            self._rows(packed),
            topk_idx=ids,
            topk_weights=weights,
            num_experts=self.setup.num_experts,
            num_max_tokens_per_rank=self.buffer_tokens,
            expert_alignment=self.expert_alignment,
            num_sms=self.num_sms,
            do_cpu_sync=self.setup.mode is DispatchMode.EXACT,
            do_expand=layout is TopkLayout.EXPANDED,
        )
        handle = DeepEPHandle(buffer_handle, num_tokens)
        recv_x, recv_scale = recv_x if self.fp8_dispatch else (recv_x, None)
        if layout is TopkLayout.STANDARD:
            global_ids, row_weights, valid = self._standard(
                recv_ids[:, :top_k], recv_weights[:, :top_k], buffer_handle
            )
            offsets = None
        else:
            global_ids, row_weights, valid, offsets = self._expanded(recv_weights, buffer_handle)
        hidden, scale = self._poisoned(recv_x, recv_scale, valid)
        dispatched = Dispatched(
            hidden, global_ids, row_weights, layout, offsets, hidden_states_scale=scale
        )
        return dispatched, handle

    def _filler(self) -> float:
        return float("nan") if self.setup.poison else 0.0

    def _standard(
        self,
        local_ids: torch.Tensor,  # [R, K] local ids, -1 = another rank's expert
        weights: torch.Tensor,  # [R, K] float32
        buffer_handle: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(global ids [R, K] int32, weights [R, K], valid rows [R])``; rows past DeepEP's
        valid count (uninitialised) become padding."""
        num_rows = local_ids.size(0)
        valid_rows = buffer_handle.psum_num_recv_tokens_per_scaleup_rank[-1]  # 0-d
        row_valid = torch.arange(num_rows, device=local_ids.device) < valid_rows  # [R]
        served = (local_ids >= 0) & row_valid.unsqueeze(1)  # [R, K]
        global_ids = self.local.to_global(local_ids, served)
        weights = torch.where(served, weights.float(), self._filler())
        return global_ids, weights, row_valid

    def _expanded(
        self,
        weights: torch.Tensor,  # [N] float32, rows grouped by local expert, groups aligned
        buffer_handle: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [N, 1] int32, weights [N, 1], valid rows [N], offsets [L + 1] int32)``. Ids
        come from the group offsets: ``psum[i]`` is expert i's aligned start plus its unaligned
        count (DeepEP's ``EPHandle`` docstring), no host sync."""
        psum = buffer_handle.psum_num_recv_tokens_per_expert.to(torch.int64)  # [L]
        alignment = self.expert_alignment
        aligned_ends = (psum + alignment - 1) // alignment * alignment
        starts = torch.cat([psum.new_zeros(1), aligned_ends[:-1]])  # [L] group starts
        rows = torch.arange(weights.size(0), device=weights.device)
        expert = torch.searchsorted(starts, rows, right=True) - 1  # [N] in [0, L)
        valid = rows < psum[expert]  # past a group's count: alignment padding or unused rows
        ids = self.local.to_global(expert, valid)
        weights = torch.where(valid, weights.float(), self._filler())
        offsets = torch.cat([starts, psum[-1:]]).to(torch.int32)  # [L + 1], last = valid bound
        return ids.unsqueeze(1), weights.unsqueeze(1), valid, offsets

    def _poisoned(
        self,
        hidden: torch.Tensor,  # [R, H] bf16 or e4m3
        scale: torch.Tensor | None,  # [R, H/128] fp32 (fp8 dispatch)
        valid: torch.Tensor,  # [R] bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In poison mode, NaN in the rows that hold no token: in the scales under fp8 dispatch
        (an e4m3 row times a NaN scale is NaN), else in the rows."""
        if not self.setup.poison:
            return hidden, scale
        if scale is not None:
            return hidden, torch.where(valid.unsqueeze(1), scale, float("nan"))
        return torch.where(valid.unsqueeze(1), hidden, float("nan")), None

    # ----------------------------------------------------------------- combine
    def _exchange_combine(
        self,
        expert_output: torch.Tensor | None,  # [R, H]
        dispatched: Dispatched,
        handle: DeepEPHandle,
        status: torch.Tensor | None,  # [HEADER_INTS] int32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DeepEP's combine (an unweighted bf16 sum: the experts applied the router weights),
        then every rank's status in a ``[W, HEADER_INTS]`` all-to-all."""
        if expert_output is None:
            shape = dispatched.hidden_states.shape
            expert_output = torch.zeros(shape, dtype=self.setup.dtype, device=self.comm.device)
        combined, _, _ = self.buffer.combine(expert_output.contiguous(), handle.buffer_handle)
        combined = combined[: handle.num_tokens]  # [T, H]
        if status is None:
            return combined, None
        statuses = self.comm.all_to_all(status.expand(self.comm.world_size, -1).contiguous())
        return combined, statuses  # [W, HEADER_INTS]

    def _reduce(
        self,
        combined: torch.Tensor,  # [T, H]
        handle: DeepEPHandle,
        out: torch.Tensor | None,
        failed: torch.Tensor | None,
    ) -> torch.Tensor:
        if failed is not None:
            combined = torch.where(failed != 0, float("nan"), combined)
        if out is None:
            return combined
        out.copy_(combined)
        return out

    # ----------------------------------------------------------------- life cycle
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
