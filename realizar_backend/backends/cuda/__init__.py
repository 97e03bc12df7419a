"""The CUDA backend: CuPy RawKernels over GPU-resident GGUF blocks, with CUDA-graph decode.

CUDABackend is imported on first use, so that the modules that need no CuPy (the dispatcher,
matrices.py) import anywhere."""

from __future__ import annotations

__all__ = ["CUDABackend"]


def __getattr__(name: str):
    if name == "CUDABackend":
        from .backend import CUDABackend
        return CUDABackend
    raise AttributeError(name)
