"""Prefill of many tokens: every matrix of a layer is dequantized into the workspace and
multiplied by cuBLAS (fp32 accumulate and output). Settings.prefill_precision picks the GEMM inputs:

- "split16" (default): fp16 tensor cores at about fp32 accuracy. Weights and activations are each
  split into two fp16 halves (hi + lo, kernels/prefill.cu says how), and a projection is two or
  more cuBLAS calls over the halves: s y = [xh*2^-12 | xh] . [Wl*2^12 | Wh] + xl . Wh, with s a
  per-row power of two (exact) that the epilogue kernels undo together with the biases, the
  residual add and the gemma post-norms. Q, K, V are dequantized and multiplied as one matrix, and
  so are gate and up; per layer: 2 norm/split, 1 attention split, 4 dequantize, 8+ GEMM and 4
  epilogue launches, plus RoPE and attention.
- "fp32": plain SGEMM (no tensor cores), beta = 1 for the residual adds.
- "fp16": fp16 inputs (the down projection's input row-scaled by powers of two, as fp16 cannot
  hold its range): the fastest, but it costs accuracy (see docs/perf-notes.md).

GemmProjections is the prompts' Projections (projections.py): the layer definition itself (norms
around the projections, q/k norm, RoPE and the KV write, attention) is Forward.block, the same for
every step."""

from __future__ import annotations

import logging

import cupy
import numpy as np

from . import ops
from .blas import blas
from .projections import Projections, StepContext
from .weights import LayerIndex, WeightRef

log = logging.getLogger(__name__)

_U64, _I32, _I64, _F32 = np.uint64, np.int32, np.int64, np.float32
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)
_ONE_P, _ZERO_P = _ONE.ctypes.data, _ZERO.ctypes.data   # host pointers for alpha / beta
CUDA_R_16F, CUDA_R_32F = 2, 0             # cudaDataType_t
CUBLAS_COMPUTE_32F = ops.CUBLAS_COMPUTE_32F
OP_N, OP_T = 0, 1
# The tensor cores truncate when they add into the fp32 accumulator, an error that grows with the
# number of k-steps one accumulator sees. The main (hi x hi) term of a long row is therefore split
# over several cuBLAS calls of at most this many k, added with cuBLAS's rounding beta = 1 epilogue
# (tests/test_split16_twin.py, tensor-core models: the down projection of Qwen2.5-1.5B, K = 8960,
# goes from 2-7x to 1.3-3x the error of fp32 SGEMM). Each call costs a launch and a pass over
# the output, small beside the GEMM at K this long.
MAIN_K_PER_CALL = 4096
SPLIT_GROUP_ALIGN = 64   # call boundaries along K (elements): keeps the 16-byte operand alignment
# Steps of up to this many tokens take paired split rows (prefill.cu): the GEMMs of so few rows are
# bound by reading the split weights (4 bytes a weight), which the pairs read once instead of 1.5
# times (the xl . Wh call re-read Wh); past it the GEMMs turn compute-bound and the pairs' extra
# products (0 . Wl) would cost more than they save.
PAIRED_MAX_TOKENS = 128
KERNELS = ("split_weights", "norm_split", "act_split", "unscale_scatter", "unscale_add")


