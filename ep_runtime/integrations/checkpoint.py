"""Shard-aware loading of a Hugging Face MoE checkpoint: each rank reads only what it serves.

On every rank (the default process group, or ``group``)::

    loaded = load_sharded("/ckpt/Qwen3-30B-A3B", dtype=torch.bfloat16)   # EPMoE options as keywords
    result = greedy_generate(loaded.model, loaded.patch, prompt_ids, max_new_tokens=32)
    print(loaded.load.describe())                        # what this rank read, and how long it took

``load_sharded`` builds the model from its config with every parameter on the meta device (buffers
such as rotary tables are computed as usual), reads the checkpoint's metadata (the index and each
shard's header: names, shapes, dtypes), checks every tensor the model needs (the dense part and
every expert of every MoE block) against the model, then reads the dense tensors and this rank's
experts only, one tensor name at a time (``safe_open(...).get_tensor`` / ``get_slice``), fuses
each block's gate and up projections into ``w13 [L, 2I, H]`` once, and replaces the MoE blocks by
``EPMoEBlock``\\ s holding only those experts. Per-rank memory is the dense part plus E/W experts.
With ``elastic=`` (an ``ElasticGroup``) the blocks are elastic and a recovery reads the experts
that only a lost rank held from the checkpoint again, those experts alone
(checkpoint_experts.py, which also reads each rank's slots while loading).

Every rank checks the whole checkpoint's metadata (cheap: no tensor data), so a checkpoint that
does not match the model (a missing tensor, a wrong shape, an integer dtype where the model has
floats) raises the same ``EPInputError``, naming the tensor and the file, on every rank before any
rank communicates. Values: each rank checks every tensor it reads, as loaded (one reduction a
tensor, ``TensorReader``); the ranks then share what they found, and a NaN or an Inf anywhere
raises the same ``EPInputError`` on every rank, naming the first such tensor and its file,
before ``load_sharded`` returns (before any rank serves).

Expert tensor names: the per-expert format the models' own repositories ship and transformers
5.x ``save_pretrained`` writes (``…mlp.experts.{e}.gate_proj.weight``; Mixtral
``…block_sparse_moe.experts.{e}.w1.weight``), or transformers' fused in-memory layout
(``…mlp.experts.gate_up_proj [E, 2I, H]``, ``save_pretrained(save_original_format=False)``).
fp8 checkpoints (DeepSeek-V3's ``weight`` + ``weight_scale_inv``) are refused with that reason:
this loader has no fp8 weight path yet (``EPMoE`` takes ``fp8_block`` weights, and
``patch_moe_blocks`` hands them over from a model loaded whole), and casting fp8 without its
scales would be wrong.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ep_runtime.comm import Comm
from ep_runtime.eplb import PlacementMap
from ep_runtime.integrations.checkpoint_experts import (
    BlockExperts,
    CheckpointExpertSource,
    SlotLoader,
)
from ep_runtime.integrations.meta_model import build_empty_model
from ep_runtime.integrations.safetensors_index import (
    CheckpointIndex,
    ProgressCallback,
    ProgressPrinter,
    TensorInfo,
    TensorRead,
    TensorReader,
)
from ep_runtime.integrations.transformers import (
    PatchReport,
    architecture_of,
    find_moe_blocks,
    patch_moe_blocks,
    require_transformers,
)
from ep_runtime.types import EPInputError

if TYPE_CHECKING:
    from ep_runtime.elastic import ElasticGroup


# tensor names per architecture (keyed like ARCHITECTURES) ----------------------------------------
@dataclass(frozen=True)
class CheckpointNames:
    """How one architecture's checkpoints name a MoE block's expert tensors, per expert:
    ``{block}.experts.{e}.{gate|up|down}.weight`` (``[I, H]``, ``[I, H]``, ``[H, I]``), and
    which parts of the model's names the original checkpoints spell differently."""

    gate: str
    up: str
    down: str
    renames: tuple[tuple[str, str], ...] = ()  # (in the model's names, in the checkpoint's)


CHECKPOINT_NAMES: dict[str, CheckpointNames] = {
    "qwen3-moe": CheckpointNames("gate_proj", "up_proj", "down_proj"),
    "mixtral": CheckpointNames("w1", "w3", "w2", renames=((".mlp.", ".block_sparse_moe."),)),
    "deepseek-v3": CheckpointNames("gate_proj", "up_proj", "down_proj"),
    "deepseek-v2": CheckpointNames("gate_proj", "up_proj", "down_proj"),
}
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"  # transformers' in-memory layout


