"""The launcher's elastic mode: ``--elastic`` (the layer, or ``--hf-model``'s MoE blocks, on an
``ElasticGroup`` that keeps serving on the survivors when a rank dies) and ``--kill-rank R@N``
(rank R SIGKILLs itself as iteration N starts, or inside lockstep step N of an ``--hf-model``
generation: the fault to recover from), checked before any rank starts, each refusal one line
naming the option, what was expected and what was given."""

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
        "unless given. With --hf-model: the model's MoE blocks on it; the survivors run the "
        "failed step again and finish their requests, validated against transformers",
    )
    group.add_argument(
        "--kill-rank",
        action="append",
        type=KillAt.parse,
        metavar="R@N",
        help="with --elastic: rank R SIGKILLs itself as iteration N starts (with --hf-model: "
        "as its first MoE block starts in lockstep step N, 1 being the prefill); repeatable, or "
        "R@N,R@N; at least one rank survives",
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
    check_dispatcher(layer.dispatcher)
    kills = checked_kills(
        kills_of(args),
        spec.world_size,
        range(layer.iters),
        "an iteration",
        f"--iters {layer.iters}",
    )
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


def check_dispatcher(dispatcher: str) -> None:
    """``--dispatcher``: ``auto`` or one that is built again on a re-formed group."""
    if dispatcher == "auto":
        return
    if dispatcher not in DISPATCHERS.names() or not (
        DISPATCHERS[dispatcher].capabilities.rebuilds_on_new_group
    ):
        able = [d.name for d in DISPATCHERS if d.capabilities.rebuilds_on_new_group]
        raise ValueError(
            "--dispatcher: expected one that is built again on a re-formed group with "
            f"--elastic ({', '.join(sorted(able))}), given {dispatcher!r}"
        )


def checked_kills(
    kills: Sequence[KillAt], world_size: int, at: range, unit: str, why: str
) -> tuple[KillAt, ...]:
    """Each kill names a rank in ``[0, world_size)`` once and a point in ``at`` (``unit``: what
    the points are, "an iteration"; ``why``: where ``at`` comes from, "--iters 10"); one rank
    at least survives."""
    seen: set[int] = set()
    for kill in kills:
        if not 0 <= kill.rank < world_size:
            raise ValueError(
                f"--kill-rank: expected a rank in [0, {world_size}) (--dp {world_size}), given "
                f"{kill.rank} (in {kill})"
            )
        if kill.iteration not in at:
            raise ValueError(
                f"--kill-rank: expected {unit} in [{at.start}, {at.stop}) ({why}), given "
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


def hf_kills(
    args: argparse.Namespace, prompt_lengths: Sequence[int], new_tokens: Sequence[int]
) -> tuple[KillAt, ...]:
    """``--elastic`` with ``--hf-model``: a dispatcher that is built again on a re-formed group,
    each kill at a lockstep step the group runs, ``[1, S]`` (1 the prefill, S the longest
    request's new tokens; an EOS may end the generation sooner: the report then names the kill
    that did not happen)."""
    check_dispatcher(args.dispatcher)
    pairs = enumerate(zip(prompt_lengths, new_tokens, strict=True))
    requests = [(steps, rank) for rank, (prompt, steps) in pairs if prompt]
    steps, longest = max(requests, default=(0, None))
    why = (
        f"step 1 is the prefill; rank {longest}'s request, the longest, runs {steps}"
        if requests
        else "no rank has a request"
    )
    world_size = len(prompt_lengths)
    return checked_kills(kills_of(args), world_size, range(1, steps + 1), "a lockstep step", why)
