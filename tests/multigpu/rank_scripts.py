"""Groups of rank scripts run as a user's would be (``python -m MODULE --rank R ...``, one process
per rank, gloo over a store this process hosts): for cases in which a rank dies the way a script
does (an uncaught exception through ``sys.excepthook``, then the interpreter's exit), which a
pool's rank process would not show. Each surviving rank prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ep_runtime.launch.rendezvous import LOOPBACK, host_store


def run_rank_scripts(
    module: str, world: int, args: dict[str, object], timeout_s: float = 90.0
) -> tuple[list[dict], list[int], list[str]]:
    """Start ``world`` ranks of ``module`` with ``--world``, ``--port``, ``--rank`` and ``args``
    (``--name value`` each); return (every JSON line printed, each rank's exit code, each rank's
    stderr). Ranks still running after ``timeout_s`` are killed."""
    store = host_store(LOOPBACK, world + 1, 60)
    command = [sys.executable, "-m", module, "--world", str(world), "--port", str(store.port)]
    for name, value in args.items():
        command += [f"--{name}", str(value)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [*command, "--rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    reactions = [
        json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")
    ]
    return reactions, [p.returncode for p in processes], [err for _, err in outputs]