def checkpoint_names(model_name: str, renames: tuple[tuple[str, str], ...]) -> list[str]:
    """The names a model tensor may have in a checkpoint: its own, then the original spelling."""
    names = [model_name]
    for ours, theirs in renames:
        if ours in model_name and model_name.replace(ours, theirs) not in names:
            names.append(model_name.replace(ours, theirs))
    return names


# the plan: what this rank reads, checked against the model ----------------------------------------
@dataclass(frozen=True)
class DenseTensor:
    """A checkpoint tensor that fills one model parameter or buffer (under all its tied names)."""

    info: TensorInfo
    targets: tuple[str, ...]  # model names of the same tensor (tied weights share one)
    is_buffer: bool


@dataclass(frozen=True)
class LoadPlan:
    dense: tuple[DenseTensor, ...]
    experts: dict[str, BlockExperts]  # by block name
    num_experts: int
    local: tuple[int, ...]  # the expert of each of this rank's slots, in slot order
    ignored: tuple[str, ...]  # checkpoint tensors the model has no place for (e.g. MTP layers)


def plan_load(
    model: nn.Module,
    index: CheckpointIndex,
    rank: int,
    world_size: int,
    num_redundant_experts: int = 0,
) -> LoadPlan:
    """Check every tensor ``model`` needs against ``index`` (names, shapes, dtypes: metadata
    only) and list what rank ``rank`` of ``world_size`` reads: the experts of its slots in the
    initial placement (``PlacementMap.initial``, the one ``EPMoE`` starts from). Raises
    ``EPInputError`` naming the first tensor (and its file) that does not fit; the same on every
    rank."""
    blocks = find_moe_blocks(model)
    if not blocks:
        raise EPInputError("model", "a model with sparse-MoE blocks", type(model).__name__)
    names = {name: CHECKPOINT_NAMES[architecture_of(name, block).name] for name, block in blocks}
    renames = tuple(dict.fromkeys(r for n in names.values() for r in n.renames))
    expert_params = {f"{name}.experts.{p}" for name in names for p in (FUSED_GATE_UP, FUSED_DOWN)}
    used: set[str] = set()
    dense = []
    for targets, tensor, is_buffer in _model_tensors(model, expert_params):
        info = _find(index, targets, renames, tensor)
        _refuse_fp8(info)
        dense.append(DenseTensor(info, targets, is_buffer))
        used.add(info.name)
    num_experts = {int(block.experts.gate_up_proj.shape[0]) for _, block in blocks}
    if len(num_experts) != 1:
        raise EPInputError("model", "the same number of experts in every MoE block", num_experts)
    placement = PlacementMap.initial(num_experts.pop(), num_redundant_experts, world_size)
    experts = {}
    for name, block in blocks:
        experts[name] = _block_experts(index, name, block, names[name], renames)
        used.update(t.name for t in experts[name].tensors(range(placement.num_logical)))
    ignored = tuple(sorted(set(index.tensors) - used))
    local = placement.experts_on_rank(rank)
    return LoadPlan(tuple(dense), experts, placement.num_logical, local, ignored)


