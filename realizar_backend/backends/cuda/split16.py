"""split16 GEMMs (kernels/prefill.cu and cuBLAS): the dequantized weights on the fp16 tensor cores,
for prompt steps and wide decode steps (the dispatcher's "split16" family), in one of two
precisions (`Settings.gemm_precision`):
- "fp16": weights and activations each rounded to fp16 once, one cuBLAS call a projection,
  s y = xh . Wh (2 bytes a weight);
- "split": each split into two fp16 halves (hi + lo, kernels/prefill.cu says how), at about fp32's
  accuracy, two or more cuBLAS calls over the halves, s y = [xh*2^-12 | xh] . [Wl*2^12 | Wh] + xl . Wh
  (4 bytes a weight, three times the tensor-core work of a long prompt).
s is a per-row power of two (exact) that the epilogue kernels undo together with the biases, the
residual add and the gemma post-norms. Q, K
and V are dequantized and multiplied as one matrix, and so are gate and up. The launch helpers
here are shared by the linear family (linear.py) and the GPU tests, so the tests run the model's
launches."""

from __future__ import annotations

import logging

import numpy as np

from .blas import blas
from .matrices import WeightRef

log = logging.getLogger(__name__)

_U64, _I32, _I64, _F32 = np.uint64, np.int32, np.int64, np.float32
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)
_ONE_P, _ZERO_P = _ONE.ctypes.data, _ZERO.ctypes.data   # host pointers for alpha / beta
CUDA_R_16F, CUDA_R_32F = 2, 0             # cudaDataType_t
CUBLAS_COMPUTE_32F = 68                  # plain fp32 accumulation (the handle's default math mode: no TF32)
OP_N, OP_T = 0, 1
# The tensor cores truncate when they add into the fp32 accumulator, an error that grows with the
# number of k-steps one accumulator sees. The main (hi x hi) term of a long row is therefore split
# over several cuBLAS calls of at most this many k, added with cuBLAS's rounding beta = 1 epilogue
# (tests/kernels/test_split16_twin.py, tensor-core models: the down projection of Qwen2.5-1.5B, K = 8960,
# goes from 2-7x to 1.3-3x the error of fp32 SGEMM). Each call costs a launch and a pass over
# the output, small beside the GEMM at K this long.
MAIN_K_PER_CALL = 4096
SPLIT_GROUP_ALIGN = 64   # call boundaries along K (elements): keeps the 16-byte operand alignment
KERNELS = ("split_weights", "norm_split", "act_split", "unscale_scatter", "unscale_add")
PRECISIONS = ("fp16", "split")
# activation row layouts (prefill.cu LAYOUT_*): split [xh*2^-12 | xh | xl] (3K), paired
# [xh*2^-12 | xh | 0 | xl] (4K: two GEMM rows of 2K, summed on the way out), fp16 [xh] (K)
LAYOUT_SPLIT, LAYOUT_PAIRED, LAYOUT_FP16 = 0, 1, 2
ROW_WIDTH = {LAYOUT_SPLIT: 3, LAYOUT_PAIRED: 4, LAYOUT_FP16: 1}     # fp16 values a row, in K


def weight_bytes(precision: str) -> int:
    """Bytes a weight takes in the split workspace: two fp16 halves, or one."""
    return 4 if precision == "split" else 2


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
# Shared by the linear family and the GPU tests, so the tests run the model's launches.
# kx: the prefill.cu functions by name (load_kernels); pointers are device addresses.
def load_kernels(device_id: int, qtypes=None) -> dict:
    """qtypes: the quant types compiled in (a model's; None: all)."""
    from .modules import load_module
    mod = load_module(device_id, "prefill.cu", qtypes)
    kx = {name: mod.get_function(name) for name in KERNELS}
    for fn in kx.values():
        _ = fn.attributes          # load the module now, not inside a later capture
    return kx


