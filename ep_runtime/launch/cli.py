"""``python -m ep_runtime.launch``: run a model-shaped EP MoE layer on N ranks, validate every
rank against ``reference_moe``, time each phase, print a table.

Exit status: 0 every rank validated; 1 a rank's output was wrong; 2 bad arguments or the run could
not start; 3 a rank raised or died (the run was ended, the rank named); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from ep_runtime.dispatch import DISPATCHERS
from ep_runtime.experts import EXPERTS
from ep_runtime.launch import elastic_options, hf_run, layer_eplb
from ep_runtime.launch.layer_run import FAILURE_KINDS, FailureInjection, LayerWorkload
from ep_runtime.launch.presets import PRESETS, preset_by_name
from ep_runtime.launch.progress import (
    ProgressFactory,
    RunProgress,
    silence_library_progress_bars,
)
from ep_runtime.launch.spec import LaunchError, RankFailure, RunOutcome, RunSpec
from ep_runtime.launch.supervision import stop_handlers, usage_error_line
from ep_runtime.types import BackendUnavailableError, EPInputError

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_RANK_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
LAUNCHERS = ("auto", "ray", "spawn", "torchrun")
CONFIG_OPTIONS = {  # MoEConfig field -> the option that sets it
    "num_experts": "--num-experts",
    "top_k": "--top-k",
    "hidden_size": "--hidden",
    "intermediate_size": "--intermediate",
    "activation": "--activation",
    "max_tokens_per_rank": "--tokens",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors read like the launcher's own checks: one line naming the
    option, what was expected and what was given (exit 2), not a usage block."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise argparse.ArgumentError(action, f"expected one of {choices}, given {value!r}")

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        convert = self._registry_get("type", action.type, action.type)
        try:
            return convert(arg_string)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            kind = {int: "an integer", float: "a number"}.get(action.type)
            option = "/".join(action.option_strings)
            # a parser of our own (FailureInjection.parse) says what it expected, naming the option
            message = f"expected {kind}" if kind else str(error).removeprefix(f"{option}: ")
            if kind or "given" not in message:
                message += f", given {arg_string!r}"
            raise argparse.ArgumentError(action, message) from None

    def error(self, message: str) -> NoReturn:
        text = message.removeprefix("argument ")  # "argument --layout: ..." -> "--layout: ..."
        if text.startswith("unrecognized arguments"):
            text += f" (see {self.prog} --help)"
        print_line(Console(), f"error: {text}")
        self.exit(EXIT_USAGE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except where there is none (a preset's value, an unset file)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m ep_runtime.launch",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=HelpFormatter,
    )
    run = parser.add_argument_group("ranks")
    run.add_argument(
        "--dp",
        type=int,
        default=2,
        help="number of EP ranks (E must be divisible by it); torchrun / SLURM: the world size "
        "comes from the environment",
    )
    run.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="ray; spawn (torch.multiprocessing, one node, no Ray); torchrun (env:// rendezvous, "
        "also SLURM); auto: torchrun if RANK/WORLD_SIZE are set, else ray if installed, else spawn",
    )
    run.add_argument(
        "--address",
        default=None,
        help="ray: 'local' (private cluster), 'auto' (running cluster), or an address; "
        "default: RAY_ADDRESS if set, else local",
    )
    run.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: gloo ranks; cuda: NCCL, one GPU per rank; auto: cuda if there is a GPU per rank",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds (> 0), every collective: a desync fails instead of hanging",
    )
    layer = parser.add_argument_group("layer")
    layer.add_argument(
        "--dispatcher",
        default="auto",
        help="dispatcher backend name from the registry; what auto picked, and why "
        "the others were refused, is printed and in --json (cases[].choice)",
    )
    layer.add_argument("--experts", default="auto", help="experts backend name, as --dispatcher")
    layer.add_argument(
        "--layout",
        choices=("auto", "standard", "expanded", "both"),
        default="auto",
        help="rows as (token, rank) with [R, K] ids (standard) or (token, local expert) grouped by "
        "expert (expanded); both: one layer after the other, a table each; auto: the backend's",
    )
    layer.add_argument(
        "--mode",
        choices=("exact", "capacity"),
        default="exact",
        help="exact: exact sizes, one host sync; capacity: static shapes, no host sync "
        "(CUDA-graph capturable)",
    )
    layer.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                       help="auto: bf16 on CUDA, fp32 on CPU")  # fmt: skip
    layer.add_argument(
        "--quantization",
        choices=("none", "fp8_block"),
        default="none",
        help="expert weights: none (the compute dtype) or fp8_block (generated in bf16, stored "
        "e4m3 with an fp32 scale per 128x128 block; H and I multiples of 128)",
    )
    model = parser.add_argument_group(
        "model (a preset, then overrides)", "each override defaults to the preset's value"
    )
    model.add_argument(
        "--model",
        default="tiny",
        help=f"one of {', '.join(PRESETS)} (tiny: E=16, K=4, H=128, I=256)",
    )
    model.add_argument("--tokens", type=int, help="tokens per rank")
    model.add_argument("--hidden", type=int, help="hidden size H")
    model.add_argument("--intermediate", type=int, help="expert intermediate size I")
    model.add_argument("--num-experts", type=int, help="routed experts E")
    model.add_argument("--top-k", type=int, help="experts per token K")
    model.add_argument(
        "--activation",
        choices=("silu", "relu2"),
        help="expert activation: silu (gated, w13 = [gate; up]) or relu2 (not gated)",
    )
    bench = parser.add_argument_group("measurement and output")
    bench.add_argument("--iters", type=int, default=10, help="timed iterations")
    bench.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="weights, inputs, routing and the validation sample all derive from it",
    )
    bench.add_argument("--validate-tokens", type=int, default=64,
                       help="tokens per rank checked against reference_moe (0 = all)")  # fmt: skip
    bench.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the same-run all-to-all, dense-GEMM and memory baselines",
    )
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON")
    bench.add_argument(
        "--plot",
        metavar="FILE",
        help="write a PNG of phase times and per-expert load (needs matplotlib)",
    )
    bench.add_argument(
        "--inject-failure",
        metavar=f"RANK:{'|'.join(FAILURE_KINDS)}[:ITER]",
        type=FailureInjection.parse,
        help="testing the supervision: rank RANK fails at timed iteration ITER: raise (an "
        "exception), input (an EPInputError, as a backend rejecting its input), exit, kill, hang",
    )
    layer_eplb.add_arguments(parser)
    elastic_options.add_arguments(parser)
    hf_run.add_arguments(parser)
    return parser


def choose_launcher(requested: str) -> str:
    from ep_runtime.launch.torchrun import is_torchrun_env

    if requested != "auto":
        return requested
    if is_torchrun_env():
        return "torchrun"
    return "ray" if importlib.util.find_spec("ray") is not None else "spawn"


def build_spec(args: argparse.Namespace, world_size: int) -> RunSpec:
    """Every argument checked before a rank starts: counts, the layer shape (``MoEConfig``'s own
    checks, reported under the option's name), E divisible by W, backend names."""
    model = preset_by_name(args.model).with_overrides(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_experts=args.num_experts,
        top_k=args.top_k,
        activation=args.activation,
        tokens_per_rank=args.tokens,
    )
    if world_size < 1:
        raise ValueError(f"--dp: expected >= 1, given {world_size}")
    for option, count in (
        ("--tokens", model.tokens_per_rank),
        ("--iters", args.iters),
        ("--warmup", args.warmup),
        ("--validate-tokens", args.validate_tokens),
    ):
        if count < 0:
            raise ValueError(f"{option}: expected >= 0, given {count}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: expected > 0 seconds, given {args.timeout:g}")
    quantization = None if args.quantization == "none" else args.quantization
    try:
        replace(model.moe_config(), quantization=quantization)
    except EPInputError as error:
        option = CONFIG_OPTIONS.get(error.argument, error.argument)
        raise ValueError(f"{option}: expected {error.expected}, given {error.given}") from None
    routing = elastic_options.ELASTIC_ROUTING if args.elastic else layer_eplb.MODEL_ROUTING
    balance = layer_eplb.checked_options(args, model.num_experts, world_size, routing)
    if quantization is not None and (balance["redundant_experts"] or balance["rebalance_every"]):
        raise ValueError(
            "--redundant-experts: expected 0 and no --rebalance-every with --quantization "
            f"{quantization} (rebalancing moves unquantized weights only, for now), given "
            f"{balance['redundant_experts']} (--rebalance-every {balance['rebalance_every']})"
        )
    if not balance["redundant_experts"] and model.num_experts % world_size:
        raise ValueError(
            f"--dp: expected a divisor of the {model.num_experts} experts of {model.name}, "
            f"given {world_size}"
        )
    for option, requested, registry in (
        ("--dispatcher", args.dispatcher, DISPATCHERS),
        ("--experts", args.experts, EXPERTS),
    ):
        if requested != "auto" and requested not in registry.names():
            names = ", ".join(("auto", *registry.names()))
            raise ValueError(f"{option}: expected one of {names}, given {requested!r}")
    if args.inject_failure is not None and not 0 <= args.inject_failure.rank < world_size:
        raise ValueError(
            f"--inject-failure: expected a rank in [0, {world_size}), "
            f"given {args.inject_failure.rank}"
        )
    layouts = ("standard", "expanded") if args.layout == "both" else (args.layout,)
    workload = LayerWorkload(
        model=model,
        dtype=args.dtype,
        dispatcher=args.dispatcher,
        experts=args.experts,
        layouts=layouts,
        mode=args.mode,
        iters=args.iters,
        warmup=args.warmup,
        seed=args.seed,
        validate_tokens=args.validate_tokens,
        baselines=not args.no_baselines,
        inject_failure=args.inject_failure,
        quantization=quantization,
        **balance,
    )
    spec = RunSpec(world_size, args.device, workload, timeout_s=args.timeout)
    return elastic_options.elastic_spec(args, spec) if args.elastic else spec


def _launch(
    launcher: str, spec: RunSpec, address: str | None, progress_factory: ProgressFactory
) -> tuple[RunSpec, list[dict], bool]:
    """Run on the chosen launcher: (resolved spec, summaries by rank, whether to report here)."""
    if launcher == "ray":
        from ep_runtime.launch.ray_driver import run_with_ray

        return (*run_with_ray(spec, address, progress_factory), True)
    if launcher == "spawn":
        from ep_runtime.launch.spawn import run_with_spawn

        return (*run_with_spawn(spec, progress_factory), True)
    from ep_runtime.launch.torchrun import run_with_env

    spec, summaries, rank = run_with_env(spec, progress_factory)
    return spec, summaries, rank == 0


def check_memory(spec: RunSpec, launcher: str, address: str | None) -> None:
    """The layer's ranks that run on this machine must fit in its memory (``launch/memory.py``):
    every rank of spawn and of a private Ray cluster, this node's under torchrun; a cluster
    elsewhere is not checked from here."""
    import torch

    from ep_runtime.launch.memory import check_fits
    from ep_runtime.launch.spec import torch_dtype

    if launcher == "ray" and (address not in (None, "local") or os.environ.get("RAY_ADDRESS")):
        return
    here = spec.world_size
    if launcher == "torchrun":
        here = int(os.environ.get("LOCAL_WORLD_SIZE", here))
    device = spec.device
    if device == "auto":
        device = "cuda" if torch.cuda.device_count() >= here else "cpu"
    run = spec.workload
    dtype = torch_dtype(run.dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)
    check_fits(run.model, spec.world_size, dtype, run.mode, device, here, run.redundant_experts)


def check_outputs(args: argparse.Namespace) -> None:
    """``--json`` / ``--plot`` must be writable (and matplotlib importable) before a rank
    starts, not found out after the run."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot: expected matplotlib to be installed (pip install 'ep_runtime[plot]'), "
            "given none"
        )
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        target = Path(path)
        existed = target.exists()
        try:
            with target.open("a"):  # creates it if missing, never truncates
                pass
        except OSError as error:
            raise ValueError(
                f"{option}: expected a writable file, given {path!r} ({error.strerror})"
            ) from None
        if not existed:
            target.unlink()


def write_failure_json(path: str, failure: RankFailure, spec: RunSpec, launcher: str) -> None:
    """The report of a run a rank ended: who failed, and why."""
    failed = {
        "passed": False,
        "failed_rank": failure.rank,
        "error": str(failure),
        "usage_error": failure.usage_error,
        "world_size": spec.world_size,
        "launcher": launcher,
    }
    Path(path).write_text(json.dumps(failed, indent=2) + "\n")


def print_line(console: Console, text: str) -> None:
    """One unwrapped line, as given (no markup: an error may quote ``[...]``)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True, style="red")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # logs, ray job output: prose unwrapped, no progress bars
        console = Console(width=max(console.width, 100), soft_wrap=True)
        silence_library_progress_bars()
    launcher = choose_launcher(args.launcher)
    try:
        if launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "--launcher ray: expected ray to be installed (pip install 'ep_runtime[launch]'), "
                "given none"
            )
        elastic_options.check_launcher(args, launcher)
        world_size, reports_here = args.dp, True
        if launcher == "torchrun":
            from ep_runtime.launch.torchrun import env_rank

            place = env_rank()
            world_size, reports_here = place.world_size, place.rank == 0
        layer_eplb.refuse_with_hf_model(args)
        spec = (hf_run.build_spec if args.hf_model else build_spec)(args, world_size)
        if not args.hf_model:
            check_memory(spec, launcher, args.address)
        if reports_here:
            check_outputs(args)
    except (ValueError, RuntimeError) as error:
        print_line(console, f"error: {error}")
        return EXIT_USAGE
    progress_factory = partial(RunProgress, console)
    started = time.perf_counter()
    try:
        with stop_handlers():
            spec, summaries, is_reporter = _launch(launcher, spec, args.address, progress_factory)
    except LaunchError as error:
        print_line(console, f"cannot start: {error}")
        return EXIT_USAGE
    except (EPInputError, BackendUnavailableError) as error:  # this process is the rank
        print_line(console, f"error: {usage_error_line(error)}")
        return EXIT_USAGE
    except RankFailure as failure:
        if args.json:
            write_failure_json(args.json, failure, spec, launcher)
        if failure.usage_error is not None:
            print_line(
                console, f"error: rank {failure.rank} {failure.where}: {failure.usage_error}"
            )
            return EXIT_USAGE
        console.print("[bold red]run ended[/]")
        console.print(str(failure), markup=False, highlight=False)
        return EXIT_RANK_FAILED
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: every rank was stopped")
        return EXIT_INTERRUPTED
    outcome = RunOutcome(
        launcher, summaries, time.perf_counter() - started, is_reporter, args.json, args.plot
    )
    return EXIT_OK if spec.workload.finish(spec, outcome, console) else EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
