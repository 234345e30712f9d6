"""``python -m ep_runtime.launch --hf-model NAME|PATH``: a Hugging Face MoE model on the ranks.

Each rank loads the model (a small random model of the named architecture, or a local
checkpoint), replaces its sparse-MoE blocks with EP blocks (only its expert shard stays) and
greedily generates for its own request (data-parallel attention, expert-parallel MoE), in
lockstep with the others. Rank r's request: a prompt of ``prompt_tokens + 3r`` random ids and up
to ``new_tokens + 2r`` new tokens (``--hf-idle-rank R``: no request), so ranks start and finish
at different steps. The reporting process then runs the unpatched model (transformers' own
``generate``, greedy) on every rank's prompt and requires the same tokens and logits within the
derived tolerance (``ep_runtime/tolerance.py``; ``launch/hf_report.py``).

``--elastic``: the MoE blocks are built on the rank runtime's ``ElasticGroup`` with a source for
the experts a lost rank held (the seeded random model's, ``RandomExpertSource``, or the
checkpoint's, ``load_sharded(elastic=)``). A rank named in ``--kill-rank R@N`` writes the time
into the launcher's store and SIGKILLs itself as its first MoE block starts in lockstep step N
(after the first layer's attention added to the KV cache). ``greedy_generate`` on the survivors
undoes the failed step, recovers and runs it again; each survivor times, from its ``on_step``
calls, when it served again and when the step run again was done. The survivors' requests are
validated as any; the lost rank's is reported as lost.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Console

from ep_runtime.bench.metrics import peak_memory_bytes
from ep_runtime.bench.report import write_json
from ep_runtime.launch import elastic_options
from ep_runtime.launch.elastic_run import KILLED_KEY, KillAt
from ep_runtime.launch.hf_report import build_hf_report, print_hf_report, validate
from ep_runtime.launch.presets import ModelPreset, RouterSpec
from ep_runtime.launch.spec import RankContext, RunOutcome, RunSpec, Step, Workload, torch_dtype


@dataclass(frozen=True)
class HFWorkload(Workload):
    """What every rank runs: the model, each rank's request, and the EP layer options."""

    hf_model: str  # a random architecture name or a local checkpoint directory
    model: ModelPreset  # the MoE layer shape, for the report (the ranks read the real blocks)
    prompt_lengths: tuple[int, ...]  # per rank; 0 = no request
    new_tokens: tuple[int, ...]  # per rank, at most
    dtype: str = "auto"  # "auto", "bf16" or "fp32"
    dispatcher: str = "auto"
    experts: str = "auto"
    layout: str = "auto"
    mode: str = "exact"
    warmup: bool = True
    seed: int = 0
    elastic: bool = False  # --elastic: the blocks on an ElasticGroup
    kills: tuple[KillAt, ...] = ()  # --kill-rank R@N: rank R dies in lockstep step N

    @property
    def forms_elastic_group(self) -> bool:
        return self.elastic

    @property
    def killed_ranks(self) -> frozenset[int]:
        return frozenset(kill.rank for kill in self.kills)

    def prompt(self, rank: int, vocab_size: int) -> list[int]:
        """Rank ``rank``'s prompt ids, the same in every process."""
        generator = torch.Generator().manual_seed(self.seed * 7919 + rank)
        return torch.randint(
            0, vocab_size, (self.prompt_lengths[rank],), generator=generator
        ).tolist()

    def compute_dtype(self, device: str) -> torch.dtype:
        """``--dtype``, ``auto`` being bf16 on CUDA and fp32 on CPU."""
        return torch_dtype(self.dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)

    def plan(self) -> list[Step]:
        steps = [Step("setup", (), 1, "load model, patch MoE blocks")]
        if self.warmup:
            steps.append(Step("warmup", (), 1, "warm-up generation (2 tokens)"))
        steps.append(Step("generate", (), 1, "greedy generation, all ranks in lockstep"))
        steps.append(Step("summarize", (), 0, "summarize"))
        return steps

    def worker(self, context: RankContext) -> HFRankWorker:
        return HFRankWorker(self, context)

    def finish(self, spec: RunSpec, outcome: RunOutcome, console: Console) -> bool:
        """Validate (reporting process only), print, write JSON."""
        if not outcome.reports_here:
            return True
        summaries = sorted(outcome.summaries, key=lambda s: s["rank"])
        validations = validate(spec, summaries)
        report = build_hf_report(spec, outcome.launcher, summaries, outcome.elapsed_s, validations)
        print_hf_report(report, console)
        if outcome.json_path:
            write_json(report, outcome.json_path)
        return report["passed"]

    def to_json(self) -> dict:
        data = asdict(self) | {"kills": [str(kill) for kill in self.kills]}
        hf = {"model": data.pop("hf_model")}
        hf |= {key: data.pop(key) for key in ("prompt_lengths", "new_tokens")}
        return data | {"hf": hf}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Hugging Face model (instead of one synthetic layer)")
    group.add_argument(
        "--hf-model",
        metavar="NAME|PATH",
        help="generate with a transformers MoE model: qwen3-moe, mixtral, deepseek-v3, "
        "deepseek-v2, deepseek-v3-fp8 (FP8 experts, 128x128 block scales) (small random models) "
        "or a local checkpoint directory",
    )
    group.add_argument("--hf-prompt-tokens", type=int, default=8,
                       help="rank r's prompt: this + 3r tokens")  # fmt: skip
    group.add_argument("--hf-new-tokens", type=int, default=12,
                       help="rank r generates up to this + 2r tokens")  # fmt: skip
    group.add_argument("--hf-idle-rank", type=int, action="append", default=[], metavar="RANK",
                       help="a rank with no request (repeatable)")  # fmt: skip


