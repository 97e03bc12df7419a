"""Backend selection: `auto` takes CUDA when CuPy sees a GPU, else the NumPy backend."""

from __future__ import annotations

import logging
import threading

from .. import timeline
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


_started: set[int] = set()
_started_lock = threading.Lock()


def start_device(settings: Settings) -> None:
    """Begin the CUDA start-up (importing CuPy, creating the device's context: ~1 s in a fresh
    process, then loading cuBLAS) on a thread, so it overlaps with reading the model file;
    create_backend then finds it done. Nothing when the settings ask for the CPU backend."""
    if settings.backend not in ("auto", "cuda"):
        return
    with _started_lock:
        if settings.device in _started:      # a server's worker starts it at import already
            return
        _started.add(settings.device)

    def init() -> None:
        try:
            import cupy
            timeline.mark("cupy imported")
            cupy.cuda.runtime.setDevice(settings.device)   # creates the primary context (CUDA 12+)
            cupy.cuda.runtime.free(0)
            timeline.mark("cuda context created")
            # cuBLAS (the self-check and every prompt's GEMMs use it): its libraries are hundreds
            # of MB to load and initialise, done here rather than on the self-check's first GEMM
            from cupy.cuda import device
            device.get_cublas_handle()
            timeline.mark("cublas loaded")
            # the CUDA backend's modules (Python: it holds the GIL), imported here so that the
            # loader finds them ready and its weight upload does not queue behind the tokenizer
            from . import cuda  # noqa: F401
            timeline.mark("cuda backend modules imported")
        except Exception:  # no GPU or no CuPy: create_backend decides, and says so
            pass

    threading.Thread(target=init, name="cuda-init", daemon=True).start()


def context_length(model: ModelFile, settings: Settings) -> int:
    """Positions per sequence: the setting (0: the model's trained context), never past the model's."""
    own = model.config.context_length
    want = settings.context_length or own
    return min(want, own) if own else want


def create_backend(model: ModelFile, settings: Settings) -> Backend:
    slots, ctx = settings.max_num_seqs, context_length(model, settings)
    want = settings.backend
    if want == "auto":
        want = "cuda" if cuda_available() else "cpu"
        if want == "cuda":
            try:
                from .cuda import CUDABackend
                timeline.mark("cuda backend imported")
                return CUDABackend(model, settings=settings, max_slots=slots, max_context=ctx)
            except RealizarError as e:
                log.warning("CUDA backend unavailable for this model, falling back to CPU: %s", e)
                want = "cpu"
    if want == "cuda":
        if not cuda_available():
            raise BackendError("backend 'cuda' was asked for but no CUDA GPU is visible to CuPy")
        from .cuda import CUDABackend
        timeline.mark("cuda backend imported")
        return CUDABackend(model, settings=settings, max_slots=slots, max_context=ctx)
    from .cpu import CPUBackend
    return CPUBackend(model, max_slots=slots, max_context=ctx, block_size=settings.block_size,
                      num_blocks=cpu_kv_blocks(model, settings, slots, ctx))


CPU_KV_BYTES = 1 << 30   # the CPU's KV pool when kv_cache_tokens leaves it to the backend


def cpu_kv_blocks(model: ModelFile, settings: Settings, slots: int, ctx: int) -> int:
    """Blocks of the CPU backend's KV pool: kv_cache_tokens when set; else what fits in 1 GiB of
    float32 K/V, never less than one full context nor more than every slot at full context."""
    c, bs = model.config, settings.block_size
    if settings.kv_cache_tokens:
        return max(1, settings.kv_cache_tokens // bs)
    per_seq = -(-ctx // bs)
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    return min(slots * per_seq, max(per_seq, CPU_KV_BYTES // per_token // bs))


__all__ = ["Backend", "PrefillItem", "SampleResult", "SampleRow", "create_backend", "cuda_available", "start_device"]
