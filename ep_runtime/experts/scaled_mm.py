"""fp8 block-scaled experts on cuBLAS: ``torch._scaled_mm`` per expert, 1×128 activation scales
and 128×128 weight scales (the checkpoint's own), for prefill-sized forwards on Hopper.

cuBLAS applies the block scales inside its k loop while the tensor cores run (our Triton fp8
GEMM promotes each 128-deep step's product on the CUDA cores while they wait: BENCHMARKS.md). The
price is a host read per forward: cuBLAS takes one expert's rows as a matrix whose row count the
host passes, so the forward reads the per-expert counts once (no CUDA graph, no capacity mode's
promise of no sync). ``"auto"`` picks it for exact-mode layers sized for
``auto_min_tokens_per_rank`` tokens per rank or more on SM90 (where it was measured faster than
the Triton fp8 GEMMs); capacity-mode layers (CUDA graphs) and smaller ones take the Triton
experts. The choice is per layer: an exact-mode layer without a bound is sized for a prefill.

A forward (kernels in ``experts/gemm/block_rows.py``, layout ``CUBLAS``): ``q(x)`` as dispatched
or quantized here; STANDARD's pairs sorted by expert (``experts/gemm/expert_rows.py``); the rows
copied into one padded block per expert with their scales laid out as cuBLAS wants; GEMM1 per
expert into fp32 (the experts alternating between two streams); the activation, the contract's
quantizer and the router weight (folded into GEMM2's row scales) in one pass; GEMM2 per expert
into the compute dtype; each row's slots added in slot order (``kernels/sum_rows.py``). fp32
accumulation and activation as the contract says.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
    WorkBuffers,
)
from ep_runtime.experts.block_grouping import BlockGrouping, GroupedRows
from ep_runtime.experts.gemm.block_rows import CUBLAS, block_scales_view
from ep_runtime.experts.gemm.expert_gemm import nonempty_groups
from ep_runtime.kernels.sum_rows import triton_sum_rows
from ep_runtime.kernels.triton_common import HAS_TRITON
from ep_runtime.quantization import BLOCK, FP8_DTYPE, Fp8BlockWeights, Quantization
from ep_runtime.types import Activation, Dispatched, DispatchMode, TopkLayout


@dataclass(frozen=True)
class _Blocks:
    """One forward's rows in expert blocks (``P'`` block rows) and the GEMMs' buffers."""

    grouped: GroupedRows
    up_out: torch.Tensor  # [P', 2I | I] fp32, GEMM1's output
    act: torch.Tensor  # [P', I] e4m3, q(act)
    act_scales: torch.Tensor  # [P'·I/128] fp32, × the router weight
    down_out: torch.Tensor  # [P', H] compute dtype, GEMM2's (weighted) output


