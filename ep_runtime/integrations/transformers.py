"""Hugging Face ``transformers`` MoE models with their sparse-MoE blocks expert-parallel.

On every rank (data-parallel attention, expert-parallel MoE; the default process group)::

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    report = patch_moe_blocks(model)                       # EPMoE options as keywords
    result = greedy_generate(model, report, prompt_ids, max_new_tokens=32)

``patch_moe_blocks`` replaces every supported sparse-MoE block with an ``EPMoEBlock``: the block's
own router module runs on the rank (the same logits, the same output-recording hooks), ``route()``
reproduces the router's top-k from those logits, an ``EPMoE`` that holds only this rank's expert
shard computes the routed experts, and the block's shared experts (if any) run locally. Nothing
else in the model changes. ``greedy_generate`` keeps every rank in every MoE collective until all
ranks are done: a rank with no request, or one that has finished, runs each MoE block on zero
tokens, in layer order.

Needs the ``hf`` extra (``transformers``); written and tested against transformers 5.24.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ep_runtime.config import MoEConfig
from ep_runtime.layer import EPMoE
from ep_runtime.routing import Scoring, route
from ep_runtime.types import EPInputError

try:  # the optional extra; everything above works without it
    import transformers
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    transformers = None

TESTED_TRANSFORMERS = "5.24"


def require_transformers() -> Any:
    """The ``transformers`` module, or an ImportError that says how to get it."""
    if transformers is None:
        raise ImportError(
            "ep_runtime.integrations.transformers needs the 'hf' extra: "
            "pip install 'ep_runtime[hf]' (transformers)"
        )
    return transformers


# routers ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterSettings:
    """The ``route()`` arguments that reproduce one HF router, read from the router module."""

    top_k: int
    scoring: Scoring
    renormalize: bool
    num_expert_groups: int | None = None
    num_topk_groups: int | None = None
    routed_scaling_factor: float = 1.0
    uses_correction_bias: bool = False  # DeepSeek-V3: gate.e_score_correction_bias
    weights_in_logits_dtype: bool = False  # Qwen3 rounds its top-k weights to the logits' dtype


def _qwen3_router(gate: nn.Module) -> RouterSettings:
    # softmax in fp32 → top-k → optional renormalisation → cast to the logits' dtype
    return RouterSettings(
        top_k=int(gate.top_k),
        scoring=Scoring.SOFTMAX,
        renormalize=bool(gate.norm_topk_prob),
        weights_in_logits_dtype=True,
    )


def _mixtral_router(gate: nn.Module) -> RouterSettings:
    # softmax in fp32 → top-k → always renormalised, weights stay fp32
    return RouterSettings(top_k=int(gate.top_k), scoring=Scoring.SOFTMAX, renormalize=True)


def _deepseek_v3_router(gate: nn.Module) -> RouterSettings:
    # sigmoid; bias steers selection only; group-limited top-k; renormalise; × scaling factor
    return RouterSettings(
        top_k=int(gate.top_k),
        scoring=Scoring.SIGMOID,
        renormalize=bool(gate.norm_topk_prob),
        num_expert_groups=int(gate.num_group),
        num_topk_groups=int(gate.topk_group),
        routed_scaling_factor=float(gate.routed_scaling_factor),
        uses_correction_bias=True,
    )


def _deepseek_v2_router(gate: nn.Module) -> RouterSettings:
    # softmax top-k, never renormalised, × scaling factor ("greedy", DeepSeek-V2-Lite)
    if gate.topk_method != "greedy":
        raise UnsupportedMoEBlockError(
            "DeepseekV2Moe router topk_method",
            "'greedy' (route() ranks expert groups by their top-2 score sum, DeepSeek-V2's "
            "'group_limited_greedy' by their maximum)",
            repr(gate.topk_method),
        )
    return RouterSettings(
        top_k=int(gate.top_k),
        scoring=Scoring.SOFTMAX,
        renormalize=False,
        routed_scaling_factor=float(gate.routed_scaling_factor),
    )


@dataclass(frozen=True)
class Architecture:
    """One supported sparse-MoE block class and how to read its router."""

    name: str  # the launcher's name for a random model of this architecture
    module: str  # where transformers defines the block class
    block_class: str
    read_router: Callable[[nn.Module], RouterSettings]

    def matches(self, block: nn.Module) -> bool:
        """Exactly this class (a subclass may route differently)."""
        cls = type(block)
        return cls.__module__ == self.module and cls.__name__ == self.block_class


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "qwen3-moe",
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        _qwen3_router,
    ),
    Architecture(
        "mixtral",
        "transformers.models.mixtral.modeling_mixtral",
        "MixtralSparseMoeBlock",
        _mixtral_router,
    ),
    Architecture(
        "deepseek-v3",
        "transformers.models.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3MoE",
        _deepseek_v3_router,
    ),
    Architecture(
        "deepseek-v2",
        "transformers.models.deepseek_v2.modeling_deepseek_v2",
        "DeepseekV2Moe",
        _deepseek_v2_router,
    ),
)
SUPPORTED_BLOCKS = ", ".join(arch.block_class for arch in ARCHITECTURES)


class UnsupportedMoEBlockError(EPInputError):
    """A sparse-MoE block (or a setting of one) this integration cannot reproduce."""


# the EP block -------------------------------------------------------------------------------------
class EPMoEBlock(nn.Module):
    """Drop-in for a HF sparse-MoE block: its router, ``route()``, ``EPMoE``, its shared experts.

    ``forward`` takes and returns what the HF block does (``[B, S, H]`` → ``[B, S, H]``, or any
    ``[..., H]``). Inference only: the all-to-all has no backward.
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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., H] → [..., H]
        if self.training:
            raise RuntimeError(
                f"{self.hf_class} replaced by EPMoEBlock is inference-only (no backward through "
                "the all-to-all): call model.eval()"
            )
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()  # [T, H]
        router_logits = self.gate(x)[0]  # [T, E]
        topk_ids, topk_weights = self.route(router_logits)  # [T, K] int32, [T, K] fp32
        out = self.ep(x, topk_ids, topk_weights).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The HF router's top-k ids and weights, from its logits ``[T, E]``."""
        settings = self.router
        topk_ids, topk_weights = route(
            router_logits,
            settings.top_k,
            scoring=settings.scoring,
            renormalize=settings.renormalize,
            correction_bias=self.gate.e_score_correction_bias
            if settings.uses_correction_bias
            else None,
            num_expert_groups=settings.num_expert_groups,
            num_topk_groups=settings.num_topk_groups,
            routed_scaling_factor=settings.routed_scaling_factor,
        )
        if settings.weights_in_logits_dtype:
            topk_weights = topk_weights.to(router_logits.dtype).float()
        return topk_ids, topk_weights

    def forward_idle(self) -> None:
        """This rank's part of the block's collectives with no tokens of its own (T = 0): it
        still serves its experts to the other ranks."""
        hidden = self.ep.config.hidden_size
        self(torch.empty(0, hidden, dtype=self.ep.dtype, device=self.ep.device))

    def extra_repr(self) -> str:
        return f"replaces {self.hf_class}, {self.router}"