def _hf_config(name_or_path: str) -> Any:
    from ep_runtime.integrations.transformers import NAMED_MODELS, random_config

    if name_or_path in NAMED_MODELS:
        return random_config(name_or_path)
    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:
            reason = " ".join(str(error).split())  # one line
            raise ValueError(
                f"--hf-model: expected a checkpoint directory with a transformers config.json, "
                f"given {name_or_path!r} ({reason})"
            ) from None
    raise ValueError(
        f"--hf-model: expected one of {', '.join(NAMED_MODELS)} or a local checkpoint "
        f"directory, given {name_or_path!r}"
    )


def check_checkpoint(path: str, config: Any, world_size: int) -> None:
    """What every rank will check of the checkpoint at ``path`` before reading a value, checked
    here before any rank starts: the index, every shard it names (there, readable, holding its
    tensors), and every tensor the model needs (name, shape, a float dtype where the model's is;
    ``plan_load``). Raises ``EPInputError`` naming the file and the tensor."""
    from ep_runtime.integrations.checkpoint import plan_load
    from ep_runtime.integrations.meta_model import build_empty_model
    from ep_runtime.integrations.safetensors_index import CheckpointIndex

    index = CheckpointIndex.open(path)
    plan_load(build_empty_model(config, torch.float32), index, 0, world_size)


def describe_model(name: str, config: Any, tokens_per_rank: int) -> ModelPreset:
    """The MoE layer shape of an HF config, for the report (the ranks read the real blocks)."""
    expert_keys = ("num_local_experts", "n_routed_experts", "num_experts")
    num_experts = next((getattr(config, k) for k in expert_keys if getattr(config, k, None)), 0)
    kind = config.model_type
    if kind == "deepseek_v3":
        router = RouterSpec(
            scoring="sigmoid",
            renormalize=bool(config.norm_topk_prob),
            correction_bias=True,
            num_expert_groups=config.n_group,
            num_topk_groups=config.topk_group,
            routed_scaling_factor=float(config.routed_scaling_factor),
        )
    elif kind == "deepseek_v2":
        router = RouterSpec(
            renormalize=False, routed_scaling_factor=float(config.routed_scaling_factor)
        )
    else:
        router = RouterSpec(renormalize=bool(getattr(config, "norm_topk_prob", True)))
    return ModelPreset(
        name=name,
        hidden_size=config.hidden_size,
        num_experts=int(num_experts),
        top_k=int(config.num_experts_per_tok or 0),
        intermediate_size=int(getattr(config, "moe_intermediate_size", config.intermediate_size)),
        activation="silu",
        router=router,
        tokens_per_rank=tokens_per_rank,
    )


