"""Shared by the multi-process tests: run a worker script (alone or under torchrun) in a
clean CPU/gloo environment and fail the test with its output if it fails."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# launcher hiccups seen on loaded shared machines (port races, slow rendezvous): retried once
_TRANSIENT = ("Address already in use", "EADDRINUSE", "RendezvousTimeoutError", "RendezvousConnectionError",
              "Connection reset by peer", "Connection refused")


def run_worker(args: list[str], timeout: int = 600, extra_env: dict | None = None) -> None:
    proc = _run(args, timeout, extra_env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and any(t in out for t in _TRANSIENT):
        print(f"worker launch failed transiently (rc={proc.returncode}); retrying once:\n{out[-2000:]}")
        proc = _run(args, timeout, extra_env)
    if proc.returncode != 0:
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def _run(args: list[str], timeout: int, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # gloo's polling threads and 2 OpenMP threads per rank thrash 2 cores (2-3x slower)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU/gloo path on any machine (2 ranks, maybe 1 GPU)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra_env or {})
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
