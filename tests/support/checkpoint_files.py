"""Checkpoints on disk for the loading tests: written by transformers' own ``save_pretrained``,
and damaged on purpose (a tensor removed, one replaced by a wrong shape, one cast to fp8 or to an
integer dtype, values set to NaN or Inf).

Nothing here imports ``ep_runtime``: which tensors a rank must read is worked out from the
checkpoint's names alone (``expected_reads``), independently of the loader's plan.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
# a per-expert tensor (…experts.{e}.…) or a fused one (…experts.gate_up_proj / down_proj)
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.|\.experts\.(gate_up_proj|down_proj)$")


def write_checkpoint(
    model: torch.nn.Module, directory: Path, *, shard_size: str = "100KB", original: bool = True
) -> Path:
    """``model.save_pretrained`` in shards of ``shard_size`` (several files and the index);
    ``original``: per-expert tensors as the models' repositories ship them, else fused."""
    model.save_pretrained(directory, max_shard_size=shard_size, save_original_format=original)
    return directory


def weight_map(directory: Path) -> dict[str, str]:
    return json.loads((directory / INDEX).read_text())["weight_map"]


def expected_reads(directory: Path, local: range) -> dict[str, tuple[int, int] | None]:
    """name → rows read (None: the whole tensor) for a rank serving experts ``local``: every
    tensor that is not an expert's, each per-expert tensor of its experts, its rows of fused."""
    expected: dict[str, tuple[int, int] | None] = {}
    for name in weight_map(directory):
        match = EXPERT_NAME.search(name)
        if match is None:
            expected[name] = None
        elif match.group(2) is not None:
            expected[name] = (local.start, local.stop)
        elif int(match.group(1)) in local:
            expected[name] = None
    return expected


def numel(directory: Path, name: str) -> int:
    """How many values ``name`` holds, from its shard's header."""
    from safetensors import safe_open

    with safe_open(str(directory / weight_map(directory)[name]), framework="pt") as handle:
        return math.prod(handle.get_slice(name).get_shape())


def _rewrite(directory: Path, name: str, change) -> Path:
    """Rewrite the shard holding ``name`` with ``change(tensors)`` applied; the shard's path."""
    from safetensors.torch import load_file, save_file

    shard = directory / weight_map(directory)[name]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def drop_tensor(directory: Path, name: str, *, from_index: bool = True) -> Path:
    """Remove ``name`` from its shard (and from the index unless ``from_index`` is False)."""
    shard = _rewrite(directory, name, lambda tensors: tensors.pop(name))
    if from_index:
        index = json.loads((directory / INDEX).read_text())
        del index["weight_map"][name]
        (directory / INDEX).write_text(json.dumps(index))
    return shard


def reshape_tensor(directory: Path, name: str) -> Path:
    """Replace ``name`` by a tensor with one row fewer."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:-1].clone()

    return _rewrite(directory, name, change)


def cast_tensor(directory: Path, name: str, dtype: torch.dtype) -> Path:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].to(dtype)

    return _rewrite(directory, name, change)


def set_values(directory: Path, name: str, value: float, at: object = slice(None)) -> Path:
    """Set ``name[at]`` (all of it by default) to ``value`` (e.g. NaN, Inf)."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][at] = value

    return _rewrite(directory, name, change)


def add_tensor(directory: Path, name: str, value: torch.Tensor) -> Path:
    """Add ``name`` to the first shard and to the index."""
    index = json.loads((directory / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    any_name = next(n for n, f in index["weight_map"].items() if f == first)

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = value

    shard = _rewrite(directory, any_name, change)
    index["weight_map"][name] = first
    (directory / INDEX).write_text(json.dumps(index))
    return shard