@dataclass(frozen=True)
class PatchedBlock:
    name: str  # qualified module name, e.g. "model.layers.1.mlp"
    hf_class: str
    module: EPMoEBlock


@dataclass
class PatchReport:
    """What ``patch_moe_blocks`` replaced, on this rank; also the handle for lockstep loops."""

    blocks: list[PatchedBlock]  # in layer (execution) order
    rank: int
    world_size: int
    num_experts: int
    local_experts: range  # this rank's expert ids
    expert_params_kept: int  # elements of this rank's expert shards, all blocks
    expert_params_freed: int  # elements of the HF expert tensors released, all blocks
    group: dist.ProcessGroup | None = field(repr=False, default=None)

    @property
    def device(self) -> torch.device:
        return self.blocks[0].module.ep.device

    @property
    def choice(self) -> str:
        """What "auto" picked for the EP layers (one line), and refusals below it."""
        return self.blocks[0].module.ep.choice.describe()

    def held_expert_bytes(self) -> int:
        """Bytes of the expert weights the EP layers hold (distinct storages)."""
        return sum(tensor_bytes(block.module.ep.experts) for block in self.blocks)

    def forward_idle(self) -> None:
        """Every EP block on zero tokens, in layer order: a rank with nothing to run this step
        still takes part in each block's collectives."""
        for block in self.blocks:
            block.module.forward_idle()

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (one 1-element all-reduce)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def describe(self) -> str:
        classes = sorted({block.hf_class for block in self.blocks})
        return (
            f"{len(self.blocks)} {'/'.join(classes)} blocks → EPMoE on rank "
            f"{self.rank}/{self.world_size}: experts [{self.local_experts.start}, "
            f"{self.local_experts.stop}) of {self.num_experts}; expert parameters kept "
            f"{self.expert_params_kept:,}, freed {self.expert_params_freed:,}; "
            f"{self.choice.splitlines()[0]}"
        )


