"""Deterministic workload: weights per (seed, expert id), inputs per (seed, rank), and validation
on a token sample that regenerates only the experts the sample touches.

Every tensor comes from its own generator seeded by a stable hash of (seed, what, index), so a
rank builds only its shard of experts and any rank can rebuild any expert bit for bit. Values
depend on the device's generator (CPU and CUDA streams differ); a run uses one device type.
Shapes come from the package's ``MoEConfig`` (``ModelPreset.moe_config``), ownership from the
layer's placement (``eplb.PlacementMap``); only the router is the preset's own. The reference
regenerates experts by logical id, so it does not depend on where the layer placed them. With
``quantization="fp8_block"`` each expert is generated in bf16 and quantized per 128×128 block
(``quantize_weight_blocks``); its reference is ``reference_moe`` on the dequantized weights with
each GEMM's input quantized as the contract says (``fake_quantize_activations``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import torch

from ep_runtime.config import MoEConfig
from ep_runtime.eplb import PlacementMap, zipf_routing
from ep_runtime.launch.presets import ModelPreset
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import (
    BLOCK,
    FP8_DTYPE,
    Quantization,
    dequantize_weight_blocks,
    fake_quantize_activations,
    quantize_weight_blocks,
)
from ep_runtime.reference import reference_moe
from ep_runtime.routing import route
from ep_runtime.tolerance import Comparison, compare_per_token, tolerance_for

EXPERTS_PER_VALIDATION_CHUNK = 8  # experts resident at once while computing the reference


def stream_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from (seed, parts), stable across processes (unlike ``hash``)."""
    text = "/".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _generator(device: torch.device, seed: int, *parts: object) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(seed, *parts))


def _randn(shape: tuple[int, ...], scale: float, gen: torch.Generator, device: torch.device):
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale


def expert_weights(
    config: MoEConfig, expert: int, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [2I|I, H], w2 [H, I])`` of one expert, rounded to ``dtype``; N(0, 1/fan_in)."""
    gen = _generator(device, seed, "expert", expert)
    hidden, inter = config.hidden_size, config.intermediate_size
    w13 = _randn((config.w13_rows, hidden), 1 / math.sqrt(hidden), gen, device).to(dtype)
    w2 = _randn((hidden, inter), 1 / math.sqrt(inter), gen, device).to(dtype)
    return w13, w2


def stacked_expert_weights(
    config: MoEConfig, experts: list[int], seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [N, 2I|I, H], w2 [N, H, I])`` for the listed experts, built one at a time."""
    hidden, inter = config.hidden_size, config.intermediate_size
    w13 = torch.empty(len(experts), config.w13_rows, hidden, device=device, dtype=dtype)
    w2 = torch.empty(len(experts), hidden, inter, device=device, dtype=dtype)
    for slot, expert in enumerate(experts):
        w13[slot], w2[slot] = expert_weights(config, expert, seed, device, dtype)
    return w13, w2


def quantized_expert_weights(
    config: MoEConfig, experts: list[int], seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w13 e4m3 [N, 2I|I, H], w13_scale_inv fp32 [N, 2I/128|I/128, H/128], w2 e4m3
    [N, H, I], w2_scale_inv fp32 [N, H/128, I/128])``: each listed expert generated in bf16
    (``expert_weights``) and quantized per block, one at a time."""
    hidden, inter, rows = config.hidden_size, config.intermediate_size, config.w13_rows
    count = len(experts)
    w13 = torch.empty(count, rows, hidden, device=device, dtype=FP8_DTYPE)
    s13 = torch.empty(count, rows // BLOCK, hidden // BLOCK, device=device)
    w2 = torch.empty(count, hidden, inter, device=device, dtype=FP8_DTYPE)
    s2 = torch.empty(count, hidden // BLOCK, inter // BLOCK, device=device)
    for slot, expert in enumerate(experts):
        bf16_13, bf16_2 = expert_weights(config, expert, seed, device, torch.bfloat16)
        w13[slot], s13[slot] = quantize_weight_blocks(bf16_13)
        w2[slot], s2[slot] = quantize_weight_blocks(bf16_2)
    return w13, s13, w2, s2


def rank_shard(
    config: MoEConfig, experts: list[int], seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """The listed experts as ``EPMoE.load_weights`` takes them: ``((w13, w2), scales)``, the
    weights in ``dtype`` (no scales) or, with fp8 quantization, e4m3 with their block scales."""
    if config.quantization is None:
        return stacked_expert_weights(config, experts, seed, device, dtype), {}
    w13, s13, w2, s2 = quantized_expert_weights(config, experts, seed, device)
    return (w13, w2), {"w13_scale_inv": s13, "w2_scale_inv": s2}


def slots_hold_experts(
    config: MoEConfig,
    slot_weights: tuple[torch.Tensor, torch.Tensor],  # w13 [S, 2I|I, H], w2 [S, H, I]
    experts: list[int],  # the logical expert of each slot
    seed: int,
) -> bool:
    """Whether every slot holds, bit for bit, the weights of the expert the placement puts
    there (regenerated one expert at a time)."""
    w13, w2 = slot_weights
    for slot, expert in enumerate(experts):
        want13, want2 = expert_weights(config, expert, seed, w13.device, w13.dtype)
        if not (torch.equal(w13[slot], want13) and torch.equal(w2[slot], want2)):
            return False
    return True


def local_experts(
    config: MoEConfig, rank: int, world_size: int, num_redundant: int = 0
) -> list[int]:
    """The logical expert of each of ``rank``'s slots on the initial placement (without
    redundant experts the contiguous range ``ExpertPlacement`` gives)."""
    placement = PlacementMap.initial(config.num_experts, num_redundant, world_size)
    return list(placement.experts_on_rank(rank))


def shard_weight_bytes(
    config: MoEConfig, world_size: int, dtype: torch.dtype, num_redundant: int = 0
) -> int:
    """Bytes of expert weights one rank holds: ``(E + R)/W · (rows·H + H·I)`` elements of
    ``dtype`` (fp8: one byte each, plus an fp32 scale per 128×128 block)."""
    per_expert = (config.w13_rows + config.intermediate_size) * config.hidden_size
    num_local = ExpertPlacement(config.num_experts + num_redundant, 0, world_size).num_local_experts
    if config.quantization is not None:
        return num_local * (per_expert + per_expert // BLOCK**2 * 4)
    return num_local * per_expert * dtype.itemsize


def rank_hidden_states(
    config: MoEConfig, rank: int, tokens: int, seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``x [T, H]`` of one rank, N(0, 1), rounded to ``dtype``."""
    gen = _generator(device, seed, "x", rank)
    return _randn((tokens, config.hidden_size), 1.0, gen, device).to(dtype)


