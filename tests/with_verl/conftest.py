"""The verl tests: run where verl 0.9 and its dependencies are installed (their own venv:
`.ci/verl_stage.sh`, docs/verl.md); everywhere else the whole folder is skipped at
collection (the main run has verl without its dependencies, so its agent-loop classes do
not import). Ray is started once per session (local, 2 CPUs, no dashboard); the models are
tiny Qwen2 configs built with fixed seeds (no download). Run with OMP_NUM_THREADS=1."""
import importlib
import os
import sys

import pytest

try:  # verl's own classes, as the tests use them; any failure means "not this venv"
    importlib.import_module("verl.experimental.agent_loop.agent_loop")
    importlib.import_module("verl.workers.rollout.llm_server")
except Exception:  # noqa: BLE001 - verl without its dependencies raises ImportError or worse: skip the folder
    collect_ignore_glob = ["test_*.py"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_session():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
