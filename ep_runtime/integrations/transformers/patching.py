"""``patch_moe_blocks``, which swaps an ``EPMoEBlock`` (block.py) in for every supported block
and fuses/checks the HF expert weights into ``EPMoE``'s layout, keeping only this rank's shard.
FP8 experts (transformers' ``FineGrainedFP8Config``, 128×128 blocks) are handed over as they
are: e4m3 weights and fp32 block scales, ``MoEConfig(quantization="fp8_block")``. On an
``ElasticGroup`` each block's ``EPMoE`` is elastic, its weight source the caller's
``expert_source`` for that block (the HF expert tensors are freed, so lost experts must be read
again from elsewhere)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ep_runtime.config import MoEConfig
from ep_runtime.integrations.transformers.architectures import (
    SUPPORTED_BLOCKS,
    UnsupportedMoEBlockError,
    architecture_of,
)
from ep_runtime.integrations.transformers.block import EPMoEBlock
from ep_runtime.integrations.transformers.graphs import BlockGraphs, check_graph_option
from ep_runtime.integrations.transformers.report import PatchedBlock, PatchReport
from ep_runtime.layer import EPMoE
from ep_runtime.quantization import BLOCK, FP8_DTYPE, Quantization
from ep_runtime.types import EPInputError

if TYPE_CHECKING:
    from ep_runtime.elastic import ElasticGroup


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module with an ``experts`` child (outermost only), in module (layer) order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if "experts" in dict(module.named_children()):
            found.append((name, module))
    return found


ExpertWeights = Callable[
    [str, torch.Tensor, torch.Tensor, Sequence[int]], tuple[torch.Tensor, torch.Tensor]
]  # (block name, its gate_up_proj [E, 2I, H], down_proj [E, H, I], expert of each local slot)
#    → [S, 2I, H], [S, H, I]

ExpertSource = Callable[
    [str, Sequence[int]], tuple[torch.Tensor, torch.Tensor]
]  # (block name, logical expert ids [n]) → gate_up_proj rows [n, 2I, H], down_proj rows [n, H, I]


def _local_rows(
    name: str, w13: torch.Tensor, w2: torch.Tensor, local: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the block's own expert tensors (indexing copies: a slice would keep
    the whole ``[E, ...]`` storage alive)."""
    return w13[list(local)].detach(), w2[list(local)].detach()


