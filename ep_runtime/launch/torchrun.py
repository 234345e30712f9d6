"""torchrun / SLURM launcher: this process is one rank; ``env://`` rendezvous, no Ray.

Reads RANK, WORLD_SIZE, LOCAL_RANK (torchrun) or SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
(``srun``), and MASTER_ADDR / MASTER_PORT, which the job script must export. Supervision is the
job runner's (torchrun ends every rank when one fails); the collective timeout keeps a survivor
from waiting forever. Every rank gets every summary; rank 0 prints and writes the report.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ep_runtime.launch.progress import ProgressFactory
from ep_runtime.launch.rank import RankWorker, plan, run_plan
from ep_runtime.launch.spec import LaunchError, RunSpec, resolve_device


@dataclass(frozen=True)
class EnvRank:
    rank: int
    world_size: int
    local_rank: int


def env_rank(environ: dict[str, str] | None = None) -> EnvRank:
    """This process's place, from torchrun's variables or else SLURM's."""
    env = os.environ if environ is None else environ
    for rank_key, world_key, local_key in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if rank_key in env and world_key in env:
            return EnvRank(int(env[rank_key]), int(env[world_key]), int(env.get(local_key, 0)))
    raise LaunchError(
        "--launcher torchrun: set RANK and WORLD_SIZE (torchrun does) or run under srun "
        "(SLURM_PROCID, SLURM_NTASKS)"
    )


def is_torchrun_env() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_with_env(
    spec: RunSpec, progress_factory: ProgressFactory
) -> tuple[RunSpec, list[dict], int]:
    """Run this rank; returns the resolved spec, every rank's summary and this rank's id."""
    place = env_rank()
    if place.world_size != spec.world_size:
        raise RuntimeError(
            f"WORLD_SIZE={place.world_size} but the run was built for {spec.world_size}"
        )
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise LaunchError(f"--launcher torchrun: {key} must be set (env:// rendezvous)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = resolve_device(spec.device, 1, gpus, "this node")  # GPU LOCAL_RANK for this rank
    spec = dataclasses.replace(spec, device=device)
    worker = RankWorker(spec, place.rank, place.local_rank)
    worker.init_process_group(init_method="env://")
    steps = plan(spec)
    if place.rank == 0:
        with progress_factory(steps) as progress:
            summary = run_plan(worker, progress.done)
    else:
        summary = run_plan(worker)
    summaries = worker.comm.all_gather_object(summary)
    worker.shutdown()
    return spec, summaries, place.rank
