"""Programmatic dependent launch (compute capability 9.0+): a kernel launched with the
programmatic-stream-serialization attribute may be scheduled while the kernel before it on the
stream is still running. Its blocks prefetch their weights meanwhile and wait in pdl_wait()
(kernels/common.cuh) for the earlier kernel's results, so the launch gap and the ramp-up of each
kernel of a decode step overlap the tail of the one before. Under stream capture the dependency
becomes a programmatic edge of the graph.

The same launcher sets a thread-block cluster size (sm_90): the blocks of a cluster run at once
and read each other's shared memory (kernels/cluster.cuh; mmqs.cu splits K over them).

CuPy's RawKernel launches take no launch attributes, hence cuLaunchKernelEx through ctypes. Only
kernels that call pdl_wait() before touching activations may be launched with pdl (ops.py says
which); the Python cost of a launch here is a few microseconds more than CuPy's, so the decode
step uses it only while it is being captured."""

from __future__ import annotations

import ctypes
import logging

import numpy as np

log = logging.getLogger(__name__)

_CLUSTER_DIMENSION = 4                     # CUlaunchAttributeID (cuda.h)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Attr(ctypes.Structure):              # CUlaunchAttribute: id, 4 bytes padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):            # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


class LaunchError(RuntimeError):
    pass


class _Launcher:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._name = lib.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._attrs: dict[tuple[bool, int], tuple] = {}

    def _attributes(self, pdl: bool, cluster: int) -> tuple:
        """(array, count) of the launch attributes, made once per combination."""
        got = self._attrs.get((pdl, cluster))
        if got is None:
            items = []
            if pdl:
                a = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
                a.value[0] = 1
                items.append(a)
            if cluster > 1:
                a = _Attr(id=_CLUSTER_DIMENSION)
                a.value[0], a.value[1], a.value[2] = cluster, 1, 1
                items.append(a)
            got = self._attrs[(pdl, cluster)] = ((_Attr * len(items))(*items), len(items))
        return got

    def __call__(self, fn, grid, block, args, shared_mem: int, stream_ptr: int, pdl: bool = True,
                 cluster: int = 1) -> None:
        """Launch fn on the stream; pdl: as a programmatic dependent launch; cluster: blocks per
        thread-block cluster along x (grid[0] a multiple of it)."""
        # kernel parameters: one pointer per argument to its value (copied by the driver at launch)
        vals = [np.asarray(a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[v.ctypes.data for v in vals])
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        attrs, n = self._attributes(pdl, cluster)
        cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem, stream_ptr,
                      ctypes.cast(attrs, ctypes.POINTER(_Attr)), n)
        rc = self._launch(ctypes.byref(cfg), fn.kernel.ptr, params, None)
        if rc:
            name = ctypes.c_char_p()
            self._name(rc, ctypes.byref(name))
            raise LaunchError(f"cuLaunchKernelEx({fn.name}): {(name.value or b'?').decode()} ({rc})")


_launcher: _Launcher | None = None
_checked = False


def launcher() -> _Launcher | None:
    """The programmatic launcher, or None where the driver has no cuLaunchKernelEx (said once)."""
    global _launcher, _checked
    if not _checked:
        _checked = True
        try:
            _launcher = _Launcher()
        except (OSError, AttributeError) as e:
            log.info("programmatic dependent launch unavailable (%s): decode graphs use plain launches", e)
    return _launcher


def clusters_ok(k) -> bool:
    """Thread-block clusters can be launched for the kernels of k (modules.Kernels): compute
    capability 9.0+ and cuLaunchKernelEx."""
    dev = getattr(k, "device", None)
    return dev is not None and int(dev.compute_capability) >= 90 and launcher() is not None