def build_spec(args: argparse.Namespace, world_size: int) -> RunSpec:
    """The run of ``--hf-model``; checks what can be checked before any rank starts."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("--hf-model needs transformers: pip install 'ep_runtime[hf]'") from None
    if world_size < 1:
        raise ValueError(f"--dp: expected >= 1, given {world_size}")
    if args.hf_prompt_tokens < 1 or args.hf_new_tokens < 1:
        raise ValueError(
            "--hf-prompt-tokens and --hf-new-tokens: expected >= 1, given "
            f"{args.hf_prompt_tokens} and {args.hf_new_tokens}"
        )
    for rank in args.hf_idle_rank:
        if not 0 <= rank < world_size:
            raise ValueError(f"--hf-idle-rank: expected a rank in [0, {world_size}), given {rank}")
    if args.layout == "both":
        raise ValueError(
            "--layout: expected auto, standard or expanded with --hf-model, given both"
        )
    if args.quantization != "none":
        raise ValueError(
            "--quantization: expected none with --hf-model (the model's experts decide: "
            f"deepseek-v3-fp8 is fp8), given {args.quantization}"
        )
    config = _hf_config(args.hf_model)
    idle = set(args.hf_idle_rank)
    prompts = tuple(
        0 if rank in idle else args.hf_prompt_tokens + 3 * rank for rank in range(world_size)
    )
    model = describe_model(args.hf_model, config, max(prompts))
    if model.num_experts % world_size:
        raise ValueError(
            f"--dp: {args.hf_model} has {model.num_experts} experts, "
            f"not divisible by {world_size} ranks"
        )
    new_tokens = tuple(args.hf_new_tokens + 2 * rank for rank in range(world_size))
    kills: tuple[KillAt, ...] = ()
    if args.elastic:
        if getattr(config, "quantization_config", None) is not None:
            raise ValueError(
                "--elastic: expected a model without FP8 experts (a recovery moves unquantized "
                f"weights only), given --hf-model {args.hf_model}"
            )
        kills = elastic_options.hf_kills(args, prompts, new_tokens)
    if os.path.isdir(args.hf_model):
        check_checkpoint(args.hf_model, config, world_size)
    workload = HFWorkload(
        hf_model=args.hf_model,
        model=model,
        prompt_lengths=prompts,
        new_tokens=new_tokens,
        dtype=args.dtype,
        dispatcher=args.dispatcher,
        experts=args.experts,
        layout=args.layout,
        mode=args.mode,
        warmup=args.warmup > 0,
        seed=args.seed,
        elastic=args.elastic,
        kills=kills,
    )
    return RunSpec(world_size, args.device, workload, timeout_s=args.timeout)


class HFRankWorker:
    """One rank's model, EP blocks and generation; methods are the steps of ``plan``."""

    def __init__(self, workload: HFWorkload, context: RankContext) -> None:
        self.run = workload
        self.context = context
        self.rank = context.rank
        self.device = context.device
        self.dtype = workload.compute_dtype(context.device.type)
        if workload.elastic and context.elastic is None:
            raise RuntimeError("--elastic needs the rank runtime's ElasticGroup")
        self.group = context.elastic  # None unless --elastic
        self.my_kill = next((k.iteration for k in workload.kills if k.rank == self.rank), None)
        self.last_step = 0  # the last lockstep step on_step saw done
        self.resumes: list[dict] = []  # per recovery: when this rank served again, the step
        # it ran again and when that was done (on_step's times)

    def setup(self) -> dict:
        from ep_runtime.integrations.transformers import (
            RandomExpertSource,
            load_model,
            patch_moe_blocks,
            random_config,
        )

        run = self.run
        options: dict[str, Any] = {
            "dispatcher": run.dispatcher,
            "experts": run.experts,
            "layout": run.layout,
            "mode": run.mode,
            "device": self.device,
        }
        if run.mode == "capacity":  # static buffers: the longest prompt must fit
            options["max_tokens_per_rank"] = max(1, *run.prompt_lengths)
        self.load = None
        if os.path.isdir(run.hf_model):  # a checkpoint: this rank reads only its part of it
            from ep_runtime.integrations.checkpoint import load_sharded

            loaded = load_sharded(run.hf_model, dtype=self.dtype, elastic=self.group, **options)
            model, self.report, self.load = loaded.model, loaded.patch, loaded.load
        else:
            model = load_model(
                run.hf_model, seed=run.seed, dtype=self.dtype, device=str(self.device)
            )
            if self.group is not None:  # the experts a lost rank held, read again
                options["elastic"] = self.group
                options["expert_source"] = RandomExpertSource(
                    random_config(run.hf_model), seed=run.seed, dtype=self.dtype
                )
            self.report = patch_moe_blocks(model, **options)
        gc.collect()
        self.model = model
        self.params_after = sum(p.numel() for p in model.parameters())
        self.params_before = self.params_after + self.report.expert_params_freed
        self.prompt = run.prompt(self.rank, model.config.vocab_size)
        return {"patched": self.report.describe()}

    def warmup(self) -> None:
        self._generate(min(2, self.run.new_tokens[self.rank]))

    def generate(self) -> None:
        on_step = None
        if self.run.elastic:
            on_step = self._on_step if self.my_kill is None else self._die_in(self.my_kill)
        self.result = self._generate(self.run.new_tokens[self.rank], on_step)

    def _generate(self, max_new_tokens: int, on_step: Callable[[int], None] | None = None):
        from ep_runtime.integrations.transformers import eos_ids, greedy_generate

        return greedy_generate(
            self.model,
            self.report,
            self.prompt or None,
            max_new_tokens,
            eos_token_id=eos_ids(self.model),
            on_step=on_step,
        )

    def _on_step(self, step: int) -> None:
        """After lockstep step ``step`` (``greedy_generate``'s ``on_step``). Its first call after
        a recovery repeats the last step every survivor completed (this rank serves again), or,
        where that was none, is the end of the prefill run again."""
        now = time.time()
        if len(self.resumes) < len(self.report.recoveries):
            repeated = step <= self.last_step
            self.resumes.append(
                {
                    "resumed_at": now if repeated else None,
                    "step": step + 1 if repeated else step,
                    "done_at": None if repeated else now,
                }
            )
        elif self.resumes and self._awaited(step):
            self.resumes[-1]["done_at"] = now
        self.last_step = step

    def _awaited(self, step: int) -> bool:
        """Whether ``step`` is the one run again after the last recovery, not yet done."""
        last = self.resumes[-1]
        return last["done_at"] is None and last["step"] == step

    def _die_in(self, step: int) -> Callable[[int], None]:
        """``--kill-rank``: this rank writes the time into the launcher's store and SIGKILLs
        itself as its first MoE block starts in lockstep step ``step`` (a hook on the block,
        armed by the ``on_step`` returned after step ``step - 1``)."""
        armed = [step == 1]

        def die(*_: object) -> None:
            if armed[0]:
                record = json.dumps({"step": step, "at": time.time()})
                self.group.store.set(f"{KILLED_KEY}{self.rank}", record)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step(done: int) -> None:
            self._on_step(done)
            armed[0] = done == step - 1

        self.report.blocks[0].module.register_forward_pre_hook(die)
        return on_step

    def _elastic_summary(self) -> dict:
        """The kills (from the store), the recoveries this rank went through with its times
        around each, and the group it ended in."""
        result, store = self.result, self.group.store
        kills = []
        for kill in self.run.kills:
            key = f"{KILLED_KEY}{kill.rank}"
            if store.check([key]):
                kills.append({"rank": kill.rank, **json.loads(store.get(key).decode())})
        unseen = {"resumed_at": None, "step": None, "done_at": None}  # no on_step after it
        recoveries = [
            asdict(recovery)
            | {"total_s": recovery.total_s, "lines": recovery.lines()}
            | (self.resumes[index] if index < len(self.resumes) else unseen)
            for index, recovery in enumerate(result.recoveries)
        ]
        return {
            "kills": kills,
            "recoveries": recoveries,
            "lost_ranks": list(result.lost_ranks),
            "retried_steps": result.retried_steps,
            "new_rank": self.report.rank,
            "members": list(self.group.members),
        }

    def summarize(self) -> dict:
        result, report = self.result, self.report
        generated = len(result.tokens)
        decode_s = result.active_s - result.prefill_s
        block = report.blocks[0].module
        return {
            **self.context.describe(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "architecture": report.blocks[0].hf_class,
            "moe_blocks": len(report.blocks),
            "router": {k: getattr(v, "value", v) for k, v in asdict(block.router).items()},
            "choice": report.choice,
            "prompt": self.prompt,
            "max_new_tokens": self.run.new_tokens[self.rank],
            "tokens": result.tokens,
            # [N, V] as numpy: pickled by value (a torch tensor would travel as a shared-memory
            # handle that dies with the rank process); compared by the reporting process
            "logits": result.logits.numpy(),
            "steps": result.steps,
            "idle_steps": result.idle_steps,
            "prefill_s": result.prefill_s,
            "active_s": result.active_s,
            "total_s": result.total_s,
            "moe_s": result.moe_s,
            "tokens_per_s": generated / result.active_s if result.active_s > 0 else 0.0,
            "decode_tokens_per_s": (generated - 1) / decode_s if generated > 1 else 0.0,
            "local_experts": list(report.local_experts),  # of the first block, per slot
            "num_experts": report.num_experts,
            "expert_params_kept": report.expert_params_kept,
            "expert_params_freed": report.expert_params_freed,
            "held_expert_bytes": report.held_expert_bytes(),
            "params_before_patch": self.params_before,
            "params_after_patch": self.params_after,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "load": None if self.load is None else self.load.describe(),
            "load_s": None if self.load is None else self.load.total_s,
            "bytes_read": None if self.load is None else self.load.bytes_read,
        } | (self._elastic_summary() if self.run.elastic else {})

    def close(self) -> None:
        for block in getattr(getattr(self, "report", None), "blocks", []):
            block.module.ep.close()