def _model_tensors(
    model: nn.Module, skip: set[str]
) -> Iterator[tuple[tuple[str, ...], torch.Tensor, bool]]:
    """(all names of one tensor, the tensor, whether a buffer) for every parameter and persistent
    buffer of ``model`` outside ``skip``; tied parameters come once, under every name."""
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, tuple[torch.Tensor, bool]] = {}
    persistent = set(model.state_dict(keep_vars=True))
    named = [(n, p, False) for n, p in model.named_parameters(remove_duplicate=False)]
    named += [(n, b, True) for n, b in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_buffer in named:
        if name in skip or (is_buffer and name not in persistent):
            continue
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = (tensor, is_buffer)
    for key, names in aliases.items():
        tensor, is_buffer = tensors[key]
        yield tuple(names), tensor, is_buffer


def _find(
    index: CheckpointIndex,
    targets: tuple[str, ...],
    renames: tuple[tuple[str, str], ...],
    tensor: torch.Tensor,
) -> TensorInfo:
    """The checkpoint tensor for a model tensor (any of its names, either spelling), checked
    against its shape and kind of dtype; where none is there, the error names the first name as
    the original checkpoints spell it."""
    candidates = [c for target in targets for c in checkpoint_names(target, renames)]
    original = checkpoint_names(targets[0], renames)[-1]
    found = next((c for c in candidates if index.get(c) is not None), original)
    return index.require(found, tuple(tensor.shape), "a tensor", tensor.is_floating_point())


def _refuse_fp8(info: TensorInfo) -> None:
    if info.is_fp8:
        raise EPInputError(
            f"checkpoint tensor {info.name} in {info.file}",
            "bf16, fp16 or fp32 weights (the sharded loader has no fp8 weight path yet: its "
            "weight_scale_inv would be needed to read it; load the model whole and patch it, or "
            "dequantize the checkpoint to bf16 first)",
            info.dtype,
        )


def _shapes(block: nn.Module) -> tuple[int, int, int]:
    num_experts, two_i, hidden = block.experts.gate_up_proj.shape  # meta: shapes only
    return int(num_experts), int(two_i) // 2, int(hidden)


def _expert_prefix(
    index: CheckpointIndex, block: str, names: CheckpointNames, renames: tuple[tuple[str, str], ...]
) -> tuple[str, bool]:
    """The checkpoint's name prefix of the block's experts (``….experts.``) and whether they are
    stored fused; the original spelling where neither form is found (for the error)."""
    prefixes = checkpoint_names(f"{block}.experts.", renames)
    for prefix in prefixes:
        if index.get(prefix + FUSED_GATE_UP) is not None:
            return prefix, True
    for prefix in prefixes:
        if index.get(f"{prefix}0.{names.gate}.weight") is not None:
            return prefix, False
    return prefixes[-1], False


def _per_expert_names(prefix: str, names: CheckpointNames, expert: int) -> tuple[str, str, str]:
    return tuple(f"{prefix}{expert}.{proj}.weight" for proj in (names.gate, names.up, names.down))


def _block_experts(
    index: CheckpointIndex,
    block_name: str,
    block: nn.Module,
    names: CheckpointNames,
    renames: tuple[tuple[str, str], ...],
) -> BlockExperts:
    """Every expert of the block in the checkpoint, each checked against the model."""
    num_experts, inter, hidden = _shapes(block)
    prefix, fused = _expert_prefix(index, block_name, names, renames)
    if fused:
        fused_shapes = ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter))
        gate_up = index.require(prefix + FUSED_GATE_UP, fused_shapes[0], "the fused experts")
        down = index.require(prefix + FUSED_DOWN, fused_shapes[1], "the fused experts")
        for info in (gate_up, down):
            _refuse_fp8(info)
        return BlockExperts(block_name, {}, (gate_up, down), (num_experts, inter, hidden))
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    per_expert = {}
    for expert in range(num_experts):
        triple = tuple(
            index.require(name, shape, f"expert {expert} of {num_experts}")
            for name, shape in zip(_per_expert_names(prefix, names, expert), shapes, strict=True)
        )
        for info in triple:
            _refuse_fp8(info)
        per_expert[expert] = triple
    return BlockExperts(block_name, per_expert, None, (num_experts, inter, hidden))


# reading ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadReport:
    """What one rank read from the checkpoint, and how long loading took."""

    path: str
    rank: int
    world_size: int
    local_experts: tuple[int, ...]  # the expert of each of this rank's slots
    num_experts: int
    prepare_s: float  # config, the empty model, the checkpoint's metadata read and checked
    read_s: float  # reading the tensors (opening shards, reading, casting, copying)
    total_s: float  # all of load_sharded, building the EP layers (collective) included
    bytes_read: int
    checkpoint_bytes: int  # every tensor of the checkpoint
    dense_bytes: int
    expert_bytes: int
    reads: tuple[TensorRead, ...]  # in reading order
    ignored: tuple[str, ...]  # checkpoint tensors the model has no place for

    def describe(self) -> str:
        share = self.bytes_read / max(self.checkpoint_bytes, 1)
        return (
            f"rank {self.rank}/{self.world_size}: read {self.bytes_read / 1e6:,.1f} MB of "
            f"{self.checkpoint_bytes / 1e6:,.1f} MB ({share:.0%}; dense "
            f"{self.dense_bytes / 1e6:,.1f} MB, experts {_ids(self.local_experts)} of "
            f"{self.num_experts}: {self.expert_bytes / 1e6:,.1f} MB) "
            f"in {len(self.reads)} reads, {self.read_s:.2f} s (before it "
            f"{self.prepare_s:.2f} s, in all {self.total_s:.2f} s); {len(self.ignored)} "
            "checkpoint tensors unused"
        )


@dataclass(frozen=True)
class ShardedModel:
    """``load_sharded``'s result: the patched model, its patch report, what was read."""

    model: nn.Module
    patch: PatchReport
    load: LoadReport


