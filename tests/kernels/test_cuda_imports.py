"""The CUDA backend's modules import and expose what the backend, tools and GPU tests use (runs
wherever CuPy is installed, GPU or not), so a broken import never reaches the device."""

import importlib

import pytest


def test_cuda_modules_import():
    pytest.importorskip("cupy")
    mods = {n: importlib.import_module(f"realizar_backend.backends.cuda.{n}")
            for n in ("modules", "ops", "forward", "linear", "dispatch", "matrices", "split16", "mmq", "flash", "kv_cache",
                      "graphs", "sampling", "backend", "selfcheck", "weights", "workspace")}
    for name in ("get_kernels", "load_module", "Kernels", "QTYPES"):
        assert callable(getattr(mods["modules"], name)) or isinstance(getattr(mods["modules"], name), dict)
    assert callable(mods["backend"].CUDABackend)