def patch_moe_blocks(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    expert_weights: ExpertWeights = _local_rows,
    cuda_graph_tokens: int | None = None,
    elastic: ElasticGroup | None = None,
    expert_source: ExpertSource | None = None,
    **layer_options: Any,
) -> PatchReport:
    """Replace every supported sparse-MoE block of ``model`` by an ``EPMoEBlock`` on ``group``
    (``None``: the default group if initialised, else a world of 1), keeping only this rank's
    expert shard and freeing the HF expert tensors. ``layer_options`` go to ``EPMoE``
    (dispatcher, experts, layout, mode, max_tokens_per_rank, device, num_redundant_experts,
    eplb_interval, forward_graphs). Every rank must call it on
    the same model (it builds EP layers, which agree on backends collectively). Move and cast
    the model first: the EP layers' weights are not parameters, a later ``model.to()`` leaves
    them where they are. ``expert_weights`` gives each block's local experts (default: the
    rows of its own tensors; integrations/checkpoint.py reads them from a checkpoint into a
    model whose expert tensors are on the meta device). FP8 experts (transformers'
    ``FP8Experts``, 128×128 block scales) stay e4m3: an ``EPMoE`` with
    ``quantization="fp8_block"`` gets the weights and their scales. ``cuda_graph_tokens=N``
    (capacity mode, CUDA, a world of one): each block's forward on up to N tokens (a decode
    step) runs as a CUDA graph, captured at the first step of each size (graphs.py).
    ``elastic=`` (an ``ElasticGroup``, instead of ``group``): the blocks keep serving on the
    survivors after a rank is lost (ep_runtime/elastic/); the experts that only the lost rank
    held are read again from ``expert_source``, which is therefore required with it.

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face model with sparse-MoE blocks of a supported architecture, already on
        its device and in its dtype (the experts' dtype is the layers'; FP8 experts: the input
        embeddings' dtype, float32 or bfloat16). Patched in place.
    group : torch.distributed.ProcessGroup, optional
        The EP group, the same on every rank; None: the default group if initialised, else a
        world of one.
    expert_weights : callable, default: the rows of the block's own expert tensors
        ``(block name, w13 [E, 2I, H], w2 [E, H, I], expert of each local slot [S]) →
        (w13 [S, 2I, H], w2 [S, H, I])`` in the block's dtype: each block's local expert
        weights, one row per slot.
    cuda_graph_tokens : int, optional
        ``N ≥ 1``: each block's forward on up to ``N`` tokens runs as a CUDA graph (capacity
        mode, CUDA, a world of one); None: eager.
    elastic : ElasticGroup, optional
        The elastic group every block's ``EPMoE`` is built on (``group`` must then be None);
        after a rank loss, the next forward of any block re-forms it from the survivors and
        re-homes the experts (``greedy_generate`` re-runs the failed step).
    expert_source : callable, optional
        Required with ``elastic``, refused without it: ``(block name, logical expert ids
        [n]) → (w13 [n, 2I, H], w2 [n, H, I])``, those experts' ``gate_up_proj`` and
        ``down_proj`` rows (any dtype and device: they are cast), read only when a recovery
        needs them (``RandomExpertSource`` for the seeded random models, the checkpoint's
        reader for ``load_sharded``).
    **layer_options
        Passed to every block's ``EPMoE`` (above); ``device`` defaults to the expert
        tensors' device and ``device_checks`` to True.

    Returns
    -------
    PatchReport
        The replaced blocks in layer order, this rank's place in the group and its experts,
        the expert elements kept and freed; also the handle lockstep loops use
        (``greedy_generate``).

    Raises
    ------
    UnsupportedMoEBlockError
        ``model`` has no supported sparse-MoE block, or a block's settings are unsupported.
    EPInputError
        A router's ``top_k`` outside ``[1, E]``, FP8 experts in a model that is neither
        float32 nor bfloat16, a ``cuda_graph_tokens`` that cannot run here (named why), or
        ``elastic`` with a ``group``, without an ``expert_source``, with CUDA graphs or with FP8
        experts.
    """
    _check_elastic(group, elastic, expert_source, cuda_graph_tokens)
    graph_group = group if elastic is None else elastic.group
    check_graph_option(cuda_graph_tokens, layer_options, _model_device(model), graph_group)
    found = find_moe_blocks(model)
    if not found:
        raise UnsupportedMoEBlockError(
            "model", f"a model with sparse-MoE blocks ({SUPPORTED_BLOCKS})", type(model).__name__
        )
    plans = [(name, block, architecture_of(name, block)) for name, block in found]
    routers = [(name, block, arch.read_router(block.gate)) for name, block, arch in plans]
    patched: list[PatchedBlock] = []
    kept = freed = 0
    graph_pool = None if cuda_graph_tokens is None else torch.cuda.graph_pool_handle()
    for name, block, router in routers:
        w13, w2 = _fused_expert_weights(name, block)
        scales = _fp8_block_scales(name, block.experts, w13, w2)  # None: unquantized
        num_experts, _, hidden = w13.shape
        if not 1 <= router.top_k <= num_experts:
            raise EPInputError(f"{name}.gate.top_k", f"in [1, {num_experts}]", router.top_k)
        config = MoEConfig(
            num_experts=num_experts,
            top_k=router.top_k,
            hidden_size=hidden,
            intermediate_size=w2.size(2),
            activation="silu",
            dtype=w13.dtype if scales is None else _activation_dtype(model),
            quantization=None if scales is None else Quantization.FP8_BLOCK,
        )
        # the router's top-k ids are in range: checked on the device, no host read per forward;
        # with the blocks' own graphs, the layers capture none of their own
        options = {"device": w13.device, "device_checks": True, **layer_options}
        if graph_pool is not None:
            options.setdefault("forward_graphs", None)
        if elastic is not None:
            options.update(elastic=elastic, weight_source=partial(expert_source, name))
        ep = EPMoE(config, group=group, **options)
        local = list(ep.placement.experts_on_rank(ep.comm.rank))  # logical expert per slot
        num_local = len(local)
        shard_scales = (
            {}
            if scales is None
            else {  # [S, 2I/128, H/128], [S, H/128, I/128]
                f"{weight}_scale_inv": scale[local].detach()
                for weight, scale in zip(("w13", "w2"), scales, strict=True)
            }
        )
        with torch.no_grad():  # [S, 2I, H], [S, H, I]
            ep.load_weights(
                *expert_weights(name, w13, w2, local), weights_are="slots", **shard_scales
            )
        replacement = EPMoEBlock(
            gate=block.gate,
            ep=ep,
            router=router,
            shared_experts=getattr(block, "shared_experts", None),
            hf_class=type(block).__name__,
        ).train(block.training)
        if graph_pool is not None:
            replacement.graphs = BlockGraphs(
                replacement.tokens_forward, cuda_graph_tokens, graph_pool
            )
        per_expert = sum(t[0].numel() for t in (w13, w2, *(scales or ())))
        kept += num_local * per_expert
        freed += num_experts * per_expert
        del w13, w2
        _set_submodule(model, name, replacement)
        _release_experts(block.experts)
        patched.append(PatchedBlock(name, type(block).__name__, replacement))
    return PatchReport(
        blocks=patched,
        num_experts=patched[0].module.ep.config.num_experts,
        expert_params_kept=kept,
        expert_params_freed=freed,
        elastic=elastic,
    )


