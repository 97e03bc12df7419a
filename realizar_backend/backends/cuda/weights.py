"""GPU-resident weights: every matrix uploaded once into one arena in its device layout (GGUF's
blocks; Q5_0, Q8_0 and Q6_K regrouped on the GPU, formats/gpu_layout.py), and an index per layer
(device pointers, types, shapes) so the forward pass never formats a name or looks a tensor up in
a dict. Norm weights and biases (tiny) are stored as float32 vectors."""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import cupy
import numpy as np

from ...errors import UnsupportedModelError
from ...formats import ModelFile, Tensor
from ...formats.gpu_layout import REGROUPED
from ...formats.quants import dequantize, row_bytes
from ...progress import progress
from .modules import QTYPES, Kernels
from .ops import ATT_MAXD, WeightRef
from .ops import row_bytes as device_row_bytes

log = logging.getLogger(__name__)

_ALIGN = 256   # every tensor starts 256-byte aligned: the decoders rely on 16-byte loads


@dataclass
class LayerIndex:
    attn_norm: int
    wq: WeightRef
    wk: WeightRef
    wv: WeightRef
    wo: WeightRef
    ffn_norm: int
    w_gate: WeightRef
    w_up: WeightRef
    w_down: WeightRef
    bq: int = 0            # 0 = none (a null pointer for the kernels)
    bk: int = 0
    bv: int = 0
    q_norm: int = 0
    k_norm: int = 0
    post_attn_norm: int = 0
    post_ffn_norm: int = 0
    fused_ffn: bool = True  # gate and up share type and shape: one fused launch
    theta: float = 0.0
    window: int = 0


