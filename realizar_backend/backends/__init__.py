"""Backend selection: `auto` takes CUDA when CuPy sees a GPU, else the NumPy backend."""

from __future__ import annotations

import logging

from ..errors import BackendError, RealizarError
from ..formats import ModelFile
from ..settings import Settings
from .base import Backend, PrefillItem, SampleResult, SampleRow

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False


def create_backend(model: ModelFile, settings: Settings) -> Backend:
    slots, ctx = settings.kv_slots, settings.context_length
    want = settings.backend
    if want == "auto":
        want = "cuda" if cuda_available() else "cpu"
        if want == "cuda":
            try:
                from .cuda import CUDABackend
                return CUDABackend(model, max_slots=slots, max_context=ctx, settings=settings)
            except RealizarError as e:
                log.warning("CUDA backend unavailable for this model, falling back to CPU: %s", e)
                want = "cpu"
    if want == "cuda":
        if not cuda_available():
            raise BackendError("backend 'cuda' was asked for but no CUDA GPU is visible to CuPy")
        from .cuda import CUDABackend
        return CUDABackend(model, max_slots=slots, max_context=ctx, settings=settings)
    from .cpu import CPUBackend
    return CPUBackend(model, max_slots=slots, max_context=ctx)


__all__ = ["Backend", "PrefillItem", "SampleResult", "SampleRow", "create_backend", "cuda_available"]
