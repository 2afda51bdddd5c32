"""Shared by the multi-process tests: run a worker script (alone or under torchrun) in a
clean CPU/gloo environment and fail the test with its output if it fails."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_worker(args: list[str], timeout: int = 600) -> None:
    env = dict(os.environ)
    # gloo's polling threads and 2 OpenMP threads per rank thrash 2 cores (2-3x slower)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU/gloo path on any machine (2 ranks, maybe 1 GPU)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
