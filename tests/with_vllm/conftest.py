"""The vLLM tests: run where vLLM is installed (its own venv on CPU: `.ci/run`'s vLLM stage,
README "Rollouts with vLLM"); everywhere else the whole folder is skipped at collection.

Engines are started once per module (a vLLM start takes a minute or more on CPU); the
models are tiny Qwen2 / Llama configs with GQA and a head dimension of 32 (vLLM's CPU
attention refuses 16), built from configs with fixed seeds (no download). Run with OMP_NUM_THREADS=1."""
import importlib.util
import os

import pytest

# one thread for vLLM's CPU worker too (its default binds OpenMP threads to every core)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_session():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