def split_weights(kx: dict, mats: tuple[WeightRef, ...], out: int, lo: bool = True) -> None:
    """Matrices sharing K, dequantized into consecutive rows of out: split rows [Wl*2^12 | Wh] (2K
    fp16 a row), or with lo False fp16 rows [Wh] (K); up to three matrices a launch (a DeltaNet's
    four projections take two)."""
    K = mats[0].cols
    for i in range(0, len(mats), 3):
        part = mats[i:i + 3]
        args: list = []
        for m in part:
            args += [_U64(m.ptr), _I64(m.row_bytes), _I32(m.rows), _I32(int(m.qtype))]
        for _ in range(3 - len(part)):
            args += [_U64(0), _I64(0), _I32(0), _I32(0)]
        units = sum(m.rows for m in part) * ((K + 31) // 32)
        kx["split_weights"](((units + 255) // 256,), (256,), (*args, _I32(K), _U64(out), _I32(int(lo))))
        out += sum(m.rows for m in part) * (4 if lo else 2) * K


def split_rows(kx: dict, x: int, xs: int, w: int, T: int, K: int, eps: float, out: int, inv: int,
               layout: int = LAYOUT_SPLIT) -> None:
    """Rows of x (RMSNorm'ed with weight w, or as they are for w == 0) -> activation rows of out
    in `layout` (row stride ROW_WIDTH[layout] K); inv[:T] = 1/s."""
    kx["norm_split"]((T,), (_threads(K),), (_U64(x), _I32(xs), _U64(w), _I32(T), _I32(K), _F32(eps),
                                            _U64(out), _I32(ROW_WIDTH[layout] * K), _U64(inv), _I32(layout)))


def act_split(kx: dict, y: int, F: int, inv_in: int, act: int, T: int, out: int, inv: int,
              layout: int = LAYOUT_SPLIT) -> None:
    """act(g) * u from the scaled gate|up rows y (stride 2F; inv_in = their 1/s) -> activation rows
    of out in `layout`; the paired layout: y holds row pairs and out gets paired rows."""
    kx["act_split"]((T,), (_threads(F),), (_U64(y), _I32(2 * F), _I32(F), _U64(inv_in), _I32(act), _I32(T),
                                           _U64(out), _I32(ROW_WIDTH[layout] * F), _U64(inv), _I32(layout)))


def unscale_scatter(kx: dict, y: int, ys: int, inv: int, T: int, segs, layout: int = LAYOUT_SPLIT) -> None:
    """Scaled GEMM rows y (the paired layout: row pairs) -> up to three destinations, segs = [(dst,
    dst stride, columns, bias)]."""
    args: list = []
    n = 0
    for d, ds, nc, b in segs:
        args += [_U64(d), _I32(ds), _I32(nc), _U64(b)]
        n += nc
    for _ in range(3 - len(segs)):
        args += [_U64(0), _I32(0), _I32(0), _U64(0)]
    kx["unscale_scatter"]((((n + 255) // 256), T), (256,), (_U64(y), _I32(ys), _U64(inv), _I32(T), *args,
                                                           _I32(layout)))


def unscale_add(kx: dict, x: int, xs: int, t: int, ts: int, inv: int, w: int, T: int, H: int, eps: float,
                layout: int = LAYOUT_SPLIT) -> None:
    """x[:T] += t[:T] * inv (through an RMSNorm with weight w first, for w != 0); the paired layout:
    t holds row pairs."""
    kx["unscale_add"]((T,), (_threads(H),), (_U64(x), _I32(xs), _U64(t), _I32(ts), _U64(inv), _U64(w),
                                             _I32(T), _I32(H), _F32(eps), _I32(layout)))


def split_gemm(w: int, x: int, N: int, K: int, T: int, y: int, ldy: int,
               calls: list[tuple[int, int, int, int]] | None = None, layout: int = LAYOUT_SPLIT) -> None:
    """y[:T, :N] = s x[:T] @ W.T on the current stream, fp32 out (blas.py: a step made of these
    calls can be captured in a CUDA graph). Split layout: split weight rows w (N x 2K fp16) and
    split activation rows x (T x 3K), the cuBLAS calls of split_calls(K); paired: x holds paired
    rows (T x 4K) and y gets 2T rows, xh's products in row 2t and xl's in 2t + 1, from the main
    calls alone; fp16: fp16 weight rows (N x K) and activation rows (T x K), one call."""
    b = blas()
    if layout == LAYOUT_FP16:
        b.gemm_ex(OP_T, OP_N, N, T, K, _ONE_P, w, CUDA_R_16F, K, x, CUDA_R_16F, K, _ZERO_P, y, CUDA_R_32F, ldy,
                  CUBLAS_COMPUTE_32F)
        return
    paired = layout == LAYOUT_PAIRED
    calls = calls or split_calls(K)
    cols, ldx = (2 * T, 2 * K) if paired else (T, 3 * K)
    for wc, xc, kk, beta in (calls[:-1] if paired else calls):
        b.gemm_ex(OP_T, OP_N, N, cols, kk, _ONE_P, w + 2 * wc, CUDA_R_16F, 2 * K, x + 2 * xc, CUDA_R_16F, ldx,
                  _ONE_P if beta else _ZERO_P, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F)
