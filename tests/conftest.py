"""Shared test fixtures: a fixed seed by default (random on request, printed so a failure
can be replayed), and one torch thread for the modules that train tiny models."""
import os
import random

import pytest


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
