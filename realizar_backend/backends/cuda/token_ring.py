"""Greedy tokens back to the host without a copy per step.

A decode step's last kernel (argmax_unpack / argmax_rows, elementwise.cu feed_next) also stores each
row's token into a small ring of rows in mapped (zero-copy) host memory. The host records an event
after the step and, once it has fired, reads the tokens there. A device-to-host copy after every
graph replay left the GPU idle for a few microseconds between steps; the kernel's own stores through
the bus cost the GPU nothing measurable.

The host numbers the decode steps it enqueues: step k writes ring row k % length, which the decode
inputs carry (io row 3: set by the host for a step with new inputs or by decode_io_merge for a
continuation over another batch, advanced by the step itself for a plain continuation). So any
`length` consecutive steps write distinct rows, whatever their batches, and a step in flight is read
back only when `length` newer ones would overwrite it.
"""

from __future__ import annotations

import ctypes

import cupy
import numpy as np


def _device_pointer(host_ptr: int) -> int:
    """The device address of mapped host memory (the host address itself under unified addressing)."""
    try:
        f = ctypes.CDLL("libcuda.so.1").cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError):
        return host_ptr
    f.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    f.restype = ctypes.c_int
    d = ctypes.c_uint64()
    rc = f(ctypes.byref(d), host_ptr, 0)
    if rc:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed ({rc}): mapped host memory unavailable")
    return d.value


class TokenRing:
    def __init__(self, rows: int, length: int = 4):
        """rows: the decode input rows per step (the row stride, Workspace.dec_io.shape[1])."""
        rt = cupy.cuda.runtime
        self.length = length
        self._mem = cupy.cuda.PinnedMemory(length * rows * 4, rt.hostAllocMapped | rt.hostAllocPortable)
        self.host = np.frombuffer(cupy.cuda.PinnedMemoryPointer(self._mem, 0), np.int32,
                                  length * rows).reshape(length, rows)
        self.host[...] = -1
        self.device_ptr = _device_pointer(self._mem.ptr)
        self._next = 0                  # handles given
        self._steps = 0                 # steps enqueued: the next step writes ring row _steps % length
        # handle -> (event, step number, rows), oldest first
        self._pending: dict[int, tuple[cupy.cuda.Event, int, int]] = {}
        self._done: dict[int, np.ndarray] = {}
        self._events: list[cupy.cuda.Event] = []

    def before_step(self) -> int:
        """Call before enqueueing every decode step (read back or not): first reads back a step in
        flight whose ring row this one will write; returns the ring row the step writes."""
        while self._pending and next(iter(self._pending.values()))[1] + self.length <= self._steps:
            self._resolve(next(iter(self._pending)))
        self._steps += 1
        return (self._steps - 1) % self.length

    def after_step(self, stream: cupy.cuda.Stream, n: int) -> int:
        """Call after enqueueing a step of n rows (the last before_step's); returns its handle."""
        ev = self._events.pop() if self._events else cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        h = self._next
        self._next += 1
        self._pending[h] = (ev, self._steps - 1, n)
        return h

    def tokens(self, handle: int) -> np.ndarray:
        """The step's tokens (waits for it); each handle is read once."""
        if handle in self._pending:
            self._resolve(handle)
        try:
            return self._done.pop(handle)
        except KeyError:
            raise ValueError(f"unknown or already finished decode handle {handle}") from None

    def _resolve(self, handle: int) -> None:
        ev, step, n = self._pending.pop(handle)
        ev.synchronize()
        self._done[handle] = self.host[step % self.length, :n].copy()
        self._events.append(ev)
