"""cuBLAS GEMMs that CUDA graphs can capture.

CuPy's cuBLAS binding sets the handle's stream before every call and refuses to do so while the
stream is capturing, so a step with a cuBLAS call could not be graphed (it would run eagerly,
bound by the host's launches). cuBLAS itself supports stream capture
when it allocates nothing meanwhile: this module calls the library CuPy already loaded through
ctypes, on a handle of its own whose workspace is a buffer of ours (cublasSetWorkspace), set again
whenever the stream changes (cublasSetStream resets it)."""

from __future__ import annotations

import ctypes
import logging
import threading

import cupy

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 32 << 20          # cuBLAS's own recommendation for Hopper is 32 MiB
_c = ctypes


class BlasError(RuntimeError):
    pass


def _library_path(prefix: str = "libcublas.so") -> str:
    """The path of the cuBLAS that CuPy loaded into this process (the same library, not a second copy)."""
    from cupy.cuda import device
    device.get_cublas_handle()                     # makes CuPy load it
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(None, 1)[-1]
            if path.rsplit("/", 1)[-1].startswith(prefix):
                return path
    raise BlasError("cuBLAS is not loaded in this process (CuPy's get_cublas_handle loaded no libcublas.so)")


class Blas:
    """One cuBLAS handle with its workspace on the current device; gemm_ex as cublasGemmEx."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        lib = _c.CDLL(_library_path())
        self._create = lib.cublasCreate_v2
        self._create.argtypes = [_c.POINTER(_c.c_void_p)]
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [_c.c_void_p, _c.c_void_p]
        self._set_workspace = lib.cublasSetWorkspace_v2
        self._set_workspace.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_size_t]
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [_c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_void_p,
                               _c.c_void_p, _c.c_int, _c.c_int, _c.c_void_p, _c.c_int, _c.c_int, _c.c_void_p,
                               _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int]
        for f in (self._create, self._set_stream, self._set_workspace, self._gemm):
            f.restype = _c.c_int
        self.handle = _c.c_void_p()
        self._check(self._create(_c.byref(self.handle)), "cublasCreate")
        self.workspace = cupy.empty(workspace_bytes, cupy.uint8)
        self._stream: int | None = None

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise BlasError(f"{what}: cuBLAS status {rc}")

    def _on_stream(self, s: int) -> None:
        if s != self._stream:
            self._check(self._set_stream(self.handle, s), "cublasSetStream")
            self._check(self._set_workspace(self.handle, self.workspace.data.ptr, self.workspace.nbytes),
                        "cublasSetWorkspace")
            self._stream = s

    def gemm_ex(self, transa: int, transb: int, m: int, n: int, k: int, alpha: int, A: int, a_type: int,
                lda: int, B: int, b_type: int, ldb: int, beta: int, C: int, c_type: int, ldc: int,
                compute: int, algo: int = -1, stream: int | None = None) -> None:
        """cublasGemmEx on `stream` (a pointer; None: the current stream), column-major; alpha and
        beta: host pointers."""
        self._on_stream(cupy.cuda.get_current_stream().ptr if stream is None else stream)
        self._check(self._gemm(self.handle, transa, transb, m, n, k, alpha, A, a_type, lda, B, b_type, ldb,
                               beta, C, c_type, ldc, compute, algo), "cublasGemmEx")


_handles: dict[int, Blas] = {}
_lock = threading.Lock()


def blas() -> Blas:
    """The current device's Blas, made on first use."""
    dev = cupy.cuda.Device().id
    with _lock:
        b = _handles.get(dev)
        if b is None:
            b = _handles[dev] = Blas()
            log.debug("cuBLAS handle of our own on device %d (graph-capturable GEMMs)", dev)
        return b
