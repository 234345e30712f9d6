"""Input checks, done before any rank communicates. Each error names the argument, the expected
and the given value. Shape/dtype/device checks are free and run here; id values (range,
repeats) are checked by the route on the device (kernels), which marks this rank's header failed
(or, in capacity mode on CUDA, drops and counts them); ``check_topk_id_values`` then explains
the failure on the error path."""

from __future__ import annotations

import warnings

import torch

from ep_runtime.config import MoEConfig
from ep_runtime.types import EPInputError

INDEX_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def check_forward_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    config: MoEConfig,
    dtype: torch.dtype,
    device: torch.device,
    capacity: int | None,
    out: torch.Tensor | None = None,
) -> None:
    """Raise ``EPInputError`` for the first problem found. ``capacity`` set: T must fit it;
    ``out`` given: it must be shaped as ``x``, on its device, in its dtype."""
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(tensor, torch.Tensor):
            raise EPInputError(name, "a torch.Tensor", type(tensor).__name__)
        if tensor.dim() != 2:
            raise EPInputError(name, "a 2-D tensor", f"shape {list(tensor.shape)}")
        if tensor.device.type != device.type or (
            device.index is not None and tensor.device.index not in (None, device.index)
        ):
            raise EPInputError(name, f"a tensor on {device}", f"one on {tensor.device}")
    if x.size(1) != config.hidden_size:
        raise EPInputError("x", f"shape [T, {config.hidden_size}]", f"shape {list(x.shape)}")
    if x.dtype != dtype:
        raise EPInputError("x", f"dtype {dtype} (the layer's compute dtype)", x.dtype)
    if topk_ids.dtype not in INDEX_DTYPES:
        raise EPInputError("topk_ids", "dtype torch.int32 or torch.int64", topk_ids.dtype)
    num_tokens, top_k = topk_ids.shape
    if num_tokens != x.size(0):
        raise EPInputError("topk_ids", f"{x.size(0)} rows (one per row of x)", num_tokens)
    if not 1 <= top_k <= config.top_k:
        raise EPInputError("topk_ids", f"1 <= K <= top_k ({config.top_k}) columns", top_k)
    if topk_weights.shape != topk_ids.shape:
        raise EPInputError(
            "topk_weights", f"shape {list(topk_ids.shape)} (as topk_ids)", list(topk_weights.shape)
        )
    if topk_weights.dtype not in WEIGHT_DTYPES:
        raise EPInputError(
            "topk_weights", "dtype torch.float32 or torch.bfloat16", topk_weights.dtype
        )
    if capacity is not None and num_tokens > capacity:
        raise EPInputError(
            "x", f"at most max_tokens_per_rank={capacity} rows in capacity mode", num_tokens
        )
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise EPInputError(
            "out",
            f"shape {list(x.shape)}, dtype {x.dtype} on {x.device} (as x)",
            f"shape {list(out.shape)}, dtype {out.dtype} on {out.device}",
        )


class InputChecker:
    """A layer's check of every forward's inputs (``check_forward_inputs``), returning the error
    rather than raising it (the peers learn it first), and its one-time grad warning."""

    def __init__(
        self, config: MoEConfig, dtype: torch.dtype, device: torch.device, capacity: int | None
    ) -> None:
        self.config, self.dtype, self.device, self.capacity = config, dtype, device, capacity
        self._warned_about_grad = False

    def error(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None
    ) -> BaseException | None:
        try:
            check_forward_inputs(
                x,
                ids,
                weights,
                config=self.config,
                dtype=self.dtype,
                device=self.device,
                capacity=self.capacity,
                out=out,
            )
        except Exception as error:
            return error
        if not self._warned_about_grad:
            warning = grad_warning(x=x, topk_weights=weights)
            if warning is not None:
                self._warned_about_grad = True
                warnings.warn(warning, stacklevel=4)
        return None


def grad_warning(**tensors: torch.Tensor) -> str | None:
    """The one-time warning for inputs that require grad (the layer is forward-only)."""
    needing = [name for name, tensor in tensors.items() if tensor.requires_grad]
    if not needing:
        return None
    return (
        f"EPMoE is forward-only (inference): {', '.join(needing)} requires grad, but no "
        "gradient flows through this layer; run it under torch.inference_mode() or "
        "torch.no_grad()"
    )


def check_topk_id_values(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Ids in ``[0, E)`` or -1; no id twice in one token's row."""
    ids = topk_ids.to(torch.int64)
    bad = (ids < -1) | (ids >= num_experts)
    ordered = ids.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if not bool(bad.any() | repeated.any()):  # the one host read; details only on error
        return
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        raise EPInputError(
            "topk_ids",
            f"values in [0, {num_experts}) or -1",
            f"{int(ids[row, col])} at [{row}, {col}]",
        )
    row = int(repeated.any(dim=1).nonzero()[0])
    raise EPInputError(
        "topk_ids", "distinct expert ids within a row", f"row {row} = {ids[row].tolist()}"
    )