@EXPERTS.register
class ScaledMMExperts(Experts):
    name = "scaled_mm"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        cuda_archs=frozenset({90}),  # cuBLAS's 1x128 / 128x128 fp8 scaling, measured on Hopper
        quantizations=frozenset({Quantization.FP8_BLOCK}),
        graph_capturable=False,  # one host read of the per-expert row counts per forward
        description="cuBLAS block-scaled fp8 GEMMs per expert (torch._scaled_mm), prefill",
    )
    auto_priority = 16  # above triton (15): where both may run, prefill-sized fp8 layers
    auto_min_tokens_per_rank: ClassVar[int] = 1024
    # cuBLAS (torch 2.11, CUDA 13.0, H100) gave wrong sums where K/128 was not a multiple of 4
    # (K 128, 256, 384, 768: errors of 1e3 and more); row counts of 1 and 17 had no kernel (16
    # and 1000 ran), so each expert's block is padded to block_rows.CUBLAS.align rows
    blocks_multiple: ClassVar[int] = 4
    # experts' GEMMs are spread round-robin over this many streams: one expert's last, partly
    # filled wave of tiles runs beside the next expert's first
    gemm_streams: ClassVar[int] = 2

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        if not HAS_TRITON:
            return "triton is not installed (the row kernels around the GEMMs)"
        multiple = cls.blocks_multiple * BLOCK
        for name in ("hidden_size", "intermediate_size"):
            size = getattr(setup.config, name)
            if size % multiple:
                return (
                    f"{name}={size} is not a multiple of {multiple} (cuBLAS's block-scaled "
                    "GEMM reads the 128-column scales in fours)"
                )
        return None

    @classmethod
    def auto_refusal(cls, setup: ExpertsSetup) -> str | None:
        if setup.mode is DispatchMode.CAPACITY:
            return (
                "reads the per-expert counts on the host each forward: capacity mode promises "
                "none (CUDA graphs); name it to use it eagerly"
            )
        if setup.token_cap < cls.auto_min_tokens_per_rank:
            return (
                f"reads the per-expert counts on the host each forward: picked at "
                f"{cls.auto_min_tokens_per_rank}+ tokens per rank (prefill), not a cap of "
                f"{setup.token_cap}"
            )
        return None

    def __init__(self, setup: ExpertsSetup) -> None:
        super().__init__(setup)
        self.num_local = self.placement.num_local_experts
        self.buffers = WorkBuffers(setup.device)
        self._grouping = BlockGrouping(CUBLAS, self.placement, self.buffers, with_ends=False)
        on_cuda = setup.device.type == "cuda"
        streams = self.gemm_streams if on_cuda else 0
        self._streams = [torch.cuda.Stream(setup.device) for _ in range(streams)]
        # the block starts reach the host through pinned memory while group_rows runs
        self._host_padded = torch.empty(self.num_local + 1, dtype=torch.int32, pin_memory=on_cuda)
        self._padded_copied = torch.cuda.Event() if on_cuda else None

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        raise TypeError(f"{self.name} takes fp8 weights (load_quantized_weights)")

    def load_quantized_weights(self, weights: Fp8BlockWeights) -> None:
        # per expert (B, scale_b) as _scaled_mm takes them, made once: e4m3 [K, N] column-major
        # (the row-major [N, K] weight transposed) and fp32 [K/128, N/128]
        self.up = [(w.t(), s.t()) for w, s in zip(weights.w13, weights.w13_scale_inv, strict=True)]
        self.down = [(w.t(), s.t()) for w, s in zip(weights.w2, weights.w2_scale_inv, strict=True)]
        self.up_rows = weights.w13.size(1)  # 2I | I

    def workspace_bytes(self, max_rows: int) -> int:
        """The padded blocks of GEMM1's input and fp32 output, ``q(act)``, GEMM2's output, the
        maps, and the output (rows quantized here when they arrive unquantized)."""
        config = self.config
        hidden, width = config.hidden_size, config.intermediate_size
        element = self.setup.dtype.itemsize
        per_block_row = (
            4 * config.w13_rows  # GEMM1's fp32 output
            + width + 4 * width // BLOCK  # q(act) and its scales
            + element * hidden  # GEMM2's output
        )  # fmt: skip
        blocks = self._grouping.workspace_bytes(max_rows, config.top_k, hidden, per_block_row)
        return blocks + max_rows * element * hidden

    def release_workspace(self) -> None:
        self.buffers.clear()

    def _block_gemm(
        self,
        rows: torch.Tensor,  # [M, K] e4m3: one expert's block
        block_scales: torch.Tensor,  # [P'·K/128] fp32, all blocks
        start: int,  # the block's first row
        weight: tuple[torch.Tensor, torch.Tensor],  # [K, N] e4m3, its 128×128 scales
        out: torch.Tensor,  # [M, N]
    ) -> None:
        """``out = rows · B``, block scales applied by cuBLAS."""
        groups = rows.size(1) // BLOCK
        torch._scaled_mm(
            rows,
            weight[0],
            scale_a=block_scales_view(block_scales, start, start + rows.size(0), groups),
            scale_b=weight[1],
            out_dtype=out.dtype,
            out=out,
        )

    def _run_experts(self, blocks: _Blocks, bounds: list[int]) -> None:
        """GEMM1 per expert, the activation of all block rows in one pass, GEMM2 per expert.
        The host issues the GEMMs one by one, so their Python is kept short: each buffer's
        blocks come from one ``split``."""
        grouped = blocks.grouped
        sizes = [end - start for start, end in itertools.pairwise(bounds)]
        rows = grouped.rows[: bounds[-1]].split(sizes)
        up_out = blocks.up_out.split(sizes)
        act = blocks.act.split(sizes)
        down_out = blocks.down_out.split(sizes)
        nonempty = nonempty_groups(bounds)
        with self._side_streams(grouped.rows.device) as take_turn:
            for turn, (expert, start, _) in enumerate(nonempty):
                take_turn(turn)
                self._block_gemm(
                    rows[expert], grouped.row_scales, start, self.up[expert], up_out[expert]
                )
        self._grouping.activate(
            grouped, blocks.up_out, blocks.act, blocks.act_scales, gated=self.activation.is_gated
        )
        with self._side_streams(grouped.rows.device) as take_turn:
            for turn, (expert, start, _) in enumerate(nonempty):
                take_turn(turn)
                self._block_gemm(
                    act[expert], blocks.act_scales, start, self.down[expert], down_out[expert]
                )

    @contextlib.contextmanager
    def _side_streams(self, device: torch.device) -> Iterator[Callable[[int], None]]:
        """Yields ``take_turn(i)``: makes side stream ``i mod n`` current, so experts issued in
        turn alternate and each stream gets work as soon as the host has it. The side streams
        start after, and the current stream continues after, all of them (every tensor used
        in between outlives the forward, so no allocation crosses streams). Off CUDA (the
        adapter tests) there are none and everything runs in order."""
        streams = self._streams
        if not streams:
            yield lambda turn: None
            return
        current = torch.cuda.current_stream(device)
        for stream in streams:
            stream.wait_stream(current)
        try:
            yield lambda turn: torch.cuda.set_stream(streams[turn % len(streams)])
        finally:
            torch.cuda.set_stream(current)
            for stream in streams:
                current.wait_stream(stream)

    def _block_starts(self, padded: torch.Tensor) -> list[int]:
        """``padded`` on the host: on CUDA from the pinned copy made before group_rows was
        queued (the device copies rows while the host waits), elsewhere read directly."""
        if self._padded_copied is None:
            return padded.tolist()
        self._padded_copied.synchronize()
        return self._host_padded.tolist()

    def _copy_block_starts(self, padded: torch.Tensor) -> None:
        """On CUDA, start the block starts' copy to pinned host memory (``_block_starts``)."""
        if self._padded_copied is not None:
            self._host_padded.copy_(padded, non_blocking=True)
            self._padded_copied.record()

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        num_rows, width = dispatched.hidden_states.size(0), self.config.intermediate_size
        get = self.buffers.get
        out = get("out", num_rows, self.config.hidden_size, self.setup.dtype)  # [R, H]
        if num_rows == 0:
            return out
        grouped = self._grouping.group(dispatched, self._copy_block_starts)
        bounds = self._block_starts(grouped.padded)  # the host read: cuBLAS takes each block
        total = bounds[-1]
        blocks = _Blocks(
            grouped=grouped,
            up_out=get("h", total, self.up_rows, torch.float32),  # [P', 2I | I]
            act=get("act", total, width, FP8_DTYPE),  # [P', I]
            act_scales=get("act_scales", total * (width // BLOCK), 1, torch.float32).view(-1),
            down_out=get("y", total, self.config.hidden_size, self.setup.dtype),  # [P', H]
        )
        self._run_experts(blocks, bounds)
        return triton_sum_rows(blocks.down_out, grouped.positions, out)