def _check_elastic(
    group: dist.ProcessGroup | None,
    elastic: ElasticGroup | None,
    expert_source: ExpertSource | None,
    cuda_graph_tokens: int | None,
) -> None:
    """``elastic`` comes with an ``expert_source`` and without a ``group`` or CUDA graphs."""
    if elastic is None:
        if expert_source is not None:
            raise EPInputError(
                "expert_source", "None without elastic= (only a recovery reads it)", expert_source
            )
        return
    if group is not None:
        raise EPInputError("group", "None where elastic= is given (it holds the group)", group)
    if not callable(expert_source):
        raise EPInputError(
            "expert_source",
            "a callable (block name, expert ids) -> (w13 [n, 2I, H], w2 [n, H, I]) where "
            "elastic= is given: the HF expert tensors are freed, and a recovery re-reads the "
            "experts only a lost rank held (RandomExpertSource for the seeded random models)",
            expert_source,
        )
    if cuda_graph_tokens is not None:
        raise EPInputError(
            "cuda_graph_tokens",
            "None where elastic= is given (a recovery rebuilds what a graph captured)",
            cuda_graph_tokens,
        )


def _fused_expert_weights(name: str, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_proj [E, 2I, H]`` (rows ``[gate; up]``) and ``down_proj [E, H, I]``, checked
    to be the layout and activation ``EPMoE`` computes: ``down · (silu(gate·x) * up·x)``."""
    experts = block.experts
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    fused = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    if not fused or w13.dim() != 3 or w2.dim() != 3:
        raise UnsupportedMoEBlockError(
            f"{name}.experts",
            "fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] tensors",
            type(experts).__name__,
        )
    num_experts, two_i, hidden = w13.shape
    expected_w2 = (num_experts, hidden, two_i // 2)
    if two_i % 2 or tuple(w2.shape) != expected_w2:
        raise UnsupportedMoEBlockError(
            f"{name}.experts.down_proj",
            f"shape {list(expected_w2)} for gate_up_proj {list(w13.shape)}",
            list(w2.shape),
        )
    layout_flags = {
        "is_transposed": False,
        "is_concatenated": True,
        "has_bias": False,
        "has_post_expert_norm": False,
    }
    for flag, expected in layout_flags.items():
        if getattr(experts, flag, expected) != expected:
            raise UnsupportedMoEBlockError(
                f"{name}.experts.{flag}", str(expected), getattr(experts, flag)
            )
    if w13.dtype not in (torch.float32, torch.bfloat16, FP8_DTYPE) or w2.dtype != w13.dtype:
        raise EPInputError(
            f"{name}.experts dtype",
            f"torch.float32, torch.bfloat16 or {FP8_DTYPE} (FineGrainedFP8), the same for both",
            f"{w13.dtype} and {w2.dtype}",
        )
    probe = torch.linspace(-4.0, 4.0, 17, dtype=torch.float32)
    if not torch.allclose(experts.act_fn(probe), F.silu(probe)):
        raise UnsupportedMoEBlockError(
            f"{name}.experts.act_fn", "SiLU (EPMoE's gated 'silu')", type(experts.act_fn).__name__
        )
    return w13, w2


def _fp8_block_scales(
    name: str, experts: nn.Module, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' FP8 experts (``FP8Experts``): ``gate_up_proj_scale_inv [E, 2I/128, H/128]``
    and ``down_proj_scale_inv [E, H/128, I/128]`` fp32, checked to be the contract EPMoE
    computes (128×128 blocks, dynamic activation scales, plain SiLU gate); None for unquantized
    experts."""
    if w13.dtype != FP8_DTYPE:
        return None
    settings = {
        "block_size": ([BLOCK, BLOCK], list(getattr(experts, "block_size", None) or [])),
        "activation_scheme": ("dynamic", getattr(experts, "activation_scheme", None)),
    }
    # clamped or soft-capped SwiGLU variants: not the contract's silu(gate) * up
    for variant in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap"):
        settings[variant] = (None, getattr(experts, variant, None))
    for setting, (expected, given) in settings.items():
        if given != expected:
            raise UnsupportedMoEBlockError(f"{name}.experts.{setting}", repr(expected), given)
    scales = []
    for weight_name, weight in (("gate_up_proj", w13), ("down_proj", w2)):
        scale = getattr(experts, f"{weight_name}_scale_inv", None)
        *lead, rows, cols = weight.shape
        expected = [*lead, rows // BLOCK, cols // BLOCK]
        if (
            not isinstance(scale, torch.Tensor)
            or list(scale.shape) != expected
            or scale.dtype != torch.float32
        ):
            given = (
                f"shape {list(scale.shape)}, dtype {scale.dtype}"
                if isinstance(scale, torch.Tensor)
                else type(scale).__name__
            )
            raise UnsupportedMoEBlockError(
                f"{name}.experts.{weight_name}_scale_inv",
                f"fp32 block scales of shape {expected} (scale_fmt 'float'; ue8m0 checkpoints also "
                "round activation scales to powers of two, which the contract does not)",
                given,
            )
        scales.append(scale)
    return scales[0], scales[1]


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype hidden states have in ``model`` (its input embeddings'): FP8 experts'
    weights do not tell it."""
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise EPInputError("model dtype", "torch.float32 or torch.bfloat16", dtype)
    return dtype


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _release_experts(experts: nn.Module) -> None:
    """Drop the HF expert tensors, so that a reference to the old block cannot keep them."""
    for param_name in list(experts._parameters):
        delattr(experts, param_name)
