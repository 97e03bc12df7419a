import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """Fresh random inputs for every test; the seed is printed so that a failure can be replayed
    with REALIZAR_TEST_SEED=<seed> (which fixes it for every test of that run)."""
    seed = int(os.environ.get("REALIZAR_TEST_SEED") or secrets.randbits(32))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def kernels():
    from realizar_backend.backends.cuda.modules import get_kernels
    return get_kernels(0)
