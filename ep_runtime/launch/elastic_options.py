"""The launcher's elastic mode: ``--elastic`` (the layer on an ``ElasticGroup`` that keeps
serving on the survivors when a rank dies) and ``--kill-rank R@N`` (rank R SIGKILLs itself as
iteration N starts: the fault to recover from), checked before any rank starts, each refusal one
line naming the option, what was expected and what was given."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ep_runtime.dispatch import DISPATCHERS
from ep_runtime.launch.elastic_run import ELASTIC_ROUTING, ElasticWorkload, KillAt
from ep_runtime.launch.layer_run import LayerWorkload
from ep_runtime.launch.spec import RunSpec

TORCHRUN_KEEPS_NO_SURVIVOR = (
    "--elastic: expected --launcher spawn or ray (the launcher hosts the store and goes on "
    "with the survivors), given torchrun (torchrun's agent stops every worker when one fails, "
    "torch.distributed.elastic's policy; under srun rank 0 hosts the store)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("elastic EP (keep serving when a rank dies)")
    group.add_argument(
        "--elastic",
        action="store_true",
        help="the layer on an elastic group (spawn or ray): when a rank dies the survivors "
        "re-form the group, re-home its experts and go on; runs --iters forwards (no warm-up, "
        "no baselines); the report gives the recovery's times, where the lost experts came "
        f"from, the load before and after, the survivors validated; --routing {ELASTIC_ROUTING} "
        "unless given",
    )
    group.add_argument(
        "--kill-rank",
        action="append",
        type=KillAt.parse,
        metavar="R@N",
        help="with --elastic: rank R SIGKILLs itself as iteration N starts (repeatable, or "
        "R@N,R@N); at least one rank survives",
    )


def kills_of(args: argparse.Namespace) -> tuple[KillAt, ...]:
    """Every ``--kill-rank``, flattened, in the order given."""
    return tuple(kill for given in args.kill_rank or () for kill in given)


def check_launcher(args: argparse.Namespace, launcher: str) -> None:
    """``--elastic`` needs a launcher that goes on with the survivors; ``--kill-rank`` needs
    ``--elastic``. ``ValueError`` (one line) otherwise."""
    kills = kills_of(args)
    if kills and not args.elastic:
        given = ",".join(map(str, kills))
        raise ValueError(
            f"--kill-rank: expected --elastic with it (a rank's death ends any other run), "
            f"given {given} without --elastic"
        )
    if args.elastic and launcher == "torchrun":
        raise ValueError(TORCHRUN_KEEPS_NO_SURVIVOR)
    if args.elastic and args.hf_model:
        raise ValueError(
            f"--elastic: expected the synthetic layer (no --hf-model), given --hf-model "
            f"{args.hf_model}"
        )


def elastic_spec(args: argparse.Namespace, spec: RunSpec) -> RunSpec:
    """The checked synthetic-layer run ``spec`` as an elastic run: what ``--elastic`` cannot
    do refused, the kills checked against ``--dp`` and ``--iters``."""
    layer = spec.workload
    assert isinstance(layer, LayerWorkload)
    for option, given, default in (
        ("--quantization", layer.quantization, None),
        ("--rebalance-every", layer.rebalance_every, None),
        ("--inject-failure", args.inject_failure, None),
        ("--plot", args.plot, None),
    ):
        if given != default:
            raise ValueError(f"{option}: expected none with --elastic, given {given}")
    if len(layer.layouts) != 1:
        raise ValueError(
            "--layout: expected one layout with --elastic (auto, standard or expanded), "
            f"given {args.layout}"
        )
    if layer.dispatcher != "auto" and not (
        DISPATCHERS[layer.dispatcher].capabilities.rebuilds_on_new_group
    ):
        able = [d.name for d in DISPATCHERS if d.capabilities.rebuilds_on_new_group]
        raise ValueError(
            "--dispatcher: expected one that is built again on a re-formed group with "
            f"--elastic ({', '.join(sorted(able))}), given {layer.dispatcher!r}"
        )
    kills = checked_kills(kills_of(args), spec.world_size, layer.iters)
    workload = ElasticWorkload(
        model=layer.model,
        dtype=layer.dtype,
        dispatcher=layer.dispatcher,
        experts=layer.experts,
        layout=layer.layouts[0],
        mode=layer.mode,
        iters=layer.iters,
        seed=layer.seed,
        validate_tokens=layer.validate_tokens,
        routing=layer.routing,
        redundant_experts=layer.redundant_experts,
        kills=kills,
    )
    return RunSpec(spec.world_size, spec.device, workload, timeout_s=spec.timeout_s)


def checked_kills(kills: Sequence[KillAt], world_size: int, iters: int) -> tuple[KillAt, ...]:
    """Each kill names a rank in ``[0, world_size)`` once and an iteration in ``[0, iters)``;
    one rank at least survives."""
    seen: set[int] = set()
    for kill in kills:
        if not 0 <= kill.rank < world_size:
            raise ValueError(
                f"--kill-rank: expected a rank in [0, {world_size}) (--dp {world_size}), given "
                f"{kill.rank} (in {kill})"
            )
        if not 0 <= kill.iteration < iters:
            raise ValueError(
                f"--kill-rank: expected an iteration in [0, {iters}) (--iters {iters}), given "
                f"{kill.iteration} (in {kill})"
            )
        if kill.rank in seen:
            raise ValueError(
                f"--kill-rank: expected each rank killed once, given rank {kill.rank} twice"
            )
        seen.add(kill.rank)
    if kills and len(seen) == world_size:
        raise ValueError(
            f"--kill-rank: expected a rank left alive, given all {world_size} ranks killed"
        )
    return tuple(kills)
