"""The CUDA backend: CuPy RawKernels over GPU-resident GGUF blocks, with CUDA-graph decode."""

from .backend import CUDABackend

__all__ = ["CUDABackend"]
