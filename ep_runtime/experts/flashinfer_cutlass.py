"""FlashInfer CUTLASS fused MoE experts (``cutlass_fused_moe``), bf16, SM90/100/103.

The kernel takes global ids with ``ep_size = W`` and ``ep_rank = r`` (contiguous ranges of
``L = E / W`` experts), masks ids outside ``[r·L, (r+1)·L)`` (-1 included) and, with its
all-to-all mode off, writes every row (zero where a row has no local slot). Its all-to-all mode
is never used: that finalize leaves such rows unwritten. Finalize runs unfused
(``use_fused_finalize=False``): the fused epilogue reduces slots with atomics, and outputs must
be bitwise reproducible.

Weights: ``[up; gate]`` (our ``w13`` is ``[gate; up]``), intermediate size padded to a multiple
of 8 (16-byte TMA alignment), converted once at load. The workspace is allocated once for the
largest row count seen (``workspace_bytes``), never per call.

On first use FlashInfer JIT-compiles the module (``fused_moe_90`` on Hopper: about 250 CUTLASS
units, over 18 minutes on 16 cores). "auto" does not pick this backend unless the module is
already built; naming it (``experts="flashinfer_cutlass"``) lets it build on first use.
``EP_RUNTIME_FLASHINFER_CUTLASS_JIT=1`` always allows the build, ``=0`` never does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
    cuda_arch,
)
from ep_runtime.experts.flashinfer_common import (
    flashinfer_missing_reason,
    kernel_routing,
    pad_intermediate,
)
from ep_runtime.experts.self_check import self_check_refusal
from ep_runtime.types import Activation, Dispatched, TopkLayout

ALIGNMENT = 8  # bf16 elements in 16 bytes: hidden and intermediate sizes (TMA)
ALLOW_JIT_ENV = "EP_RUNTIME_FLASHINFER_CUTLASS_JIT"
H20_MULTIPROCESSORS = 78  # FlashInfer builds a separate SM90 module for H20 (78 SMs)


def cutlass_kernels() -> tuple[Callable[..., Any], Callable[..., int]]:
    """``(cutlass_fused_moe, cutlass_fused_moe_workspace_size)``; the one place they are looked
    up (tests swap it)."""
    from flashinfer.fused_moe import cutlass_fused_moe, cutlass_fused_moe_workspace_size

    return cutlass_fused_moe, cutlass_fused_moe_workspace_size


def cutlass_module_name(arch: int, multiprocessors: int) -> str:
    """The JIT module FlashInfer 0.7.2.post1 loads for this device
    (``get_cutlass_fused_moe_module`` and ``gen_cutlass_fused_moe_sm90_module``)."""
    if arch == 90:
        return (
            "fused_moe_90_h20_prebuilt_d"
            if multiprocessors == H20_MULTIPROCESSORS
            else "fused_moe_90"
        )
    return "fused_moe_103" if arch == 103 else "fused_moe_100"


def cutlass_module_missing_reason(module: str) -> str | None:
    """None if ``module`` is built (AOT artifact or JIT cache), else why and how to build it."""
    from flashinfer.jit import env as jit_env

    jit_library = jit_env.FLASHINFER_JIT_DIR / module / f"{module}.so"
    if jit_env.get_aot_artifacts(module) or jit_library.is_file():
        return None
    return (
        f"FlashInfer's {module} module is not built ({jit_library} is missing) and its JIT build "
        f'takes tens of minutes; build it once with `python -c "from flashinfer.fused_moe.core '
        f"import get_cutlass_fused_moe_module as m; m('<SM, e.g. 90>')\"`, or name the backend "
        f"(experts='flashinfer_cutlass') or set {ALLOW_JIT_ENV}=1 to build it on first use"
    )


@EXPERTS.register
class FlashInferCutlassExperts(Experts):
    """bf16 experts on ``flashinfer.fused_moe.cutlass_fused_moe`` (SM90/100/103)."""

    name = "flashinfer_cutlass"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        cuda_archs=frozenset({90, 100, 103}),
        description="FlashInfer CUTLASS fused MoE (bf16), JIT-built",
    )
    auto_priority = 20

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        hidden = setup.config.hidden_size
        if hidden % ALIGNMENT:
            return f"hidden_size={hidden} is not a multiple of {ALIGNMENT} (16-byte TMA rows)"
        reason = flashinfer_missing_reason()
        if reason is None and os.environ.get(ALLOW_JIT_ENV) == "0":
            reason = cls._module_missing_reason(setup)
        return reason or self_check_refusal(cls, setup.device, Activation(setup.config.activation))

    @classmethod
    def auto_refusal(cls, setup: ExpertsSetup) -> str | None:
        """ "auto" never starts the tens-of-minutes JIT build (named, or with the variable set
        to 1, the backend builds it on first use)."""
        if os.environ.get(ALLOW_JIT_ENV) == "1":
            return None
        return cls._module_missing_reason(setup)

    @staticmethod
    def _module_missing_reason(setup: ExpertsSetup) -> str | None:
        properties = torch.cuda.get_device_properties(setup.device)
        module = cutlass_module_name(cuda_arch(setup.device), properties.multi_processor_count)
        return cutlass_module_missing_reason(module)

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        from flashinfer.tllm_enums import ActivationType

        gated = self.activation.is_gated
        w13, w2, self.intermediate_size = pad_intermediate(w13, w2, ALIGNMENT, gated)
        if gated:  # [gate; up] -> [up; gate]
            num_local, rows, hidden = w13.shape
            w13 = w13.view(num_local, 2, rows // 2, hidden).flip(1).reshape(num_local, rows, hidden)
        self.fc1 = w13.contiguous()  # [L, 2I' | I', H]
        self.fc2 = w2.contiguous()  # [L, H, I']
        self.activation_type = ActivationType.Swiglu if gated else ActivationType.Relu2
        self._workspace: torch.Tensor | None = None
        self._workspace_rows = 0

    def workspace_bytes(self, max_rows: int) -> int:
        """FlashInfer's size for ``max_rows`` rows at the config's top_k: it grows with rows and
        top_k, so this also covers EXPANDED (top_k 1) with up to ``max_rows`` rows."""
        _, workspace_size = cutlass_kernels()
        placement = self.placement
        return workspace_size(
            max_rows,
            self.config.hidden_size,
            self.intermediate_size,
            placement.num_experts,
            self.config.top_k,
            x_dtype=self.setup.dtype,
            weight_dtype=self.setup.dtype,
            output_dtype=self.setup.dtype,
            activation_type=self.activation_type,
            ep_size=placement.world_size,
            ep_rank=placement.rank,
            use_fused_finalize=False,
            device=self.setup.device,
        )

    def _workspace_for(self, rows: int) -> torch.Tensor:
        """The workspace, reallocated only when ``rows`` exceeds every earlier call's."""
        if self._workspace is None or rows > self._workspace_rows:
            rows = max(rows, self.placement.world_size * self.setup.token_cap)
            size = self.workspace_bytes(rows)
            self._workspace = torch.empty(size, dtype=torch.uint8, device=self.setup.device)
            self._workspace_rows = rows
        return self._workspace

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        hidden_states = dispatched.hidden_states.contiguous()  # [R, H]
        out = torch.empty_like(hidden_states)  # the kernel writes every row
        num_rows = hidden_states.size(0)
        if num_rows == 0:
            return out
        ids, weights = kernel_routing(dispatched)  # [R, K'] int32, [R, K'] fp32
        fused_moe, _ = cutlass_kernels()
        fused_moe(
            input=hidden_states,
            token_selected_experts=ids,
            token_final_scales=weights,
            fc1_expert_weights=self.fc1,
            fc2_expert_weights=self.fc2,
            output_dtype=hidden_states.dtype,
            quant_scales=[],
            ep_size=self.placement.world_size,
            ep_rank=self.placement.rank,
            output=out,
            enable_alltoall=False,
            activation_type=self.activation_type,
            use_fused_finalize=False,
            workspace_buffer=self._workspace_for(num_rows),
        )
        return out
