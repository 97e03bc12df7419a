import pytest


@pytest.fixture(scope="session")
def kernels():
    from realizar_backend.backends.cuda.modules import get_kernels
    return get_kernels(0)
