"""The MoE data path's data-movement and elementwise ops: exactly what ``KernelOps`` resolves.

One file per op holds its plain-torch spec (the CPU path, and the oracle the Triton kernel is
tested against) beside its Triton kernel; ``ops.py`` gathers them into the typed ``KernelOps``
set a dispatcher or experts backend resolves once. ``wire.py`` is the forward header's format,
``layout.py`` the row transport's, ``types.py`` what the ops return, ``triton_common.py`` what the
kernels share (with Triton's one optional import, which the experts' own kernels use too). The
experts backends' GEMMs and row kernels are no data-path ops: ``ep_runtime/experts/gemm/``.
"""

from __future__ import annotations

from ep_runtime.kernels.ops import TORCH_OPS, TRITON_OPS, KernelOps, resolve_ops
from ep_runtime.kernels.types import Grouped, Route

__all__ = ["TORCH_OPS", "TRITON_OPS", "Grouped", "KernelOps", "Route", "resolve_ops"]