def rank_routing(
    model: ModelPreset,
    rank: int,
    tokens: int,
    seed: int,
    device: torch.device,
    zipf: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, K] int32, topk_weights [T, K] fp32)`` from the model's own router, or
    with ``zipf=S`` skewed: Zipf(S) expert popularity (``eplb.zipf_routing``, seeded)."""
    if zipf is not None:
        ids, weights = zipf_routing(
            tokens, model.num_experts, model.top_k, zipf, seed=seed, rank=rank
        )
        return ids.to(device), weights.to(device)
    logits = _randn(
        (tokens, model.num_experts), 1.0, _generator(device, seed, "logits", rank), device
    )
    router = model.router
    bias = None
    if router.correction_bias:  # one bias for the whole model, shared by every rank
        bias = _randn((model.num_experts,), 0.1, _generator(device, seed, "bias"), device)
    return route(
        logits,
        model.top_k,
        scoring=router.scoring,
        renormalize=router.renormalize,
        correction_bias=bias,
        num_expert_groups=router.num_expert_groups,
        num_topk_groups=router.num_topk_groups,
        routed_scaling_factor=router.routed_scaling_factor,
    )


def validation_sample(tokens: int, count: int, seed: int, rank: int) -> torch.Tensor:
    """Sorted row indices (int64, on CPU) of the tokens a rank validates; ``count=0``: all."""
    if count <= 0 or count >= tokens:
        return torch.arange(tokens)
    gen = torch.Generator().manual_seed(stream_seed(seed, "sample", rank))
    return torch.randperm(tokens, generator=gen)[:count].sort().values


def sampled_reference(
    model: ModelPreset,
    x: torch.Tensor,  # [S, H] compute dtype, the sampled rows
    topk_ids: torch.Tensor,  # [S, K] global ids
    topk_weights: torch.Tensor,  # [S, K] fp32
    seed: int,
    experts_per_chunk: int = EXPERTS_PER_VALIDATION_CHUNK,
    quantization: Quantization | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``reference_moe`` on the sample (fp32 ``[S, H]``), its per-token scale (``[S]``, the
    size of the summed terms, see tolerance.py) and the experts it regenerated. With fp8
    ``quantization``: on the dequantized weights, each GEMM's input quantized (the contract).

    Experts are regenerated ``experts_per_chunk`` at a time with ids remapped to the chunk, so
    memory is bounded by the chunk, not by E (DeepSeek-V3 has 256 experts, 22 GB in bf16).
    """
    config = replace(model.moe_config(), quantization=quantization)
    gemm_input = None if config.quantization is None else fake_quantize_activations
    touched = sorted(int(e) for e in topk_ids[topk_ids >= 0].unique().tolist())
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    scale = torch.zeros(x.size(0), dtype=torch.float64, device=x.device)
    ids = topk_ids.to(torch.int64)
    for start in range(0, len(touched), experts_per_chunk):
        chunk = touched[start : start + experts_per_chunk]
        if config.quantization is None:
            w13, w2 = stacked_expert_weights(config, chunk, seed, x.device, x.dtype)
        else:
            q13, s13, q2, s2 = quantized_expert_weights(config, chunk, seed, x.device)
            w13, w2 = dequantize_weight_blocks(q13, s13), dequantize_weight_blocks(q2, s2)
        chunk_ids = torch.full_like(ids, -1)
        for slot, expert in enumerate(chunk):
            chunk_ids[ids == expert] = slot
        part, part_scale = reference_moe(
            x,
            chunk_ids,
            topk_weights,
            w13,
            w2,
            activation=config.activation,
            return_scale=True,
            gemm_input=gemm_input,
        )
        out += part
        scale += part_scale
    return out, scale, touched


def check_sample(
    model: ModelPreset,
    out: torch.Tensor,  # [T, H] the layer's output
    x: torch.Tensor,  # [T, H] its input
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    rows: torch.Tensor,  # the sampled rows (``validation_sample``), on ``out``'s device
    seed: int,
    quantization: Quantization | str | None = None,
) -> tuple[Comparison, float, list[int]]:
    """``out``'s sampled rows against ``sampled_reference``, per token, at the tolerance of
    ``out``'s dtype (fp8 weights: of bf16, issue 21: fp32 and fp64 evaluations of q() may land
    on neighbouring e4m3 values for a few elements): ``(comparison, tolerance, experts
    regenerated)``."""
    reference, scale, touched = sampled_reference(
        model, x[rows], topk_ids[rows], topk_weights[rows], seed, quantization=quantization
    )
    judged = torch.bfloat16 if quantization is not None else out.dtype
    tolerance = tolerance_for(judged, max(model.hidden_size, model.intermediate_size))
    return compare_per_token(out[rows], reference, tolerance, scale), tolerance, touched
