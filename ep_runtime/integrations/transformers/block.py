"""``EPMoEBlock``: a HF sparse-MoE block's router, an ``EPMoE`` shard and its shared experts, in
the HF block's place (``patch_moe_blocks`` builds it)."""

from __future__ import annotations

import torch
from torch import nn

from ep_runtime.integrations.transformers.architectures import RouterSettings
from ep_runtime.integrations.transformers.graphs import BlockGraphs
from ep_runtime.layer import EPMoE


class EPMoEBlock(nn.Module):
    """Drop-in for a HF sparse-MoE block: its router, ``EPMoE``, its shared experts.

    ``forward`` takes and returns what the HF block does (``[B, S, H]`` → ``[B, S, H]``, or any
    ``[..., H]``). Inference only: the all-to-all has no backward. The experts get the top-k ids
    and weights the HF router itself returns (what transformers hands its own experts), so no
    routing is computed twice; ``router`` describes that routing (``route()``'s arguments).
    """

    def __init__(
        self,
        gate: nn.Module,
        ep: EPMoE,
        router: RouterSettings,
        shared_experts: nn.Module | None,
        hf_class: str,
    ) -> None:
        super().__init__()
        self.gate = gate  # the HF router module, unchanged (its weights, bias, hooks)
        self.ep = ep
        self.shared_experts = shared_experts
        self.router = router
        self.hf_class = hf_class
        self.graphs: BlockGraphs | None = None  # patch_moe_blocks(..., cuda_graph_tokens=N)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., H] → [..., H]
        if self.training:
            raise RuntimeError(
                f"{self.hf_class} replaced by EPMoEBlock is inference-only (no backward through "
                "the all-to-all): call model.eval()"
            )
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()  # [T, H]
        run = self.tokens_forward if self.graphs is None else self.graphs
        return run(x).view(shape)

    def tokens_forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] → [T, H]
        """Router, the EP layer and the shared experts on ``[T, H]`` rows: what a CUDA graph of
        the block captures."""
        _, topk_weights, topk_ids = self.gate(x)  # [T, K] each: the HF router's own top-k
        out = self.ep(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def forward_idle(self) -> None:
        """This rank's part of the block's collectives with no tokens of its own (T = 0): it
        still serves its experts to the other ranks."""
        hidden = self.ep.config.hidden_size
        self(torch.empty(0, hidden, dtype=self.ep.dtype, device=self.ep.device))

    def extra_repr(self) -> str:
        return f"replaces {self.hf_class}, {self.router}"
