"""Shared test fixtures: a fixed seed by default (random on request, printed so a failure
can be replayed), one torch thread for the modules that train tiny models, and tiny SFT'd
agents built once per session."""
import os
import random
import sys

import pytest

# The test modules sit in one folder per area (tests/ops, tests/env, ...); the helpers they
# share (_fused_cases, _launch, the distributed workers) stay here, importable by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def seed(request):
    """The test's seed: fixed by default (deterministic CI); MEMOPD_TEST_SEED=N replays or
    chooses one, MEMOPD_TEST_SEED=random draws a fresh one (printed, to replay a failure)."""
    raw = os.environ.get("MEMOPD_TEST_SEED", "0")
    s = random.SystemRandom().randrange(2**31) if raw == "random" else int(raw)
    print(f"[seed] {request.node.nodeid}: MEMOPD_TEST_SEED={s}")
    return s


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a test module, restored afterwards. Tiny models gain nothing
    from more, and on a busy 2-core machine oversubscribed threads make them several times
    slower. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def sft_dirs(tmp_path_factory):
    """(student, teacher) directories of tiny SFT'd agents of the default world, built once
    per session for the end-to-end trainer tests (which only read them)."""
    from memopd.env.qa.sft import SFTConfig, run_sft

    out = tmp_path_factory.mktemp("sft")
    tiny = SFTConfig(steps=3, ks=(1, 2), calls_per_k=8)
    run_sft(out, sft_configs={"teacher": tiny, "student": tiny}, jobs=1, progress=False, log=lambda *_: None)
    return str(out / "student"), str(out / "teacher")


# Modules that train, start several processes, build packages or run Triton kernels in
# the interpreter: `pytest tests -m "not slow"` leaves them out for a first check of a
# checkout (the README gives its measured time); the full suite runs them all.
SLOW_MODULES = frozenset({
    "test_actor_loss_triton", "test_aot_matrix", "test_packed_attention_compile", "test_audit_own_samples", "test_backend",
    "test_byo_models", "test_cuda_budget", "test_env_sft", "test_hf_rce",
    "test_checkpoint_safety", "test_compare_resume", "test_examples", "test_fused_distill_triton", "test_gpu_check",
    "test_io_faults", "test_packaging", "test_packed_attention_triton", "test_readme", "test_real_scale",
    "test_replicate", "test_resume_models", "test_run_integrity", "test_sigterm",
    "test_sft_cache_lock", "test_system_faults", "test_train_baseline", "test_trainer_dist",
    "test_trainer_run", "test_served_teacher", "test_benchmark_scripts",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