class DeviceWeights:
    def __init__(self, model: ModelFile, kernels: Kernels):
        self.model = model
        self.kernels = kernels
        self.config = model.config
        self.arena: cupy.ndarray | None = None
        self.vectors: list[cupy.ndarray] = []
        self.layers: list[LayerIndex] = []
        self.total_bytes = 0
        self.max_matrix_elems = 0   # largest layer matrix, for the prefill dequantize buffer
        self._plan: list[tuple[Tensor, int]] = []
        self._check_and_plan()
        self.upload()

    # ------------------------------------------------------------ validation and layout
    def _check_and_plan(self) -> None:
        c, m = self.config, self.model
        if c.head_dim % 32 or c.head_dim > ATT_MAXD:
            raise UnsupportedModelError(m.path, f"head_dim {c.head_dim}: the GPU attention kernel needs a "
                                                f"multiple of 32 up to {ATT_MAXD}")
        if c.rope_dim > c.head_dim or c.rope_dim % 2:
            raise UnsupportedModelError(m.path, f"rope dimension {c.rope_dim} with head_dim {c.head_dim}")
        off = 0
        for name in self._matrix_names():
            t = m.tensor(name)
            info = QTYPES.get(t.qtype)
            if info is None:
                raise UnsupportedModelError(m.path, f"tensor {name}: type {t.type_name} has no GPU kernel")
            if len(t.shape) != 2 or t.shape[1] % info.block:
                raise UnsupportedModelError(m.path, f"tensor {name}: shape {t.shape} is not a matrix of "
                                                    f"whole {t.type_name} blocks")
            if t.nbytes != t.shape[0] * row_bytes(t.qtype, t.shape[1]):
                raise UnsupportedModelError(m.path, f"tensor {name}: {t.nbytes} bytes for shape {t.shape}")
            self._plan.append((t, off))
            off += (t.shape[0] * device_row_bytes(t.qtype, t.shape[1]) + _ALIGN - 1) // _ALIGN * _ALIGN
            if name.startswith("blk."):
                self.max_matrix_elems = max(self.max_matrix_elems, t.shape[0] * t.shape[1])
        self.total_bytes = off

    def _matrix_names(self) -> list[str]:
        names = ["token_embd.weight"]
        if not self.config.tie_embeddings:
            names.append("output.weight")
        for i in range(self.config.n_layers):
            names += [f"blk.{i}.{s}.weight" for s in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                       "ffn_gate", "ffn_up", "ffn_down")]
        return names

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
        refs: dict[str, WeightRef] = {}
        hosts = [(t, off, np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)) for t, off in self._plan]
        runs = _runs(hosts)
        staging = cupy.empty(max(end - start for start, end, _ in runs), dtype=cupy.uint8)
        with progress(f"cuda: uploading {len(self._plan)} weight matrices", total=sum(t.nbytes for t, _ in self._plan),
                      log=log) as advance:
            for start, end, members in runs:
                # the last run's regrouping kernels (on the current stream) are done with the staging
                # buffer before this run's bytes overwrite it
                cupy.cuda.get_current_stream().synchronize()
                staging.data.copy_from_host(ctypes.c_void_p(start), end - start)
                for t, off, host in members:
                    at = host.ctypes.data - start
                    rows, cols = t.shape
                    rb = device_row_bytes(t.qtype, cols)
                    if t.qtype in REGROUPED:
                        # Q5_0 / Q8_0 / Q6_K arrive in GGUF bytes and are regrouped here (repack.cu)
                        total = rows * (cols // 32)
                        self.kernels.repack[t.qtype](((total + 255) // 256,), (256,),
                                                     (staging[at:], np.int32(rows), np.int32(cols),
                                                      self.arena[off:], np.int64(rb)))
                    else:
                        (self.arena.data + off).copy_from_device(staging.data + at, host.size)
                    refs[t.name] = WeightRef(t.name, t.qtype, self.arena.data.ptr + off, rows, cols, rb)
                    advance(host.size)
        self._build_index(refs)
        cupy.cuda.Device().synchronize()
        del staging
        log.info("cuda: weights resident: %.1f MB in %.2f s (%d copies)", self.total_bytes / 1e6,
                 time.perf_counter() - t0, len(runs))

    def _vec(self, name: str, required: bool = True) -> int:
        t = self.model.get(name)
        if t is None:
            if required:
                self.model.tensor(name)  # raises ModelFormatError naming the tensor
            return 0
        arr = cupy.asarray(dequantize(t.data, t.qtype, (int(np.prod(t.shape)),)).astype(np.float32))
        self.vectors.append(arr)
        self.total_bytes += arr.nbytes
        return arr.data.ptr

    def _build_index(self, refs: dict[str, WeightRef]) -> None:
        c = self.config
        self.tok_embd = refs["token_embd.weight"]
        self.output = self.tok_embd if c.tie_embeddings else refs["output.weight"]
        self.output_norm = self._vec("output_norm.weight")
        for i in range(c.n_layers):
            b = f"blk.{i}."
            lw = LayerIndex(
                attn_norm=self._vec(b + "attn_norm.weight"), wq=refs[b + "attn_q.weight"],
                wk=refs[b + "attn_k.weight"], wv=refs[b + "attn_v.weight"], wo=refs[b + "attn_output.weight"],
                ffn_norm=self._vec(b + "ffn_norm.weight"), w_gate=refs[b + "ffn_gate.weight"],
                w_up=refs[b + "ffn_up.weight"], w_down=refs[b + "ffn_down.weight"],
                bq=self._vec(b + "attn_q.bias", False), bk=self._vec(b + "attn_k.bias", False),
                bv=self._vec(b + "attn_v.bias", False),
                q_norm=self._vec(b + "attn_q_norm.weight", False), k_norm=self._vec(b + "attn_k_norm.weight", False),
                post_attn_norm=self._vec(b + "post_attention_norm.weight", False),
                post_ffn_norm=self._vec(b + "post_ffw_norm.weight", False),
                theta=c.layer_rope_theta(i), window=c.sliding_window if c.is_sliding(i) else 0,
            )
            lw.fused_ffn = (lw.w_gate.qtype == lw.w_up.qtype and lw.w_gate.rows == lw.w_up.rows
                            and lw.w_gate.cols == lw.w_up.cols)
            self.layers.append(lw)

    def close(self) -> None:
        self.arena = None
        self.vectors.clear()
        self.layers.clear()


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


def _runs(hosts: list[tuple[Tensor, int, np.ndarray]]) -> list[tuple[int, int, list]]:
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
