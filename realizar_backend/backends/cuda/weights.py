"""GPU-resident weights: the model definition (model/families.py) built with device weights. Every
matrix it asks for is uploaded once into one arena in its device layout (GGUF's blocks; Q5_0, Q8_0,
Q6_K and MXFP4 regrouped on the GPU, formats/gpu_layout.py) and stands in the model as a WeightRef
(device pointer, type, shape), so a step never formats a name or looks a tensor up in a dict. A
stack of experts' matrices (ffn_*_exps) goes up as one matrix of all their rows, with its expert
count in the WeightRef. Norm weights and biases (tiny) are float32 vectors, in the model as device pointers."""

from __future__ import annotations

import ctypes
import logging
import time

import cupy
import numpy as np

from ...formats import ModelFile, Tensor
from ...formats.gpu_layout import REGROUPED
from ...formats.quants import dequantize
from ...model.families import build_model
from ...progress import progress
from .matrices import check_matrix
from .modules import Kernels
from .ops import WeightRef
from .ops import row_bytes as device_row_bytes

log = logging.getLogger(__name__)

_ALIGN = 256   # every tensor starts 256-byte aligned: the decoders rely on 16-byte loads


class DeviceWeights:
    """The model's loader (model/transformer.py Loader) on the GPU: matrix() plans a matrix's place in the
    arena and returns its WeightRef, whose pointer upload() fills; vector() uploads a vector."""

    def __init__(self, model: ModelFile, kernels: Kernels):
        self.file = model
        self.kernels = kernels
        self.config = c = model.config
        self.arena: cupy.ndarray | None = None
        self.vectors: list[cupy.ndarray] = []
        self.total_bytes = 0
        self.max_matrix_elems = 0   # largest layer matrix, for the split16 dequantize buffer
        self._plan: list[tuple[Tensor, int, WeightRef]] = []
        self.model = build_model(c, self)
        self.upload()

    # ------------------------------------------------------------ the model's loader
    def matrix(self, name: str) -> WeightRef:
        """A matrix, or a stack of experts' matrices [experts, rows, cols] (its experts * rows rows
        placed and regrouped as one matrix's, so expert e's rows start e * rows rows in)."""
        t = self.file.tensor(name)
        check_matrix(self.file.path, name, t.qtype, t.shape, t.nbytes)
        experts, rows, cols = (0, *t.shape) if len(t.shape) == 2 else t.shape
        rb = device_row_bytes(t.qtype, cols)
        ref = WeightRef(name, t.qtype, 0, rows, cols, rb, experts)     # the pointer: once uploaded
        self._plan.append((t, self.total_bytes, ref))
        self.total_bytes += (max(experts, 1) * rows * rb + _ALIGN - 1) // _ALIGN * _ALIGN
        if name.startswith("blk.") and not experts:
            # the split16 prompt steps' dequantize buffer holds one layer matrix; experts never go there
            self.max_matrix_elems = max(self.max_matrix_elems, rows * cols)
        return ref

    def vector(self, name: str) -> int:
        t = self.file.tensor(name)           # raises ModelFormatError naming a missing tensor
        arr = cupy.asarray(dequantize(t.data, t.qtype, (int(np.prod(t.shape)),)).astype(np.float32))
        self.vectors.append(arr)
        return arr.data.ptr

    def has(self, name: str) -> bool:
        return self.file.get(name) is not None

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def output(self) -> WeightRef:
        return self.model.output

    # ------------------------------------------------------------ upload (idempotent)
    def upload(self) -> None:
        """Every matrix into the arena. The host bytes go up in a few long copies (runs of
        matrices adjacent in the file, _runs), each then placed or regrouped on the GPU: a copy
        from pageable memory releases the GIL for its whole length, which the tokenizer, built on
        another thread meanwhile, can use; one copy per matrix would hand the GIL back and forth
        hundreds of times."""
        if self.arena is not None:
            return
        t0 = time.perf_counter()
        self.arena = cupy.empty(self.total_bytes, dtype=cupy.uint8)
        hosts = [(t, off, np.ascontiguousarray(t.data).reshape(-1).view(np.uint8), ref) for t, off, ref in self._plan]
        runs = _runs(hosts)
        staging = cupy.empty(max(end - start for start, end, _ in runs), dtype=cupy.uint8)
        with progress(f"cuda: uploading {len(self._plan)} weight matrices", total=sum(t.nbytes for t, _, _ in self._plan),
                      log=log) as advance:
            for start, end, members in runs:
                # the last run's regrouping kernels (on the current stream) are done with the staging
                # buffer before this run's bytes overwrite it
                cupy.cuda.get_current_stream().synchronize()
                staging.data.copy_from_host(ctypes.c_void_p(start), end - start)
                for t, off, host, ref in members:
                    at = host.ctypes.data - start
                    rows, cols = max(ref.experts, 1) * ref.rows, ref.cols     # a stack of experts: all their rows
                    if t.qtype in REGROUPED:
                        # the REGROUPED types arrive in GGUF bytes and are regrouped here (repack.cu)
                        total = rows * (cols // 32)
                        self.kernels.repack[t.qtype](((total + 255) // 256,), (256,),
                                                     (staging[at:], np.int32(rows), np.int32(cols),
                                                      self.arena[off:], np.int64(ref.row_bytes)))
                    else:
                        (self.arena.data + off).copy_from_device(staging.data + at, host.size)
                    ref.ptr = self.arena.data.ptr + off
                    advance(host.size)
        cupy.cuda.Device().synchronize()
        del staging
        self.total_bytes += sum(v.nbytes for v in self.vectors)
        log.info("cuda: weights resident: %.1f MB in %.2f s (%d copies)", self.total_bytes / 1e6,
                 time.perf_counter() - t0, len(runs))

    def close(self) -> None:
        self.arena = None
        self.vectors.clear()


RUN_BYTES = 256 << 20   # a host-to-device copy covers up to this much (more only for one larger matrix)
RUN_GAP = 4 << 20       # and bridges at most this much between two matrices of one buffer (the norm
                        # vectors between them in the file)


def _root(a: np.ndarray):
    """The object that owns an array's memory (the model file's mmap for the matrices a file
    holds as they are)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    owner = a if a.base is None else a.base
    return owner.obj if isinstance(owner, memoryview) else owner     # np.frombuffer(mmap): a memoryview of it


def _runs(hosts: list[tuple[Tensor, int, np.ndarray, WeightRef]]) -> list[tuple[int, int, list]]:
    """The matrices' host bytes as runs to copy whole: (start address, end address, members in
    address order). A run spans at most RUN_BYTES unless one matrix alone is larger; it bridges
    a gap of at most RUN_GAP, and only inside one buffer (what lies between rides along unused)."""
    runs: list[list] = []
    for item in sorted(hosts, key=lambda h: h[2].ctypes.data):
        host = item[2]
        a, b, root = host.ctypes.data, host.ctypes.data + host.size, _root(host)
        if runs:
            run = runs[-1]
            gap = a - run[1]
            if (gap <= 0 or gap <= RUN_GAP and root is run[3]) and max(b, run[1]) - run[0] <= RUN_BYTES:
                run[1] = max(b, run[1])
                run[2].append(item)
                continue
        runs.append([a, b, [item], root])
    return [(start, end, members) for start, end, members, _ in runs]
