"""An IMITATION of ``deep_ep.ElasticBuffer`` (DeepEP V2), for testing ep_runtime's adapter only.

This is not DeepEP and shares no code with it. It reproduces, in plain torch over a
torch.distributed group (gloo on CPU) or a world of one, the dispatch/combine *semantics* the
adapter relies on, as DeepEP's own code and tests at commit dd758ca define them (file:line
below; docs/deepep.md says what the adapter takes from them). A test
passing against it says the adapter handles those semantics; it says nothing about the real
library, whose tests live in tests/multigpu/test_deepep_real.py.

Imitated (each with its source):
- constructor signature and ``destroy()`` with ``explicitly_destroy=True``: DeepEP
  (elastic.py:228; ``destroy`` asserts ``explicitly_destroy``).
- ``topk_idx`` must be ``deep_ep.topk_idx_t``: ``EP_NUM_TOPK_IDX_BITS``;
  buffer.hpp reads ``topk_idx.data_ptr<topk_idx_t>()``.
- STANDARD: one row per (token, receiving rank), *local* ids with -1 for other ranks' experts:
  dispatch_copy_epilogue.cuh:104-109. Weights on -1 slots are unspecified
  (DeepEP's tests/elastic/test_ep.py masks them before comparing): NaN here.
- received rows grouped by source rank, order within a source unspecified (test_ep.py sorts by
  ``recv_src_metadata[:, 0]`` before comparing): reversed here, so no adapter relies on it.
- ``do_cpu_sync=False``: worst-case sizes ``R = W·num_max_tokens_per_rank`` and
  ``N = W·maxT·min(K, L) + (a-1)·L`` aligned; rows past the valid count are uninitialised:
  DeepEP and buffer.hpp ("allocate with the worst case"; ``torch::empty``). Here they
  hold NaN rows, NaN weights and id 0 (a valid-looking local id).
- EXPANDED: no ids, 1-D weights, rows grouped by local expert, each group padded to
  ``expert_alignment``; ``psum_num_recv_tokens_per_expert[i]`` = aligned start of expert i plus
  its unaligned count: buffer.hpp:1075-1110, EPHandle docstring
  (elastic.py:25-57), test_ep.py "Zero padding checks". Gap rows hold NaN unless
  ``do_zero_padding`` (test_ep.py: "its padding isn't initialized").
- combine: bf16 only, an unweighted sum of the rows each token was sent, reduced once in fp32 at
  the source with ``allow_multiple_reduction=False``: combine.cuh:216-224;
  buffer.hpp combine asserts bf16 and ``topk_weights`` absent in the expanded layout;
  combine.cuh static_asserts ``hidden % 256 == 0`` (its JIT compile fails otherwise).
- fp8 dispatch: ``x`` is the pair ``(e4m3 [T, H], sf [T, S])`` with 4-byte scale packs
  (fp32 here), moved as they are and handed back as the same pair (elastic.py dispatch
  docstring "recv_x: the same type and tuple as the input"; buffer.hpp asserts
  ``sf->element_size() == sizeof(sf_pack_t)`` and writes ``recv_sf`` row-major ``[R, S]`` without
  ``use_tma_aligned_col_major_sf``); the buffer must be built with ``use_fp8_dispatch=True``
  (its size counts the scales). Uninitialised rows hold all-ones bytes here: NaN in bf16, e4m3
  and fp32 alike.
- zero tokens on a rank: not imitated (DeepEP's test_ep.py always dispatches >= 1 token).

Not imitated (refused): ``allow_multiple_reduction=True``, cached handles, bias, the TMA-aligned
scale layout, SM auto-detection (``num_sms=0``; DeepEP: it falls to 4 SMs in containers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm, SingleRankComm
from ep_runtime.dispatch.base import DISPATCHERS
from ep_runtime.dispatch.deepep_v2 import DeepEPLibrary, DeepEPV2Dispatcher
from ep_runtime.dispatch.setup import DispatchSetup

topk_idx_t = torch.int64  # deep_ep.topk_idx_t's default width (DeepEP)
INVALID_LOCAL_ID = 0  # what "uninitialised" id rows hold here: a valid-looking local expert
UNINITIALISED_BYTE = 0xFF  # what "uninitialised" row bytes hold here: NaN in bf16, e4m3, fp32


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass
class ImitationEvent:
    """``EventOverlap``: nothing to wait for on the CPU."""

    def current_stream_wait(self) -> None:
        pass


@dataclass
class ImitationHandle:
    """``EPHandle``'s fields the adapter may read (DeepEP), plus the return routes."""

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor  # [T, K] clone of the input ids
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]  # aligned counts; empty without CPU sync
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor  # [W] int32 inclusive
    psum_num_recv_tokens_per_expert: torch.Tensor  # [L] int32
    num_unaligned_recv_tokens_per_expert: torch.Tensor | None  # [L] int32, expand only
    recv_src_metadata: torch.Tensor  # [R_alloc, K + 2]: src global index, -1, expanded slots
    # combine's routes, one entry per row sent back: (row of combine's input, source rank)
    return_rows: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]
    return_ranks: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]
    return_tokens: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]
    num_allocated_rows: int = 0


