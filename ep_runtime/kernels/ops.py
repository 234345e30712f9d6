"""The data-path ops as one typed set, chosen once per dispatcher or experts object.

``KernelOps`` lists the ops' signatures; ``TORCH_OPS`` (the specs, and the CPU path) and
``TRITON_OPS`` (the kernels, used on CUDA when Triton is installed) implement it. The choice is
made by ``resolve_ops`` when an object is built, never per call: ``EP_RUNTIME_KERNELS=torch``
forces the torch twins, ``=triton`` the kernels (also on CPU tensors, under
``TRITON_INTERPRET=1``), ``auto`` (the default) picks by device.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from ep_runtime.kernels import activation, fp8_quant, group, headers, pack, route
from ep_runtime.kernels import local_ids as local_ids_op
from ep_runtime.kernels import sum_rows as sum_rows_op
from ep_runtime.kernels.layout import ChunkLayout, RowFormat
from ep_runtime.kernels.triton_common import HAS_TRITON
from ep_runtime.kernels.types import Grouped, Route
from ep_runtime.kernels.wire import HeaderFields

KERNELS_ENV = "EP_RUNTIME_KERNELS"
CHOICES = ("auto", "torch", "triton")


class KernelOps(Protocol):
    """The ops every implementation provides (each file under kernels/ documents one)."""

    def route_tokens(
        self,
        topk_ids: torch.Tensor,  # [T, K] int32/int64 global ids, -1 = unused
        *,
        num_experts: int,
        experts_per_rank: int,
        world_size: int,
        drop_invalid: bool,
        control: torch.Tensor,  # [CONTROL_INTS] int32
        fields: HeaderFields,
        header_out: torch.Tensor,  # [W, HEADER_INTS] int32
        invalid_status: int = 0,
        slot_load: torch.Tensor | None = None,  # [E] int64 per-id counts, added to
        scratch: torch.Tensor | None = None,  # kernels.route.new_route_scratch, kept by the caller
    ) -> Route: ...

    def pack_rows(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K]
        route: Route,
        send: torch.Tensor,  # [S, row_bytes] uint8
        row_format: RowFormat,
        chunks: ChunkLayout,
        *,
        poison: bool = False,
    ) -> None: ...

    def quantize_rows(
        self,
        x: torch.Tensor,  # [N, H] compute dtype, H a multiple of 128
        q: torch.Tensor,  # [N, H] e4m3 out
        s: torch.Tensor,  # [N, H/128] fp32 out
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def local_ids(
        self, topk_ids: torch.Tensor, *, local_offset: int, num_local: int
    ) -> torch.Tensor: ...

    def group_rows(
        self,
        hidden: torch.Tensor,  # [R, H]
        topk_ids: torch.Tensor,  # [R, K] int32
        topk_weights: torch.Tensor,  # [R, K]
        *,
        local_offset: int,
        num_local: int,
        num_rows: int,
        poison: bool = False,
    ) -> Grouped: ...

    def weighted_activation(
        self, h: torch.Tensor, weights: torch.Tensor, *, gated: bool
    ) -> torch.Tensor: ...

    def sum_rows(
        self,
        source: torch.Tensor,  # [S, H]
        positions: torch.Tensor,  # [T, J] int32
        out: torch.Tensor | None = None,  # [T, H]
        *,
        chunk_counts: torch.Tensor | None = None,  # [J]
        chunks: ChunkLayout | None = None,
        failed: torch.Tensor | None = None,  # 0-d int
        own_rows: bool = False,  # a position ≥ 0 stands for source row t itself
    ) -> torch.Tensor: ...

    def record_headers(
        self,
        received: torch.Tensor,  # [W, HEADER_INTS] int32
        control: torch.Tensor,  # [CONTROL_INTS] int32
        *,
        rank: int,
        phase: int,
        top_k: int,
        mismatch_status: int,
    ) -> None: ...

    def write_chunk_headers(
        self,
        buffer: torch.Tensor,  # [S, H] contiguous
        header: torch.Tensor,  # [HEADER_INTS] int32
        chunk_counts: torch.Tensor,  # [W]
        chunks: ChunkLayout,
    ) -> None: ...

    def read_chunk_headers(
        self, buffer: torch.Tensor, chunk_counts: torch.Tensor, chunks: ChunkLayout
    ) -> torch.Tensor: ...


class TorchOps:
    """The specs: plain torch, any device, no host read."""

    name = "torch"
    route_tokens = staticmethod(route.torch_route_tokens)
    pack_rows = staticmethod(pack.torch_pack_rows)
    quantize_rows = staticmethod(fp8_quant.torch_quantize_rows)
    local_ids = staticmethod(local_ids_op.torch_local_ids)
    group_rows = staticmethod(group.torch_group_rows)
    weighted_activation = staticmethod(activation.torch_weighted_activation)
    sum_rows = staticmethod(sum_rows_op.torch_sum_rows)
    record_headers = staticmethod(headers.torch_record_headers)
    write_chunk_headers = staticmethod(headers.torch_write_chunk_headers)
    read_chunk_headers = staticmethod(headers.torch_read_chunk_headers)


class TritonOps:
    """The Triton kernels, bitwise equal to the specs (silu: to the last bits)."""

    name = "triton"
    route_tokens = staticmethod(route.triton_route_tokens)
    pack_rows = staticmethod(pack.triton_pack_rows)
    quantize_rows = staticmethod(fp8_quant.triton_quantize_rows)
    local_ids = staticmethod(local_ids_op.triton_local_ids)
    group_rows = staticmethod(group.triton_group_rows)
    weighted_activation = staticmethod(activation.triton_weighted_activation)
    sum_rows = staticmethod(sum_rows_op.triton_sum_rows)
    record_headers = staticmethod(headers.triton_record_headers)
    write_chunk_headers = staticmethod(headers.triton_write_chunk_headers)
    read_chunk_headers = staticmethod(headers.triton_read_chunk_headers)


TORCH_OPS: KernelOps = TorchOps()
TRITON_OPS: KernelOps = TritonOps()


def resolve_ops(device: torch.device) -> KernelOps:
    """The ops for tensors on ``device``: Triton on CUDA when it imports, else torch (see the
    module docstring for ``EP_RUNTIME_KERNELS``)."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{KERNELS_ENV}=triton, but triton is not installed")
        return TRITON_OPS
    if choice == "auto" and device.type == "cuda" and HAS_TRITON:
        return TRITON_OPS
    return TORCH_OPS
