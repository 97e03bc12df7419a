"""Kernel loading: every kernels/*.cu compiled once per process and device with cupy.RawModule,
and one dispatch table per quant type (GGML type -> RawKernel) for each templated family."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import cupy
from gguf import GGMLQuantizationType as Q

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
FILES = ("gemv.cu", "mmvq.cu", "mmvf.cu", "dequant.cu", "norm.cu", "rope.cu", "attention.cu", "elementwise.cu")


MMV_NB = (1, 2, 4, 8)   # activation rows per mmvq launch column (template instances)


@dataclass(frozen=True)
class QInfo:
    suffix: str          # kernel name suffix: gemv_<suffix>
    block: int           # weights per block
    block_bytes: int
    q8: bool = False     # has an integer-dot (8-bit activation) GEMV in mmvq.cu, and the fast
                         # fp32-activation GEMV of mmvf.cu


# The GPU's quant table: every type in the four real models plus the neighbours the design names.
QTYPES: dict[Q, QInfo] = {
    Q.F32: QInfo("f32", 1, 4),
    Q.F16: QInfo("f16", 1, 2),
    Q.BF16: QInfo("bf16", 1, 2),
    Q.Q4_0: QInfo("q4_0", 32, 18, True),
    Q.Q4_1: QInfo("q4_1", 32, 20, True),
    Q.Q5_0: QInfo("q5_0", 32, 22, True),
    Q.Q5_1: QInfo("q5_1", 32, 24, True),
    Q.Q8_0: QInfo("q8_0", 32, 34, True),
    Q.Q4_K: QInfo("q4_k", 256, 144, True),
    Q.Q5_K: QInfo("q5_k", 256, 176, True),
    Q.Q6_K: QInfo("q6_k", 256, 210, True),
}


def _source(name: str) -> str:
    # common.cuh is pasted in rather than #included: CuPy's on-disk kernel cache is keyed by the
    # source text, so an edit to the header must change the key of every file that uses it.
    common = (KERNEL_DIR / "common.cuh").read_text()
    return (KERNEL_DIR / name).read_text().replace('#include "common.cuh"', common)


class Kernels:
    """All RawKernels of one device. Attributes are plain functions; per-type families are dicts
    keyed by GGML type, looked up once at weight-index time, never in the hot loop."""

    def __init__(self, device_id: int):
        dev = cupy.cuda.Device(device_id)
        cc = dev.compute_capability
        opts = ("-std=c++17", f"-DREALIZAR_CC={cc}")
        with dev:
            mods = {f: cupy.RawModule(code=_source(f), options=opts) for f in FILES}
            self.gemv = {q: mods["gemv.cu"].get_function("gemv_" + i.suffix) for q, i in QTYPES.items()}
            self.ffn_gate_up = {q: mods["gemv.cu"].get_function("ffn_gate_up_" + i.suffix) for q, i in QTYPES.items()}
            self.mmv_q8 = {nb: mods["mmvq.cu"].get_function(f"mmv_q8_nb{nb}") for nb in MMV_NB}
            self.ffn_q8 = {nb: mods["mmvq.cu"].get_function(f"ffn_q8_nb{nb}") for nb in MMV_NB}
            self.mmvf = {nb: mods["mmvf.cu"].get_function(f"mmvf_nb{nb}") for nb in MMV_NB}
            self.ffnf = {nb: mods["mmvf.cu"].get_function(f"ffnf_nb{nb}") for nb in MMV_NB}
            self.sm_count = int(dev.attributes["MultiProcessorCount"])
            self.dequant16 = {q: mods["dequant.cu"].get_function("dequant16_" + i.suffix) for q, i in QTYPES.items()}
            self.dequant = {q: mods["dequant.cu"].get_function("dequant_" + i.suffix) for q, i in QTYPES.items()}
            self.embed = {q: mods["dequant.cu"].get_function("embed_" + i.suffix) for q, i in QTYPES.items()}
            self.rms_norm = mods["norm.cu"].get_function("rms_norm")
            self.rms_norm_q8 = mods["norm.cu"].get_function("rms_norm_q8")
            self.f32_to_f16 = mods["elementwise.cu"].get_function("f32_to_f16")
            self.row_scale_f16 = mods["elementwise.cu"].get_function("row_scale_f16")
            self.unscale_rows = mods["elementwise.cu"].get_function("unscale_rows")
            self.spin_ns = mods["elementwise.cu"].get_function("spin_ns")
            self.rope_kv = mods["rope.cu"].get_function("rope_kv")
            self.attn_decode = mods["attention.cu"].get_function("attn_decode")
            self.epilogue = mods["elementwise.cu"].get_function("epilogue")
            self.act_mul = mods["elementwise.cu"].get_function("act_mul")
            self.gather_rows = mods["elementwise.cu"].get_function("gather_rows")
            self.argmax_rows = mods["elementwise.cu"].get_function("argmax_rows")
            self.argmax_unpack = mods["elementwise.cu"].get_function("argmax_unpack")
            # mmvf/ffnf stage activation rows in dynamic shared memory (ops.MMVF_SMEM_MAX)
            for fn in (*self.mmvf.values(), *self.ffnf.values()):
                fn.max_dynamic_shared_size_bytes = 100 * 1024
            # force compilation and module load now, so capture never loads a module
            for fn in (self.rms_norm, self.rope_kv, self.attn_decode, self.epilogue, self.act_mul,
                       self.gather_rows, self.argmax_rows, self.argmax_unpack, self.rms_norm_q8, self.f32_to_f16,
                       *self.mmv_q8.values(), *self.ffn_q8.values(), *self.mmvf.values(), *self.ffnf.values(), *self.dequant16.values(), *self.gemv.values(),
                       *self.ffn_gate_up.values(), *self.dequant.values(), *self.embed.values()):
                _ = fn.attributes
        log.info("cuda kernels: %d files compiled for compute capability %s", len(FILES), cc)


_cache: dict[int, Kernels] = {}
_lock = threading.Lock()
_extra: dict[tuple[int, str], cupy.RawModule] = {}


def load_module(device_id: int, filename: str) -> cupy.RawModule:
    """One more kernels/*.cu file (compiled once per process and device), for kernel families
    that live beside the core table (prefill, sampling). Load every function you will launch
    before any graph capture: a capture must not load a module."""
    with _lock:
        mod = _extra.get((device_id, filename))
        if mod is None:
            dev = cupy.cuda.Device(device_id)
            opts = ("-std=c++17", f"-DREALIZAR_CC={dev.compute_capability}")
            with dev:
                mod = _extra[(device_id, filename)] = cupy.RawModule(code=_source(filename), options=opts)
        return mod


def get_kernels(device_id: int = 0) -> Kernels:
    with _lock:
        k = _cache.get(device_id)
        if k is None:
            k = _cache[device_id] = Kernels(device_id)
        return k