class ImitationElasticBuffer:
    """Imitation of ``deep_ep.ElasticBuffer`` for adapter tests; see the module docstring."""

    topk_idx_dtype: ClassVar[torch.dtype] = topk_idx_t  # the build's deep_ep.topk_idx_t

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        self.constructor_kwargs = dict(locals())
        del self.constructor_kwargs["self"], self.constructor_kwargs["group"]
        if allow_multiple_reduction:
            raise NotImplementedError("imitated: allow_multiple_reduction=False only")
        self.use_fp8_dispatch = use_fp8_dispatch
        cpu = torch.device("cpu")
        self.comm = SingleRankComm(cpu) if group is None else Comm.create(group, cpu)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        self.comm.barrier()  # the real constructor ends with a barrier

    def destroy(self) -> None:
        assert self.explicitly_destroy  # elastic.py destroy()
        self.destroyed = True

    # ----------------------------------------------------------------- helpers
    def _exchange(self, tensors: list[torch.Tensor], send_counts: list[int]) -> list[torch.Tensor]:
        """Uneven all-to-all of row-aligned tensors grouped by destination rank."""
        sent = torch.tensor(send_counts, dtype=torch.int64)
        received = torch.empty_like(sent)
        self.comm.all_to_all_single(received, sent)
        recv_counts = received.tolist()
        results = []
        for tensor in tensors:
            out = tensor.new_empty(sum(recv_counts), *tensor.shape[1:])
            self.comm.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts)
            results.append(out)
        return [*results, torch.tensor(recv_counts, dtype=torch.int64)]

    def _check_open(self) -> None:
        if self.destroyed:
            raise RuntimeError("ImitationElasticBuffer used after destroy()")

    # ----------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: Any = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, ImitationHandle, ImitationEvent]:
        self._check_open()
        if handle is not None or num_sms == 0 or use_tma_aligned_col_major_sf:
            raise NotImplementedError("not imitated: cached handles, num_sms=0, TMA-aligned sf")
        if topk_idx is None or topk_weights is None or num_experts is None:
            raise NotImplementedError("imitated: topk_idx, topk_weights and num_experts given")
        max_tokens = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        alignment = expert_alignment or 1
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        x, sf = x if isinstance(x, tuple) else (x, None)
        num_tokens, hidden = x.shape
        top_k = topk_idx.size(1)
        if sf is None:
            assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x: contiguous bf16"
        else:
            assert self.use_fp8_dispatch, "fp8 input needs a buffer built with use_fp8_dispatch"
            assert x.dtype == torch.float8_e4m3fn and x.is_contiguous(), "x: contiguous e4m3"
            assert sf.dim() == 2 and sf.size(0) == num_tokens and sf.element_size() == 4, "sf"
        payload = _payload(x, sf)  # [T, bytes] every byte a row carries
        assert hidden == self.hidden and top_k <= self.num_topk, "buffer sized for hidden/top-k"
        assert topk_idx.dtype == self.topk_idx_dtype, f"topk_idx must be {self.topk_idx_dtype}"
        assert topk_weights.dtype == torch.float32 and topk_weights.shape == topk_idx.shape
        assert 0 < num_tokens <= max_tokens, f"need 1 <= T <= {max_tokens}, got {num_tokens}"

        world, rank = self.comm.world_size, self.comm.rank
        num_local = num_experts // world
        ids = topk_idx.to(torch.int64)
        destination = torch.where(ids >= 0, ids // num_local, torch.full_like(ids, world))
        goes_to = torch.zeros(num_tokens, world + 1, dtype=torch.bool)
        goes_to.scatter_(1, destination, True)
        pairs = goes_to[:, :world].t().nonzero()  # [S, 2] (rank, token), by rank then token
        tokens = pairs[:, 1]
        send_counts = goes_to[:, :world].sum(0).tolist()
        source_index = rank * max_tokens + tokens  # the "global index" in recv_src_metadata
        recv_x, recv_ids, recv_weights, recv_source, recv_counts = self._exchange(
            [payload[tokens], ids[tokens], topk_weights[tokens], source_index], send_counts
        )
        # order within a source rank is unspecified: reverse it
        order = torch.cat(
            [
                torch.arange(end - 1, end - count - 1, -1)
                for end, count in zip(
                    recv_counts.cumsum(0).tolist(), recv_counts.tolist(), strict=True
                )
            ]
        )
        recv_x, recv_ids = recv_x[order], recv_ids[order]
        recv_weights, recv_source = recv_weights[order], recv_source[order]
        num_recv = recv_x.size(0)

        local = recv_ids - rank * num_local
        served = (recv_ids >= 0) & (local >= 0) & (local < num_local)
        local_ids = torch.where(served, local, torch.full_like(local, -1))
        counts = torch.zeros(num_local + 1, dtype=torch.int64)
        counts.scatter_add_(
            0,
            torch.where(served, local, num_local).reshape(-1),
            torch.ones(local.numel(), dtype=torch.int64),
        )
        counts = counts[:num_local]
        aligned = [_align(c, alignment) for c in counts.tolist()]
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts.to(torch.int32)

        allocated = num_recv if do_cpu_sync else world * max_tokens
        metadata = torch.full((allocated, top_k + 2), -1, dtype=torch.int32)
        metadata[:num_recv, 0] = recv_source.to(torch.int32)
        psum_rank = recv_counts.cumsum(0).to(torch.int32)
        nan = float("nan")
        if not do_expand:
            out_x = _uninitialised(allocated, recv_x)
            out_x[:num_recv] = recv_x
            out_ids = torch.full((allocated, top_k), INVALID_LOCAL_ID, dtype=self.topk_idx_dtype)
            out_ids[:num_recv] = local_ids.to(self.topk_idx_dtype)
            out_weights = torch.full((allocated, top_k), nan, dtype=torch.float32)
            out_weights[:num_recv] = torch.where(
                served, recv_weights, torch.full_like(recv_weights, nan)
            )
            psum_expert = torch.tensor(aligned, dtype=torch.int64).cumsum(0).to(torch.int32)
            return_rows = torch.arange(num_recv)
            return_tokens = recv_source % max_tokens
            return_ranks = recv_source // max_tokens
            unaligned = None
            num_expanded = sum(aligned)
        else:
            starts = [sum(aligned[:e]) for e in range(num_local)]
            if do_cpu_sync:
                num_expanded = sum(aligned)
            else:
                num_expanded = world * max_tokens * min(top_k, num_local)
                num_expanded = _align(num_expanded + (alignment - 1) * num_local, alignment)
            out_x = _uninitialised(num_expanded, recv_x)
            out_weights = torch.full((num_expanded,), nan, dtype=torch.float32)
            next_row = list(starts)
            rows_list, tokens_list, ranks_list = [], [], []
            for row in range(num_recv):
                for slot in range(top_k):
                    expert = int(local_ids[row, slot])
                    if expert < 0:
                        continue
                    position = next_row[expert]
                    next_row[expert] += 1
                    out_x[position] = recv_x[row]
                    out_weights[position] = recv_weights[row, slot]
                    metadata[row, 2 + slot] = position
                    rows_list.append(position)
                    tokens_list.append(int(recv_source[row]) % max_tokens)
                    ranks_list.append(int(recv_source[row]) // max_tokens)
            psum_expert = torch.tensor(
                [start + count for start, count in zip(starts, counts.tolist(), strict=True)],
                dtype=torch.int32,
            )
            if do_zero_padding:
                for end in psum_expert.tolist():
                    out_x[end : _align(end, alignment)] = 0
                    out_weights[end : _align(end, alignment)] = 0
            out_ids = None
            return_rows = torch.tensor(rows_list, dtype=torch.int64)
            return_tokens = torch.tensor(tokens_list, dtype=torch.int64)
            return_ranks = torch.tensor(ranks_list, dtype=torch.int64)
            unaligned = counts.to(torch.int32)

        handle = ImitationHandle(
            do_expand=do_expand,
            num_experts=num_experts,
            expert_alignment=alignment,
            num_max_tokens_per_rank=max_tokens,
            num_sms=num_sms,
            topk_idx=topk_idx.clone(),
            num_recv_tokens=allocated,
            num_expanded_tokens=num_expanded,
            num_recv_tokens_per_expert_list=aligned if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=psum_rank,
            psum_num_recv_tokens_per_expert=psum_expert,
            num_unaligned_recv_tokens_per_expert=unaligned,
            recv_src_metadata=metadata,
            return_rows=return_rows,
            return_ranks=return_ranks,
            return_tokens=return_tokens,
            num_allocated_rows=out_x.size(0),
        )
        return _unpayload(out_x, x, sf), out_ids, out_weights, handle, ImitationEvent()

    # ----------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        handle: ImitationHandle,
        topk_weights: torch.Tensor | None = None,
        bias: Any = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, ImitationEvent]:
        """Each row a token was sent back to its source, summed there once in fp32 (unweighted)."""
        self._check_open()
        if topk_weights is not None or bias is not None:
            raise NotImplementedError("not imitated: combine topk_weights, bias")
        assert x.dtype == torch.bfloat16 and x.is_contiguous(), "combine: contiguous bf16 only"
        assert x.size(1) % 256 == 0, "combine.cuh: Invalid hidden (H % 256 != 0)"
        assert x.size(0) == handle.num_allocated_rows, "combine: one row per dispatched row"
        order = torch.sort(handle.return_ranks, stable=True).indices
        send_counts = torch.bincount(handle.return_ranks, minlength=self.comm.world_size).tolist()
        rows, tokens, _ = self._exchange(
            [x[handle.return_rows[order]], handle.return_tokens[order]], send_counts
        )
        num_tokens = handle.topk_idx.size(0)
        total = torch.zeros(num_tokens, x.size(1), dtype=torch.float32)
        total.index_add_(0, tokens, rows.float())
        return total.to(torch.bfloat16), None, ImitationEvent()


def _payload(x: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    """``[T, bytes]`` uint8: a row's values, then its scale packs under fp8."""
    parts = [x.contiguous().view(torch.uint8)]
    if sf is not None:
        parts.append(sf.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=1)


def _uninitialised(rows: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((rows, like.size(1)), UNINITIALISED_BYTE, dtype=torch.uint8)


def _unpayload(
    rows: torch.Tensor, x: torch.Tensor, sf: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Received payload rows back in the input's type: ``x``'s dtype, or the ``(x, sf)`` pair."""
    value_bytes = x.size(1) * x.element_size()
    values = rows[:, :value_bytes].contiguous().view(x.dtype)
    if sf is None:
        return values
    return values, rows[:, value_bytes:].contiguous().view(sf.dtype)


def imitation_library(topk_idx_dtype: torch.dtype = topk_idx_t) -> DeepEPLibrary:
    """The imitation in the adapter's injection slot, ``topk_idx_t`` as a build would set it."""
    buffer_class = type(
        "ImitationElasticBuffer", (ImitationElasticBuffer,), {"topk_idx_dtype": topk_idx_dtype}
    )
    return DeepEPLibrary(
        f"ImitationElasticBuffer (tests only, ids {topk_idx_dtype})", buffer_class, topk_idx_dtype
    )


class ImitationBackedDeepEP(DeepEPV2Dispatcher):
    """The real adapter with the imitation injected, on CPU; a test-only registry name.

    ``auto_priority`` is below torch_a2a's, so "auto" never picks it; ``expert_alignment = 4``
    makes EXPANDED groups padded, as DeepEP's are with ``expert_alignment > 1``.
    """

    name = "deepep_v2_imitation"
    capabilities = dataclasses.replace(
        DeepEPV2Dispatcher.capabilities, device_types=frozenset({"cpu"})
    )
    auto_priority = -100
    expert_alignment = 4

    @classmethod
    def load_library(cls) -> DeepEPLibrary:
        return imitation_library()

    @classmethod
    def environment_problems(cls, setup: DispatchSetup) -> list[str]:
        return []

    @classmethod
    def first_dispatch_problems(cls, setup: DispatchSetup) -> list[str]:
        return []


def register_imitation() -> str:
    """Register the imitation-backed dispatcher in this process; returns its name."""
    DISPATCHERS.register(ImitationBackedDeepEP)
    return ImitationBackedDeepEP.name