def _read_dense(
    model: nn.Module, plan: LoadPlan, reader: TensorReader, device: torch.device
) -> None:
    """Each dense tensor read once, cast to the model's dtype for it, and set under all its
    names (one parameter object: tied weights stay tied)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    for tensor in sorted(plan.dense, key=lambda t: (str(t.info.file), t.info.name)):
        old = targets[tensor.targets[0]]
        value = reader.read(tensor.info, device, old.dtype)
        if not tensor.is_buffer:
            value = nn.Parameter(value, requires_grad=old.requires_grad)
        for name in tensor.targets:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            (owner._buffers if tensor.is_buffer else owner._parameters)[attr] = value
    for module in model.modules():  # the buffers computed at construction
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def load_sharded(
    path: str | Path,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    config: Any = None,
    progress: ProgressCallback | None = None,
    elastic: ElasticGroup | None = None,
    **layer_options: Any,
) -> ShardedModel:
    """The model at ``path`` (a checkpoint directory, or one ``.safetensors`` file with
    ``config``, or with ``config.json`` beside it) on this rank of ``group`` (``None``: the
    default group if initialised, else a world of 1), its MoE blocks expert-parallel, having
    read only the dense tensors and this rank's experts. ``device``: default CUDA on NCCL groups,
    else CPU; ``dtype``: of the dense part and the experts (transformers' fp32 exceptions kept);
    ``progress``: called after every tensor read (default: a line on stderr at most every 5 s);
    ``layer_options`` go to ``EPMoE`` through ``patch_moe_blocks``. Every rank must call it.
    ``elastic`` (an ``ElasticGroup``, instead of ``group``): the blocks are elastic, and a
    recovery reads the experts only a lost rank held from the checkpoint again, those experts
    alone (``CheckpointExpertSource``). Raises ``EPInputError`` naming the tensor and its file,
    the same on every rank, where the checkpoint does not fit the model or a tensor read holds
    NaN or Inf (module docstring); ``EPInputError`` naming ``group`` where both it and
    ``elastic`` are given."""
    started = time.perf_counter()
    hf = require_transformers()
    path = Path(path)
    if elastic is not None and group is not None:
        raise EPInputError("group", "None where elastic= is given (it holds the group)", group)
    target = None if device is None else torch.device(device)
    comm = Comm.create(group if elastic is None else elastic.group, target)
    if config is None:
        config = hf.AutoConfig.from_pretrained(str(path if path.is_dir() else path.parent))
    elif isinstance(config, (str, Path)):
        config = hf.AutoConfig.from_pretrained(str(config))
    index = CheckpointIndex.open(path)
    model = build_empty_model(config, dtype)
    plan = plan_load(
        model,
        index,
        comm.rank,
        comm.world_size,
        layer_options.get("num_redundant_experts", 0),
    )
    prepare_s = time.perf_counter() - started
    expert_infos = [t for block in plan.experts.values() for t in block.tensors(plan.local)]
    dense_bytes = sum(t.info.nbytes for t in plan.dense)
    expert_bytes = sum(block.nbytes(plan.local) for block in plan.experts.values())
    reader = TensorReader(
        index,
        rank=comm.rank,
        bytes_total=dense_bytes + expert_bytes,
        tensors_total=len(plan.dense) + len(expert_infos),
        progress=progress or ProgressPrinter(),
    )
    try:
        _read_dense(model, plan, reader, comm.device)
        loader = SlotLoader(plan.experts, plan.local, reader, comm.device)
        if elastic is not None:
            layer_options["elastic"] = elastic
            layer_options["expert_source"] = CheckpointExpertSource(
                index, plan.experts, comm.rank, comm.device, dtype
            )
        group = None if elastic is not None else comm.group
        patch = patch_moe_blocks(
            model, group, expert_weights=loader, device=comm.device, **layer_options
        )
    finally:
        reader.close()
    _refuse_nonfinite(comm, reader, patch)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left without weights after loading: {left[:5]}")
    report = LoadReport(
        path=str(path),
        rank=comm.rank,
        world_size=comm.world_size,
        local_experts=plan.local,
        num_experts=plan.num_experts,
        prepare_s=prepare_s,
        read_s=reader.read_s,
        total_s=time.perf_counter() - started,
        bytes_read=reader.bytes_read,
        checkpoint_bytes=index.nbytes,
        dense_bytes=dense_bytes,
        expert_bytes=expert_bytes,
        reads=tuple(reader.reads),
        ignored=plan.ignored,
    )
    return ShardedModel(model, patch, report)


def _refuse_nonfinite(comm: Comm, reader: TensorReader, patch: PatchReport) -> None:
    """Every rank raises the same error, naming the first tensor (by rank) read with NaN or Inf
    values, if any rank read one (its EP layers closed first): each rank read only its part."""
    found = [f for per_rank in comm.all_gather_object(reader.nonfinite) for f in per_rank]
    if found:
        for block in patch.blocks:
            block.module.ep.close()
        raise found[0].error(others=found[1:])


def _ids(experts: tuple[int, ...]) -> str:
    """(4, 5, 6, 7) → '[4, 8)'; anything else as the list."""
    if experts == tuple(range(experts[0], experts[0] + len(experts))):
        return f"[{experts[0]}, {experts[-1] + 1})"
    return str(list(experts))
