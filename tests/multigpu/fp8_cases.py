"""Rank side of the fp8 block-scale layer cases: weights generated in bf16 (the suite's
``make_weights``) and quantized per 128×128 block, every rank's output compared per token with
the fp64 oracle of the contract (tests/support/fp8_oracle.py, not the production twin)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ep_runtime import EPInputError, EPMoE, MoEConfig
from ep_runtime.experts import EXPERTS
from ep_runtime.quantization import quantize_weight_blocks
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.layer_cases import CaseResult
from tests.multigpu.rank_inputs import CaseSpec, device, make_inputs, make_weights
from tests.support.fp8_oracle import fp8_moe_oracle

FP8_SHAPES = dict(hidden=256, intermediate=128)  # fp8 blocks tile H and I
# scaled_mm's cuBLAS GEMMs take K in multiples of 4 blocks (experts/scaled_mm.py)
FP8_SHAPES_OF = {"scaled_mm": dict(hidden=512, intermediate=512)}


def fp8_config(spec: CaseSpec) -> MoEConfig:
    return replace(spec.config(), quantization="fp8_block")


def quantized_weights(spec: CaseSpec) -> tuple[torch.Tensor, ...]:
    """Global ``(w13, w13_scale_inv, w2, w2_scale_inv)``, the same on every rank."""
    w13, w2 = make_weights(spec)
    return (*quantize_weight_blocks(w13), *quantize_weight_blocks(w2))


def build_fp8_layer(spec: CaseSpec, config: MoEConfig | None = None) -> EPMoE:
    return EPMoE(
        config or fp8_config(spec),
        dispatcher=spec.dispatcher,
        experts=spec.experts,
        layout=spec.layout,
        mode=spec.mode,
        max_tokens_per_rank=spec.cap,
        device=device(),
        poison=spec.poison,
    )


def run_fp8_case(spec: CaseSpec, local_shards: bool = False) -> CaseResult:
    """The fp8 layer on this rank's tokens against the oracle; ``local_shards``: load this
    rank's ``[L, …]`` weights and scales instead of the global ``[E, …]`` tensors."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, ids, weights = make_inputs(spec, rank)
    q13, s13, q2, s2 = quantized_weights(spec)
    layer = build_fp8_layer(spec)
    try:
        rounding = EXPERTS[layer.choice.experts].capabilities.gemm1_output_dtype
        ref, scale = fp8_moe_oracle(
            x, ids, weights, q13, s13, q2, s2, spec.activation, gemm1_output_dtype=rounding
        )
        if local_shards:
            num_local = spec.num_experts // world_size
            q13, s13, q2, s2 = (
                t[rank * num_local : (rank + 1) * num_local] for t in (q13, s13, q2, s2)
            )
        layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        dev = device()
        out = layer(x.to(dev), ids.to(dev), weights.to(dev))
        # judged at the bf16 tolerance whatever the compute dtype (tests/test_fp8.py says why)
        tolerance = tolerance_for(torch.bfloat16, max(spec.hidden, spec.intermediate))
        return CaseResult(
            rank,
            compare_per_token(out, ref, tolerance, scale),
            layer.choice.dispatcher,
            layer.choice.experts,
            layer.layout.value,
            out.cpu(),
        )
    finally:
        layer.close()


def build_with_quantization_on_rank0_only(spec: CaseSpec) -> str:
    """Rank 0 builds an fp8 layer, the others an unquantized one: every rank's build error."""
    config = fp8_config(spec) if dist.get_rank() == 0 else spec.config()
    try:
        build_fp8_layer(spec, config).close()
    except EPInputError as error:
        return f"{error.argument}: {error}"
    return "built"