def split_calls(K: int, main_k: int = MAIN_K_PER_CALL) -> list[tuple[int, int, int, int]]:
    """The cuBLAS calls of one split16 projection with K inputs per row, as (weight column,
    activation column, k, beta): weight rows are [Wl*2^12 | Wh] (2K), activation rows
    [xh*2^-12 | xh | xl] (3K). The first call covers the low halves and the first piece of the
    main term, further calls the other pieces, the last one xl . Wh."""
    m = max(1, -(-K // main_k))
    cuts = [K + (K * j // m) // SPLIT_GROUP_ALIGN * SPLIT_GROUP_ALIGN for j in range(1, m)]
    bounds = [0] + [b for b in cuts if K < b < 2 * K] + [2 * K]
    calls = [(a, a, b - a, int(i > 0)) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return calls + [(K, 2 * K, K, 1)]


def _threads(width: int) -> int:
    return 256 if width <= 2048 else (512 if width <= 4096 else 1024)


# ------------------------------------------------------------------ split16 launches (prefill.cu)
# Module-level, shared by GemmProjections and the GPU tests, so the tests run the model's launches.
# kx: the prefill.cu functions by name (load_kernels); pointers are device addresses.
def load_kernels(device_id: int, qtypes=None) -> dict:
    """qtypes: the quant types compiled in (a model's; None: all)."""
    from .modules import load_module
    mod = load_module(device_id, "prefill.cu", qtypes)
    kx = {name: mod.get_function(name) for name in KERNELS}
    for fn in kx.values():
        _ = fn.attributes          # load the module now, not inside a later capture
    return kx


def split_weights(kx: dict, mats: tuple[WeightRef, ...], out: int) -> None:
    """Up to three matrices sharing K, dequantized into consecutive split rows [Wl*2^12 | Wh] of out."""
    K = mats[0].cols
    args: list = []
    for m in mats:
        args += [_U64(m.ptr), _I64(m.row_bytes), _I32(m.rows), _I32(int(m.qtype))]
    for _ in range(3 - len(mats)):
        args += [_U64(0), _I64(0), _I32(0), _I32(0)]
    units = sum(m.rows for m in mats) * ((K + 31) // 32)
    kx["split_weights"](((units + 255) // 256,), (256,), (*args, _I32(K), _U64(out)))


def split_rows(kx: dict, x: int, xs: int, w: int, T: int, K: int, eps: float, out: int, inv: int,
               paired: bool = False) -> None:
    """Rows of x (RMSNorm'ed with weight w, or as they are for w == 0) -> split rows
    [xh*2^-12 | xh | xl] of out (row stride 3K), or paired, [xh*2^-12 | xh | 0 | xl] (4K: two GEMM
    rows of 2K, prefill.cu); inv[:T] = 1/s."""
    kx["norm_split"]((T,), (_threads(K),), (_U64(x), _I32(xs), _U64(w), _I32(T), _I32(K), _F32(eps),
                                            _U64(out), _I32((4 if paired else 3) * K), _U64(inv), _I32(int(paired))))


def act_split(kx: dict, y: int, F: int, inv_in: int, act: int, T: int, out: int, inv: int,
              paired: bool = False) -> None:
    """act(g) * u from the scaled gate|up rows y (stride 2F; inv_in = their 1/s) -> split rows of
    out; paired: y holds row pairs and out gets paired rows."""
    kx["act_split"]((T,), (_threads(F),), (_U64(y), _I32(2 * F), _I32(F), _U64(inv_in), _I32(act), _I32(T),
                                           _U64(out), _I32((4 if paired else 3) * F), _U64(inv), _I32(int(paired))))


def unscale_scatter(kx: dict, y: int, ys: int, inv: int, T: int, segs, paired: bool = False) -> None:
    """Scaled GEMM rows y (paired: row pairs) -> up to three destinations, segs = [(dst, dst stride,
    columns, bias)]."""
    args: list = []
    n = 0
    for d, ds, nc, b in segs:
        args += [_U64(d), _I32(ds), _I32(nc), _U64(b)]
        n += nc
    for _ in range(3 - len(segs)):
        args += [_U64(0), _I32(0), _I32(0), _U64(0)]
    kx["unscale_scatter"]((((n + 255) // 256), T), (256,), (_U64(y), _I32(ys), _U64(inv), _I32(T), *args,
                                                           _I32(int(paired))))


def unscale_add(kx: dict, x: int, xs: int, t: int, ts: int, inv: int, w: int, T: int, H: int, eps: float,
                paired: bool = False) -> None:
    """x[:T] += t[:T] * inv (through an RMSNorm with weight w first, for w != 0); paired: t holds
    row pairs."""
    kx["unscale_add"]((T,), (_threads(H),), (_U64(x), _I32(xs), _U64(t), _I32(ts), _U64(inv), _U64(w),
                                             _I32(T), _I32(H), _F32(eps), _I32(int(paired))))


def split_gemm(w: int, x: int, N: int, K: int, T: int, y: int, ldy: int,
               calls: list[tuple[int, int, int, int]] | None = None, paired: bool = False) -> None:
    """y[:T, :N] = s x[:T] @ W.T from split weight rows w (N x 2K fp16) and split activation rows x
    (T x 3K fp16): the cuBLAS calls of split_calls(K) on the current stream, fp32 out (blas.py: a
    step made of them can be captured in a CUDA graph). paired: x holds paired rows (T x 4K) and
    y gets 2T rows, xh's products in row 2t and xl's in 2t + 1, from the main calls alone."""
    b = blas()
    calls = calls or split_calls(K)
    cols, ldx = (2 * T, 2 * K) if paired else (T, 3 * K)
    for wc, xc, kk, beta in (calls[:-1] if paired else calls):
        b.gemm_ex(OP_T, OP_N, N, cols, kk, _ONE_P, w + 2 * wc, CUDA_R_16F, 2 * K, x + 2 * xc, CUDA_R_16F, ldx,
                  _ONE_P if beta else _ZERO_P, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F)


class GemmProjections(Projections):
    """The GEMM projections of prompts, in Settings.prefill_precision (split16, fp32 or fp16)."""

    def __init__(self, ctx: StepContext, precision: str, weight_cache: str = "off"):
        super().__init__(ctx)
        self.prefill = precision
        # (layer, group) -> that group's split weight rows, kept from start-up (weight_cache)
        self.cached: dict[tuple[int, int], cupy.ndarray] = {}
        if self.prefill == "split16":
            self._init_split(weight_cache)

    # ------------------------------------------------------------ split16
    @staticmethod
    def groups(lw: LayerIndex) -> tuple[tuple[WeightRef, ...], ...]:
        """The matrices that share one split16 projection: q+k+v, o, gate+up, down."""
        return (lw.wq, lw.wk, lw.wv), (lw.wo,), (lw.w_gate, lw.w_up), (lw.w_down,)

    def _init_split(self, weight_cache: str) -> None:
        c, layers = self.ctx.c, self.ctx.w.layers
        for lw in layers:
            ok = (lw.w_gate.rows == lw.w_up.rows == c.ffn_dim and lw.w_gate.cols == lw.w_up.cols == c.hidden
                  and lw.wq.rows == c.q_dim and lw.wk.rows == lw.wv.rows == c.kv_dim)
            if not ok:   # the workspace's split16 scratch is sized from the config
                log.warning("split16 prefill: layer shapes differ from the config; prefill runs in fp32")
                self.prefill = "fp32"
                return
        self.kx = load_kernels(cupy.cuda.Device().id, getattr(self.ctx.k, "qtypes", None))
        # split weights: two fp16 halves per weight, one float32's bytes (per group, or kept for all)
        sizes = [sum(w.rows for w in grp) * grp[0].cols for lw in layers for grp in self.groups(lw)]
        self._calls = {K: split_calls(K) for K in {c.hidden, c.q_dim, c.ffn_dim}}
        total = 4 * sum(sizes)
        free = cupy.cuda.runtime.memGetInfo()[0]
        if weight_cache == "on" or (weight_cache == "auto" and total <= free // 4):
            try:
                for li, lw in enumerate(layers):
                    for gi, grp in enumerate(self.groups(lw)):
                        buf = cupy.empty(sum(w.rows for w in grp) * grp[0].cols, cupy.float32)
                        split_weights(self.kx, grp, buf.data.ptr)
                        self.cached[li, gi] = buf
                cupy.cuda.get_current_stream().synchronize()    # prefills run on the backend's own stream
                log.info("split16 prefill: split weights kept on the device (%.2f GB)", total / 1e9)
                return
            except cupy.cuda.memory.OutOfMemoryError:
                if weight_cache == "on":
                    raise
                self.cached.clear()
                log.warning("split16 prefill: no room for the split weights (%.2f GB); split per prefill",
                            total / 1e9)
        self.ctx.ws.ensure_dequant(max(sizes))    # room for the largest group, split before each GEMM

    def paired(self, T: int) -> bool:
        """A step of T tokens takes paired split rows (prefill.cu): up to PAIRED_MAX_TOKENS, where
        the GEMMs are bound by reading the split weights, and while 2T rows fit the workspace."""
        return T <= PAIRED_MAX_TOKENS and 2 * T <= self.ctx.ws.capacity

    def _split_proj(self, li: int, gi: int, mats: tuple[WeightRef, ...], T: int, y: int, ldy: int) -> None:
        """y[:T] = s x[:T] @ [mats].T (group gi of layer li): the split weights kept since start-up,
        or dequantize-and-split them now; then the GEMM calls."""
        ws = self.ctx.ws
        K = mats[0].cols
        w = self.cached.get((li, gi))
        if w is None:
            split_weights(self.kx, mats, ws.deq.data.ptr)
            w = ws.deq
        split_gemm(w.data.ptr, ws.x16.data.ptr, sum(m.rows for m in mats), K, T, y, ldy, self._calls.get(K),
                   self.paired(T))

    # ------------------------------------------------------------ fp32 / fp16
    def _gemm(self, w: WeightRef, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
              accumulate: bool = False, dtype: str = "fp16") -> None:
        """y[:T] (+)= x[:T] @ w.T (+ bias): dequantize w into the workspace in the GEMM's input type,
        cuBLAS GEMM, fp32 out."""
        k, ws = self.ctx.k, self.ctx.ws
        if dtype == "fp32":
            ops.dequant(k, w, ws.deq.data.ptr, w.cols)
        else:
            ops.dequant16(k, w, ws.deq.data.ptr, w.cols, dtype == "bf16")
        ops.gemm(ws.deq.data.ptr, w.rows, w.cols, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], T,
                 accumulate, cupy.cuda.get_current_stream().ptr, dtype)
        if bias:
            ops.epilogue(k, y.data.ptr, y.data.ptr, bias, T, w.rows, False)

    def _norm_in(self, w: int, T: int) -> cupy.ndarray:
        """RMSNorm(x[:T]) * w as the GEMM input of this precision (ws.h fp32, or ws.h16 fp16)."""
        ws = self.ctx.ws
        if self.prefill == "fp32":
            self.norm(ws.x, w, ws.h, T)
            return ws.h
        if self.ctx.norm16:
            self.norm_q8(ws.x, w, T, None, out16=ws.h16)
        else:
            self.norm(ws.x, w, ws.h, T)
            ops.f32_to_f16(self.ctx.k, ws.h.data.ptr, ws.h16.data.ptr, T * self.ctx.c.hidden)
        return ws.h16

    @property
    def _dt(self) -> str:
        return "fp32" if self.prefill == "fp32" else "fp16"

    # ------------------------------------------------------------ the four calls of a layer
    def attn_outputs(self, li: int) -> tuple[int, int, int]:
        return (0, 0, self.ctx.ws.attn16.data.ptr) if self.prefill == "fp16" else (0, 0, 0)

    def qkv(self, li: int, lw: LayerIndex, T: int) -> None:
        ws, c = self.ctx.ws, self.ctx.c
        if self.prefill == "split16":
            # Q, K and V as one GEMM, then 1/s and the biases on the way out
            inv, pr = ws.split_inv[0].data.ptr, self.paired(T)
            split_rows(self.kx, ws.x.data.ptr, ws.x.shape[1], lw.attn_norm, T, c.hidden, c.rms_eps,
                       ws.x16.data.ptr, inv, pr)
            n = lw.wq.rows + lw.wk.rows + lw.wv.rows
            self._split_proj(li, 0, (lw.wq, lw.wk, lw.wv), T, ws.y32.data.ptr, n)
            unscale_scatter(self.kx, ws.y32.data.ptr, n, inv, T,
                            [(ws.q.data.ptr, ws.q.shape[1], lw.wq.rows, lw.bq),
                             (ws.k.data.ptr, ws.k.shape[1], lw.wk.rows, lw.bk),
                             (ws.v.data.ptr, ws.v.shape[1], lw.wv.rows, lw.bv)], pr)
            return
        h = self._norm_in(lw.attn_norm, T)
        self._gemm(lw.wq, h, T, ws.q, lw.bq, dtype=self._dt)
        self._gemm(lw.wk, h, T, ws.k, lw.bk, dtype=self._dt)
        self._gemm(lw.wv, h, T, ws.v, lw.bv, dtype=self._dt)

    def out(self, li: int, lw: LayerIndex, T: int) -> None:
        ws, c = self.ctx.ws, self.ctx.c
        if self.prefill == "split16":
            inv, pr = ws.split_inv[1].data.ptr, self.paired(T)
            split_rows(self.kx, ws.attn.data.ptr, ws.attn.shape[1], 0, T, lw.wo.cols, c.rms_eps, ws.x16.data.ptr, inv,
                       pr)
            self._split_proj(li, 1, (lw.wo,), T, ws.tmp.data.ptr, ws.tmp.shape[1])
            unscale_add(self.kx, ws.x.data.ptr, ws.x.shape[1], ws.tmp.data.ptr, ws.tmp.shape[1], inv,
                        lw.post_attn_norm, T, c.hidden, c.rms_eps, pr)
            return
        dst, acc = self.dst(lw.post_attn_norm)
        self._gemm(lw.wo, ws.attn if self.prefill == "fp32" else ws.attn16, T, dst, accumulate=acc, dtype=self._dt)
        self.residual(lw.post_attn_norm, T)

    def ffn(self, li: int, lw: LayerIndex, T: int) -> None:
        ws, c, act = self.ctx.ws, self.ctx.c, self.ctx.act
        if self.prefill == "split16":
            # gate and up as one GEMM; act(g) * u is split for the down projection in one pass
            inv_a, inv_b, pr = ws.split_inv[0].data.ptr, ws.split_inv[1].data.ptr, self.paired(T)
            split_rows(self.kx, ws.x.data.ptr, ws.x.shape[1], lw.ffn_norm, T, c.hidden, c.rms_eps, ws.x16.data.ptr,
                       inv_a, pr)
            F = lw.w_gate.rows
            self._split_proj(li, 2, (lw.w_gate, lw.w_up), T, ws.y32.data.ptr, 2 * F)
            act_split(self.kx, ws.y32.data.ptr, F, inv_a, act, T, ws.x16.data.ptr, inv_b, pr)
            return
        h = self._norm_in(lw.ffn_norm, T)
        self._gemm(lw.w_gate, h, T, ws.g, dtype=self._dt)
        self._gemm(lw.w_up, h, T, ws.u, dtype=self._dt)
        ops.act_mul(self.ctx.k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * c.ffn_dim, act)

    def down(self, li: int, lw: LayerIndex, T: int) -> None:
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        H = c.hidden
        if self.prefill == "split16":
            inv = ws.split_inv[1].data.ptr            # act_split's 1/s of the rows in x16
            self._split_proj(li, 3, (lw.w_down,), T, ws.tmp.data.ptr, ws.tmp.shape[1])
            unscale_add(self.kx, ws.x.data.ptr, ws.x.shape[1], ws.tmp.data.ptr, ws.tmp.shape[1], inv,
                        lw.post_ffn_norm, T, H, c.rms_eps, self.paired(T))
            return
        if self.prefill == "fp32":
            dst, acc = self.dst(lw.post_ffn_norm)
            self._gemm(lw.w_down, ws.a, T, dst, accumulate=acc, dtype="fp32")
            self.residual(lw.post_ffn_norm, T)
            return
        # act(g) * u has no bound fp16 can hold: each row goes in scaled by a power of two and
        # comes out unscaled (exact both ways), keeping fp16's mantissa where bf16 would lose 3 bits
        ops.row_scale_f16(k, ws.a.data.ptr, c.ffn_dim, ws.a16.data.ptr, c.ffn_dim, ws.row_inv.data.ptr, T, c.ffn_dim)
        self._gemm(lw.w_down, ws.a16, T, ws.tmp)
        if lw.post_ffn_norm:
            ops.unscale_rows(k, ws.tmp.data.ptr, H, ws.tmp.data.ptr, H, ws.row_inv.data.ptr, T, H, False)
            self.residual(lw.post_ffn_norm, T)
        else:
            ops.unscale_rows(k, ws.x.data.ptr, H, ws.tmp.data.ptr, H, ws.row_inv.data.ptr, T, H, True)
