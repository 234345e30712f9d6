"""Model-shaped MoE configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.quantization import Quantization, check_block_shapes, parse_quantization
from ep_runtime.types import Activation, EPInputError, enum_argument

DEFAULT_MAX_TOKENS_PER_RANK = 256  # capacity mode's static cap when none is given
# exact mode without a bound: the tokens per rank a forward is taken to carry by experts
# backends that choose by size (a prefill's; the Triton backend's "auto" stays out above 512)
EXACT_MODE_TOKENS_HINT = 4096
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MoEConfig:
    """Shape of one MoE layer.

    ``top_k`` is the *maximum* K: it sizes buffers; the K in force is ``topk_ids.size(1)``.
    ``dtype`` is the compute dtype; ``None`` means bf16 on CUDA and fp32 on CPU.
    ``quantization``: how expert weights are stored (``None``: the compute dtype;
    ``"fp8_block"``: e4m3 with 128×128 block scales, ep_runtime/quantization.py).
    ``max_tokens_per_rank``: capacity mode: the static cap, every forward's T must fit it
    (``None``: ``DEFAULT_MAX_TOKENS_PER_RANK``); exact mode: at most this many tokens per round,
    a memory bound (``None``: no bound of the user's, a forward runs as one round unless the
    dispatcher's buffers or free device memory bound it, ep_runtime/rounds.py).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: Activation | str = Activation.SILU
    dtype: torch.dtype | None = None
    max_tokens_per_rank: int | None = None
    quantization: Quantization | str | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EPInputError(name, "a positive int", value)
        if self.top_k > self.num_experts:
            raise EPInputError("top_k", f"<= num_experts ({self.num_experts})", self.top_k)
        check_token_bound(self.max_tokens_per_rank)
        activation = enum_argument(Activation, "activation", self.activation)
        object.__setattr__(self, "activation", activation)
        if self.dtype is not None and self.dtype not in SUPPORTED_DTYPES:
            raise EPInputError("dtype", "torch.bfloat16 or torch.float32 (or None)", self.dtype)
        quantization = parse_quantization(self.quantization)
        object.__setattr__(self, "quantization", quantization)
        if quantization is Quantization.FP8_BLOCK:
            check_block_shapes(self.hidden_size, self.intermediate_size)

    @property
    def w13_rows(self) -> int:
        """Rows of ``w13`` per expert: ``2I`` gated (``[gate; up]``), ``I`` non-gated."""
        return 2 * self.intermediate_size if self.activation.is_gated else self.intermediate_size

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_token_bound(value: object) -> None:
    """``max_tokens_per_rank`` is ``None`` or a positive int."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise EPInputError("max_tokens_per_rank", "a positive int or None", value)
