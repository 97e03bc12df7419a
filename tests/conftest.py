import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Fresh random inputs for every test; the seed is printed so that a failure can be replayed
    with REALIZAR_TEST_SEED=<seed> (which fixes it for every test of that run)."""
    seed = int(os.environ.get("REALIZAR_TEST_SEED") or secrets.randbits(32))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def smol_path():
    from support.real_models import real_model
    return real_model("smol135")


@pytest.fixture(scope="session")
def smol_model(smol_path):
    from realizar_backend.formats import open_model
    return open_model(smol_path)


@pytest.fixture(scope="module")
def server():
    """The test process's `bentoml serve` of SmolLM2 on the CPU (support.server.shared_server); a
    module that needs a server of its own settings defines its own `server`."""
    from support.server import shared_server
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client of the module's `server`."""
    return server.openai()
