"""Rank-side code of the checkpoint-loading tests (runs inside ``RankPool`` ranks)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from ep_runtime.integrations.checkpoint import build_empty_model, load_sharded
from ep_runtime.integrations.transformers import greedy_generate
from tests.support.resident_memory import peak_rss_bytes, reset_peak_rss, rss_bytes


def _quiet(_: object) -> None:
    """No progress lines from the ranks."""


def load_and_generate_on_rank(
    path: str,
    prompts: list[list[int] | None],
    new_tokens: list[int],
    eos: list[int],
    experts: str,
) -> dict:
    """Load this rank's part of the checkpoint, generate its request in lockstep; what it read."""
    rank = dist.get_rank()
    loaded = load_sharded(
        path, dtype=torch.float32, dispatcher="torch_a2a", experts=experts, progress=_quiet
    )
    result = greedy_generate(
        loaded.model, loaded.patch, prompts[rank], new_tokens[rank], eos_token_id=eos
    )
    for block in loaded.patch.blocks:
        block.module.ep.close()
    return {
        "tokens": result.tokens,
        "logits": result.logits,
        "reads": [(read.name, read.rows) for read in loaded.load.reads],
        "bytes_read": loaded.load.bytes_read,
        "local_experts": (loaded.patch.local_experts.start, loaded.patch.local_experts.stop),
        "held_expert_bytes": loaded.patch.held_expert_bytes(),
    }


def load_on_rank(path: str) -> str:
    """Only the load (for the refusals)."""
    loaded = load_sharded(path, dtype=torch.float32, dispatcher="torch_a2a", progress=_quiet)
    for block in loaded.patch.blocks:
        block.module.ep.close()
    return loaded.load.describe()


def group_still_works() -> int:
    """One all-reduce: every rank is still in step after what ran before."""
    value = torch.ones(1)
    dist.all_reduce(value)
    return int(value.item())


def load_and_measure_memory_on_rank(path: str, config: object) -> dict:
    """Peak resident memory during a load against the resident size just before it (after the
    imports and one empty build of the model, so that lazily imported model code is not
    counted); Linux only (``/proc/self/status``, ``clear_refs``)."""
    build_empty_model(config, torch.float32)
    gc.collect()
    before = rss_bytes()
    reset_peak_rss()
    loaded = load_sharded(
        path, dtype=torch.float32, dispatcher="torch_a2a", experts="reference", progress=_quiet
    )
    peak = peak_rss_bytes()
    report = loaded.load
    result = {
        "before": before,
        "peak": peak,
        "after": rss_bytes(),
        "bytes_read": report.bytes_read,
        "dense_bytes": report.dense_bytes,
        "expert_bytes": report.expert_bytes,
        "checkpoint_bytes": report.checkpoint_bytes,
        "held_expert_bytes": loaded.patch.held_expert_bytes(),
    }
    for block in loaded.patch.blocks:
        block.module.ep.close()
    return result
