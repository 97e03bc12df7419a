import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """Fresh random inputs for every test; the seed is printed so a failure can be replayed."""
    seed = secrets.randbits(32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def kernels():
    from realizar_backend.backends.cuda.modules import get_kernels
    return get_kernels(0)