def tensor_bytes(obj: object) -> int:
    """Bytes of the distinct storages behind the tensors among ``obj``'s attributes."""
    storages: dict[int, int] = {}
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# patching ---------------------------------------------------------------------------------------
def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module with an ``experts`` child (outermost only), in module (layer) order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if "experts" in dict(module.named_children()):
            found.append((name, module))
    return found


def architecture_of(name: str, block: nn.Module) -> Architecture:
    """The supported architecture of ``block`` (found at ``name``), or the error naming it."""
    for arch in ARCHITECTURES:
        if arch.matches(block):
            return arch
    raise UnsupportedMoEBlockError(
        "model", f"sparse-MoE blocks of {SUPPORTED_BLOCKS}", f"{type(block).__name__} at '{name}'"
    )


ExpertWeights = Callable[
    [str, torch.Tensor, torch.Tensor, Sequence[int]], tuple[torch.Tensor, torch.Tensor]
]  # (block name, its gate_up_proj [E, 2I, H], down_proj [E, H, I], expert of each local slot)
#    → [S, 2I, H], [S, H, I]


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
    **layer_options: Any,
) -> PatchReport:
    """Replace every supported sparse-MoE block of ``model`` by an ``EPMoEBlock`` on ``group``
    (``None``: the default group if initialised, else a world of 1), keeping only this rank's
    expert shard and freeing the HF expert tensors. ``layer_options`` go to ``EPMoE``
    (dispatcher, experts, layout, mode, max_tokens_per_rank, device). Every rank must call it on
    the same model (it builds EP layers, which agree on backends collectively). Move and cast
    the model first: the EP layers' weights are not parameters, a later ``model.to()`` leaves
    them where they are. ``expert_weights`` gives each block's local experts (default: the
    rows of its own tensors; integrations/checkpoint.py reads them from a checkpoint into a
    model whose expert tensors are on the meta device)."""
    found = find_moe_blocks(model)
    if not found:
        raise UnsupportedMoEBlockError(
            "model", f"a model with sparse-MoE blocks ({SUPPORTED_BLOCKS})", type(model).__name__
        )
    plans = [(name, block, architecture_of(name, block)) for name, block in found]
    routers = [(name, block, arch.read_router(block.gate)) for name, block, arch in plans]
    patched: list[PatchedBlock] = []
    kept = freed = 0
    for name, block, router in routers:
        w13, w2 = _fused_expert_weights(name, block)
        num_experts, _, hidden = w13.shape
        if not 1 <= router.top_k <= num_experts:
            raise EPInputError(f"{name}.gate.top_k", f"in [1, {num_experts}]", router.top_k)
        config = MoEConfig(
            num_experts=num_experts,
            top_k=router.top_k,
            hidden_size=hidden,
            intermediate_size=w2.size(2),
            activation="silu",
            dtype=w13.dtype,
        )
        options = {"device": w13.device, **layer_options}
        ep = EPMoE(config, group=group, **options)
        start, num_local = ep.placement.local_expert_offset, ep.placement.num_local_experts
        with torch.no_grad():
            ep.load_weights(*expert_weights(name, w13, w2, range(start, start + num_local)))
        replacement = EPMoEBlock(
            gate=block.gate,
            ep=ep,
            router=router,
            shared_experts=getattr(block, "shared_experts", None),
            hf_class=type(block).__name__,
        ).train(block.training)
        per_expert = w13[0].numel() + w2[0].numel()
        kept += num_local * per_expert
        freed += num_experts * per_expert
        del w13, w2
        _set_submodule(model, name, replacement)
        _release_experts(block.experts)
        patched.append(PatchedBlock(name, type(block).__name__, replacement))
    first = patched[0].module.ep
    return PatchReport(
        blocks=patched,
        rank=first.comm.rank,
        world_size=first.comm.world_size,
        num_experts=first.config.num_experts,
        local_experts=range(
            first.placement.local_expert_offset,
            first.placement.local_expert_offset + first.placement.num_local_experts,
        ),
        expert_params_kept=kept,
        expert_params_freed=freed,
        group=first.comm.group,
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
    if w13.dtype not in (torch.float32, torch.bfloat16):
        raise EPInputError(f"{name}.experts dtype", "torch.float32 or torch.bfloat16", w13.dtype)
    probe = torch.linspace(-4.0, 4.0, 17, dtype=torch.float32)
    if not torch.allclose(experts.act_fn(probe), F.silu(probe)):
        raise UnsupportedMoEBlockError(
            f"{name}.experts.act_fn", "SiLU (EPMoE's gated 'silu')", type(experts.act_fn).__name__
        )
    return w13, w2


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _release_experts(experts: nn.Module) -> None:
    """Drop the HF expert tensors, so that a reference to the old block cannot keep them."""
    for param_name in list(experts._parameters):
        delattr(experts, param_name)


# lockstep greedy generation -----------------------------------------------------------------------
@dataclass
class GreedyResult:
    """One rank's request: its tokens and logits, and where the time went."""

    tokens: list[int]  # generated ids; the EOS that ended the request is included
    logits: torch.Tensor  # [N, V] float32 on CPU: the logits each token was chosen from
    steps: int  # lockstep steps of the whole group (the same on every rank)
    idle_steps: int  # steps this rank ran every MoE block on zero tokens
    prefill_s: float  # this rank's first forward (0 without a request)
    active_s: float  # first step to this rank's last token (0 without a request)
    total_s: float  # first step to the group's last
    moe_s: float  # inside the EP blocks (router, dispatch, experts, combine, shared experts)


def greedy_generate(
    model: nn.Module,
    report: PatchReport,
    prompt: Sequence[int] | torch.Tensor | None,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    time_moe: bool = True,
) -> GreedyResult:
    """Greedy decoding of one request (``prompt``: token ids; ``None`` or empty: no request), in
    lockstep with the other ranks: each step all ranks agree (one tiny all-reduce) whether anyone
    still generates; a rank with nothing to run runs every MoE block on zero tokens instead, so
    every MoE collective has all ranks in it. Prompt and generation lengths may differ per rank.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise EPInputError("max_new_tokens", "an int >= 0", max_new_tokens)
    prompt_ids = torch.as_tensor([] if prompt is None else prompt, dtype=torch.long)
    if prompt_ids.dim() != 1:
        raise EPInputError("prompt", "a 1-D sequence of token ids, or None", list(prompt_ids.shape))
    stop_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    device = next(model.parameters()).device
    has_request = prompt_ids.numel() > 0 and max_new_tokens > 0
    next_input = prompt_ids[None].to(device)  # [1, P], then [1, 1]
    tokens: list[int] = []
    rows: list[torch.Tensor] = []  # [V] each
    cache = None
    steps = idle_steps = 0
    prefill_s = active_s = 0.0
    clock = MoEClock(report) if time_moe else None
    started = time.perf_counter()
    with torch.no_grad(), clock or nullcontext():
        while True:
            finished = bool(tokens) and (len(tokens) >= max_new_tokens or tokens[-1] in stop_ids)
            active = has_request and not finished
            if not report.anyone(active):
                break
            steps += 1
            if not active:
                report.forward_idle()  # timed by the clock's hooks like any MoE forward
                idle_steps += 1
                continue
            step_start = time.perf_counter()
            output = model(input_ids=next_input, cache=cache, use_cache=True, logits_to_keep=1)
            cache = output.cache
            row = output.logits[0, -1].float()  # [V]
            token = int(row.argmax())
            rows.append(row.cpu())
            tokens.append(token)
            next_input = torch.tensor([[token]], dtype=torch.long, device=device)
            now = time.perf_counter()
            active_s = now - started
            if len(tokens) == 1:
                prefill_s = now - step_start
    vocab = rows[0].numel() if rows else 0
    return GreedyResult(
        tokens=tokens,
        logits=torch.stack(rows) if rows else torch.empty(0, vocab),
        steps=steps,
        idle_steps=idle_steps,
        prefill_s=prefill_s,
        active_s=active_s,
        total_s=time.perf_counter() - started,
        moe_s=0.0 if clock is None else clock.seconds,
    )


class MoEClock:
    """Accumulates wall time spent inside the EP blocks (device-synchronised on CUDA)."""

    def __init__(self, report: PatchReport) -> None:
        self.report = report
        self.seconds = 0.0
        self._started = 0.0
        self._handles: list = []
        self._cuda = report.device.type == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.report.device)

    def _before(self, *_: object) -> None:
        self._sync()
        self._started = time.perf_counter()

    def _after(self, *_: object) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> MoEClock:
        for block in self.report.blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._before))
            self._handles.append(block.module.register_forward_hook(self._after))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# models -----------------------------------------------------------------------------------------
def _tiny_configs() -> dict[str, Callable[[], Any]]:
    """Small random-model configs per architecture (CPU-friendly; 12 experts: W = 1, 2, 3, 4,
    6, 12). Each has a dense layer before or between MoE layers."""
    hf = require_transformers()
    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    deepseek = dict(
        common,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=12,
        num_experts_per_tok=3,
    )
    return {
        "qwen3-moe": lambda: hf.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            num_experts=12,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
        "mixtral": lambda: hf.MixtralConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_local_experts=12,
            num_experts_per_tok=2,
        ),
        "deepseek-v3": lambda: hf.DeepseekV3Config(
            **deepseek,
            q_lora_rank=32,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        "deepseek-v2": lambda: hf.DeepseekV2Config(
            **deepseek,
            q_lora_rank=None,
            topk_method="greedy",
            n_shared_experts=2,
            routed_scaling_factor=1.0,
        ),
    }


RANDOM_MODELS = tuple(arch.name for arch in ARCHITECTURES)


def random_config(name: str, **overrides: Any) -> Any:
    """The tiny config of architecture ``name`` (see ``RANDOM_MODELS``), fields overridden."""
    configs = _tiny_configs()
    if name not in configs:
        raise EPInputError("model", f"one of {', '.join(configs)}", repr(name))
    config = configs[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_random_model(
    config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """A causal LM from ``config`` with seeded weights, identical in every process: matrices
    ~ N(0, 1/fan_in) (decisive routers, spread logits), norms ~ 1, DeepSeek-V3's correction
    bias ~ N(0, 0.1²) so that it changes selections."""
    hf = require_transformers()
    model = hf.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                values = torch.randn(param.shape, generator=generator) / param.size(-1) ** 0.5
            elif name.endswith("bias"):
                values = 0.1 * torch.randn(param.shape, generator=generator)
            else:
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            param.copy_(values)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model.to(device=device, dtype=dtype).eval()


def load_model(
    name_or_path: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """A random tiny model by architecture name, or a local checkpoint directory."""
    hf = require_transformers()
    if name_or_path in RANDOM_MODELS:
        return build_random_model(
            random_config(name_or_path), seed=seed, dtype=dtype, device=device
        )
    if Path(name_or_path).is_dir():
        model = hf.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        return model.to(device).eval()
    raise EPInputError(
        "model", f"one of {', '.join(RANDOM_MODELS)} or a local checkpoint directory", name_or_path
    )


def eos_ids(model: nn.Module) -> list[int]:
    """The model's end-of-sequence ids (config, then generation config); may be empty."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    return []
