"""The MoE data path's data-movement and elementwise ops.

Each op has a plain-torch implementation (``torch_ops``: the CPU path, and the oracle the GPU
kernels are tested against) and a Triton kernel (``triton_ops``) used on CUDA when Triton is
installed. ``EP_RUNTIME_KERNELS=torch`` forces the torch implementations everywhere.
"""

from __future__ import annotations

import functools
import os

import torch

from ep_runtime.kernels import torch_ops
from ep_runtime.kernels.torch_ops import Grouped, HeaderFields, Route

KERNELS_ENV = "EP_RUNTIME_KERNELS"


@functools.cache
def _triton_ops():
    """``triton_ops`` if Triton imports, else None."""
    try:
        from ep_runtime.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def implementation(device: torch.device):
    """The module whose ops run on ``device``: Triton kernels on CUDA when available."""
    if device.type == "cuda" and os.environ.get(KERNELS_ENV, "auto") != "torch":
        triton = _triton_ops()
        if triton is not None:
            return triton
    return torch_ops


def route_tokens(topk_ids: torch.Tensor, **kwargs) -> Route:
    return implementation(topk_ids.device).route_tokens(topk_ids, **kwargs)


def pack_rows(x: torch.Tensor, *args, **kwargs) -> None:
    implementation(x.device).pack_rows(x, *args, **kwargs)


def local_ids(topk_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return implementation(topk_ids.device).local_ids(topk_ids, **kwargs)


def group_rows(hidden: torch.Tensor, *args, **kwargs) -> Grouped:
    return implementation(hidden.device).group_rows(hidden, *args, **kwargs)


def weighted_activation(h: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return implementation(h.device).weighted_activation(h, *args, **kwargs)


def sum_rows(source: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return implementation(source.device).sum_rows(source, *args, **kwargs)


def record_headers(received: torch.Tensor, *args, **kwargs) -> None:
    implementation(received.device).record_headers(received, *args, **kwargs)


def write_chunk_headers(buffer: torch.Tensor, *args, **kwargs) -> None:
    implementation(buffer.device).write_chunk_headers(buffer, *args, **kwargs)


def read_chunk_headers(buffer: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return implementation(buffer.device).read_chunk_headers(buffer, *args, **kwargs)


__all__ = [
    "Grouped",
    "HeaderFields",
    "Route",
    "group_rows",
    "implementation",
    "local_ids",
    "pack_rows",
    "read_chunk_headers",
    "record_headers",
    "route_tokens",
    "sum_rows",
    "weighted_activation",
    "write_chunk_headers",
]
