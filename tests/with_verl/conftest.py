"""The verl tests: run where verl 0.9 and its dependencies are installed (their own venv:
`.ci/verl_stage.sh`, docs/verl.md); everywhere else the whole folder is skipped at
collection (the main run has verl without its dependencies, so its agent-loop classes do
not import). Ray is started once for the test module (local, 2 CPUs, no dashboard); the models are
tiny Qwen2 configs built with fixed seeds (no download); the test module runs on one torch
thread (tests/conftest.py's `one_torch_thread`). Run with OMP_NUM_THREADS=1."""
import importlib
import os
import sys

try:  # verl's own classes, as the tests use them; any failure means "not this venv"
    importlib.import_module("verl.experimental.agent_loop.agent_loop")
    importlib.import_module("verl.workers.rollout.llm_server")
except Exception:  # noqa: BLE001 - verl without its dependencies raises ImportError or worse: skip the folder
    collect_ignore_glob = ["test_*.py"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

