"""Backend selection: `auto` takes CUDA when CuPy sees a GPU, else the NumPy backend, and says in
one line which and why (a GPU whose CuPy is missing is named, with the command that installs it).
Before the CPU backend loads, its memory is checked against what the host has, and its BLAS
threads are set."""

from __future__ import annotations

import logging
import math
import threading

from .. import timeline
from ..errors import BackendError, RealizarError
from ..formats import ModelFile
from ..settings import Settings
from . import host
from .base import GREEDY, Backend, PrefillItem, SampleResult, SampleRow, Step
from .runner import run_step

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    return _cuda_missing() is None


def _cuda_missing() -> str | None:
    """Why CuPy cannot run on a GPU here, in words, or None when it can."""
    try:
        import cupy
    except ImportError:
        driver = host.nvidia_driver()
        if driver is None:
            return "no NVIDIA GPU driver on this machine"
        return f"an NVIDIA GPU is here (driver {driver}) but CuPy is not installed: {host.cupy_extra()}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CuPy without a usable driver or device: its own words
        return f"CuPy cannot reach a GPU: {type(e).__name__}: {e}"
    if n == 0:
        return "CuPy sees no GPU (CUDA_VISIBLE_DEVICES hides them?)"
    return None


def choose_backend(settings: Settings) -> tuple[str, str]:
    """(backend name, why), for the one line a start says; BackendError where the settings ask
    for CUDA and it cannot run."""
    if settings.backend == "cpu":
        return "cpu", "REALIZAR_BACKEND=cpu"
    missing = _cuda_missing()
    if missing is None:
        return "cuda", ("REALIZAR_BACKEND=cuda" if settings.backend == "cuda" else "a CUDA GPU is visible to CuPy")
    if settings.backend == "cuda":
        raise BackendError(f"REALIZAR_BACKEND=cuda, but {missing}")
    return "cpu", missing


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
    name, why = choose_backend(settings)
    if name == "cuda":
        log.info("backend: cuda (%s)", why)
        try:
            from .cuda import CUDABackend
            timeline.mark("cuda backend imported")
            return CUDABackend(model, settings=settings, max_slots=slots, max_context=ctx)
        except RealizarError as e:
            if settings.backend == "cuda":
                raise
            why = f"the CUDA backend cannot serve this model: {e}"
    # said at WARNING where a GPU is here but goes unused, so that a command line shows it too
    gpu_unused = settings.backend != "cpu" and host.nvidia_driver() is not None
    threads = cpu_threads(settings)
    log.log(logging.WARNING if gpu_unused else logging.INFO, "backend: cpu (%s); %d BLAS thread(s)", why, threads)
    blocks = cpu_kv_blocks(model, settings, slots, ctx)
    check_cpu_memory(model, blocks * settings.block_size, slots)
    _limit_blas(threads)
    from .cpu import CPUBackend
    return CPUBackend(model, max_slots=slots, max_context=ctx, block_size=settings.block_size, num_blocks=blocks)


def cpu_threads(settings: Settings) -> int:
    """BLAS threads of the CPU backend: the setting, or one per core this process may run on
    less one, which the server's own work (HTTP, tokenizing, templates) keeps. BLAS threads that
    outnumber the free cores spin while they wait and slow every step."""
    return settings.cpu_threads or max(1, host.cores() - 1)


def _limit_blas(threads: int) -> None:
    """This process's BLAS thread pools (OpenBLAS, MKL: whichever NumPy loaded) to `threads`."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=threads, user_api="blas")


CPU_HEADROOM_BYTES = 256 << 20   # the process beside its weights and KV pool: Python, a step's temporaries


def cpu_memory_bytes(model: ModelFile, kv_tokens: int) -> tuple[int, int]:
    """(weights, KV pool) in bytes as the CPU backend holds them: every weight as float32 (a
    tied output matrix once), K and V as float32 for kv_tokens positions of the layers that keep
    them (a hybrid's recurrent layers keep none)."""
    weights = sum(4 * math.prod(t.shape) for t in model.tensors.values())
    return weights, model.config.kv_bytes_per_token(4) * kv_tokens


def check_cpu_memory(model: ModelFile, kv_tokens: int, slots: int = 1) -> None:
    """BackendError, with the figures, when the CPU backend's weights, KV pool and (a hybrid's)
    recurrent state of `slots` sequences cannot fit in the memory this host has available: said
    at once instead of a MemoryError (or the OOM killer) minutes into the load."""
    avail = host.available_memory()
    weights, kv = cpu_memory_bytes(model, kv_tokens)
    state = slots * model.config.recurrent_state_bytes
    if avail is None or weights + kv + state + CPU_HEADROOM_BYTES <= avail:
        return
    gib = 1 << 30
    raise BackendError(
        f"the CPU backend needs {(weights + kv + state + CPU_HEADROOM_BYTES) / gib:.1f} GiB for this model "
        f"({weights / gib:.1f} GiB of weights as float32, {kv / gib:.1f} GiB of KV cache for {kv_tokens} tokens"
        + (f", {state / gib:.1f} GiB of recurrent state for {slots} sequences" if state else "")
        + f") and {avail / gib:.1f} GiB is available; use a GPU, a smaller model, or fewer KV tokens "
        f"(REALIZAR_KV_CACHE_TOKENS)" + (" or sequences (REALIZAR_MAX_NUM_SEQS)" if state else ""))


CPU_KV_BYTES = 1 << 30   # the CPU's KV pool when kv_cache_tokens leaves it to the backend


def cpu_kv_blocks(model: ModelFile, settings: Settings, slots: int, ctx: int) -> int:
    """Blocks of the CPU backend's KV pool: kv_cache_tokens when set; else what fits in 1 GiB of
    float32 K/V, never less than one full context nor more than every slot at full context."""
    c, bs = model.config, settings.block_size
    if settings.kv_cache_tokens:
        return max(1, settings.kv_cache_tokens // bs)
    per_seq = -(-ctx // bs)
    return min(slots * per_seq, max(per_seq, CPU_KV_BYTES // max(1, c.kv_bytes_per_token(4)) // bs))


__all__ = ["GREEDY", "Backend", "PrefillItem", "SampleResult", "SampleRow", "Step", "choose_backend", "create_backend",
           "cuda_available", "run_step", "start_device"]
