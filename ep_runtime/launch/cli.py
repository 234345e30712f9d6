"""``python -m ep_runtime.launch``: run a model-shaped EP MoE layer on N ranks, validate every
rank against ``reference_moe``, time each phase, print a table.

Exit status: 0 every rank validated; 1 a rank's output was wrong; 2 bad arguments or the run could
not start; 3 a rank raised or died (the run was ended, the rank named); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from functools import partial

from rich.console import Console

from ep_runtime.bench.report import build_report, print_report, write_json, write_plot
from ep_runtime.launch import hf_run
from ep_runtime.launch.presets import PRESETS, preset_by_name
from ep_runtime.launch.progress import ProgressFactory, RunProgress
from ep_runtime.launch.spec import (
    FAILURE_KINDS,
    FailureInjection,
    LaunchError,
    RankFailure,
    RunSpec,
)
from ep_runtime.launch.supervision import stop_handlers

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_RANK_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
LAUNCHERS = ("auto", "ray", "spawn", "torchrun")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.launch",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("ranks")
    run.add_argument("--dp", type=int, default=2, help="number of EP ranks (ignored by torchrun)")
    run.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="auto: torchrun if RANK/WORLD_SIZE are set, else ray if installed, else spawn",
    )
    run.add_argument(
        "--address",
        default=None,
        help="ray: 'local' (private cluster), 'auto' (running cluster), or an address; "
        "default: RAY_ADDRESS if set, else local",
    )
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument("--timeout", type=float, default=60.0, help="seconds, every collective")
    layer = parser.add_argument_group("layer")
    layer.add_argument("--dispatcher", default="auto", help="dispatcher backend name")
    layer.add_argument("--experts", default="auto", help="experts backend name")
    layer.add_argument("--layout", choices=("auto", "standard", "expanded", "both"), default="auto")
    layer.add_argument("--mode", choices=("exact", "capacity"), default="exact")
    layer.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                       help="auto: bf16 on CUDA, fp32 on CPU")  # fmt: skip
    model = parser.add_argument_group("model (a preset, then overrides)")
    model.add_argument("--model", default="tiny", help=f"one of {', '.join(PRESETS)}")
    model.add_argument("--tokens", type=int, help="tokens per rank")
    model.add_argument("--hidden", type=int, help="hidden size H")
    model.add_argument("--intermediate", type=int, help="expert intermediate size I")
    model.add_argument("--num-experts", type=int, help="routed experts E")
    model.add_argument("--top-k", type=int, help="experts per token K")
    model.add_argument("--activation", choices=("silu", "relu2"))
    bench = parser.add_argument_group("measurement and output")
    bench.add_argument("--iters", type=int, default=10, help="timed iterations")
    bench.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--validate-tokens", type=int, default=64,
                       help="tokens per rank checked against reference_moe (0 = all)")  # fmt: skip
    bench.add_argument("--no-baselines", action="store_true", help="skip the a2a / GEMM baselines")
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON")
    bench.add_argument("--plot", metavar="FILE", help="write a PNG plot (needs matplotlib)")
    bench.add_argument(
        "--inject-failure",
        metavar=f"RANK:{'|'.join(FAILURE_KINDS)}[:ITER]",
        type=FailureInjection.parse,
        help="testing the supervision: make one rank fail at a timed iteration",
    )
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
    """Checks the shape against the world size up front (E divisible by W, K ≤ E)."""
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
    if model.num_experts % world_size:
        raise ValueError(
            f"--dp: {model.name} has {model.num_experts} experts, "
            f"not divisible by {world_size} ranks"
        )
    if not 1 <= model.top_k <= model.num_experts:
        raise ValueError(f"--top-k: expected 1..{model.num_experts}, given {model.top_k}")
    if model.tokens_per_rank < 0 or args.iters < 0 or args.warmup < 0:
        raise ValueError("--tokens, --iters and --warmup must be >= 0")
    if args.inject_failure is not None and not 0 <= args.inject_failure.rank < world_size:
        raise ValueError(f"--inject-failure: rank must be in [0, {world_size})")
    layouts = ("standard", "expanded") if args.layout == "both" else (args.layout,)
    return RunSpec(
        model=model,
        world_size=world_size,
        device=args.device,
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
        timeout_s=args.timeout,
        inject_failure=args.inject_failure,
    )


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # logs, ray job output: room for the tables
        console = Console(width=max(console.width, 120))
    launcher = choose_launcher(args.launcher)
    try:
        world_size = args.dp
        if launcher == "torchrun":
            from ep_runtime.launch.torchrun import env_rank

            world_size = env_rank().world_size
        spec = (hf_run.build_spec if args.hf_model else build_spec)(args, world_size)
    except (ValueError, RuntimeError) as error:
        console.print(f"[red]error:[/] {error}")
        return EXIT_USAGE
    progress_factory = partial(RunProgress, console)
    started = time.perf_counter()
    try:
        with stop_handlers():
            spec, summaries, is_reporter = _launch(launcher, spec, args.address, progress_factory)
    except LaunchError as error:
        console.print(f"[red]cannot start:[/] {error}")
        return EXIT_USAGE
    except RankFailure as failure:
        console.print("[bold red]run ended[/]")
        console.print(str(failure), markup=False, highlight=False)
        if args.json:
            failed = {"passed": False, "failed_rank": failure.rank, "error": str(failure)}
            with open(args.json, "w") as handle:
                json.dump(
                    failed | {"world_size": spec.world_size, "launcher": launcher}, handle, indent=2
                )
        return EXIT_RANK_FAILED
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: every rank was stopped")
        return EXIT_INTERRUPTED
    if spec.hf is not None:
        elapsed = time.perf_counter() - started
        return hf_run.finish(spec, launcher, summaries, elapsed, is_reporter, console, args.json)
    report = build_report(spec.to_json(), launcher, summaries, time.perf_counter() - started)
    if is_reporter:
        print_report(report, console)
        if args.json:
            write_json(report, args.json)
        if args.plot:
            write_plot(report, args.plot)
    return EXIT_OK if report["passed"] else EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
