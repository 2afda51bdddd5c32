"""Shared test fixtures: fresh random seeds (printed, so a failure can be replayed)."""
import os
import random

import pytest


@pytest.fixture
def seed(request):
    """A fresh seed per test; set MEMOPD_TEST_SEED to replay one."""
    s = int(os.environ.get("MEMOPD_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"[seed] {request.node.nodeid}: MEMOPD_TEST_SEED={s}")
    return s
