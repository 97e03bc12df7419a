"""NumPy twin of the split16 prefill GEMM (kernels/prefill.cu, backends/cuda/split16.py).

The twin does the exact arithmetic of the GPU path: the weight and activation splits (fp16
rounding through numpy.float16, powers of two exact), the sequence of cuBLAS calls over the
halves, and the fp32 accumulation under two models: IEEE fp32 (one rounding per product, as fp32
SGEMM does) and the tensor cores (blocks of 16 products added to the accumulator with the terms
aligned to the largest and cut to 24 + `extra` bits, and the result truncated toward zero: what
V100/A100/H100 tensor cores are reported to do; a pessimistic stand-in for the H100's exact rules).
The proof of its error bound against float64 is tests/kernels/test_split16_twin.py; the GPU tests
(tests/gpu/test_prefill_split.py) check the device against it."""

from __future__ import annotations

import numpy as np

F16, F32, F64 = np.float16, np.float32, np.float64
LO_SHIFT = 12                     # weights: W = Wh + Wl * 2^-12 (prefill.cu LO_UP / LO_DOWN)
MAIN_K_PER_CALL = 4096            # backends/cuda/split16.py (the GPU test checks they agree)
ALIGN = 64


# ------------------------------------------------------------------ the splits
def split_weight(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Wh, Wl * 2^12) as fp16: split_weights' two halves of each weight."""
    W = np.asarray(W, F32)
    hi = W.astype(F16)
    lo = ((W - hi.astype(F32)) * F32(2.0 ** LO_SHIFT)).astype(F16)
    return hi, lo


def weight_rows(W: np.ndarray) -> np.ndarray:
    """The split weight workspace: row n = [Wl * 2^12 | Wh] (2K fp16)."""
    hi, lo = split_weight(W)
    return np.concatenate([lo, hi], axis=1)


def row_scale(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(s, 1/s): the power of two that puts each row's max |value| m in [2^14, 2^15)."""
    m = np.asarray(m, F32)
    e = np.zeros(m.shape, np.int64)
    ok = (m > 0) & np.isfinite(m)
    e[ok] = np.frexp(m[ok])[1]
    e = np.maximum(e, -100)
    return np.ldexp(F32(1), 15 - e).astype(F32), np.ldexp(F32(1), e - 15).astype(F32)


def split_rows(V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activation rows V (fp32) -> the split rows [xh * 2^-12 | xh | xl] (3K fp16) of s V, and 1/s."""
    V = np.asarray(V, F32)
    s, inv = row_scale(np.max(np.abs(V), axis=1))
    xs = V * s[:, None]
    xh = xs.astype(F16)
    xl = (xs - xh.astype(F32)).astype(F16)
    xh2 = (xh.astype(F32) * F32(2.0 ** -LO_SHIFT)).astype(F16)
    return np.concatenate([xh2, xh, xl], axis=1), inv


def split_calls(K: int, main_k: int = MAIN_K_PER_CALL) -> list[tuple[int, int, int, int]]:
    """(weight column, activation column, k, beta) of each cuBLAS call: the low halves with the
    first piece of the main term, the other pieces of at most main_k, then xl . Wh."""
    m = max(1, -(-K // main_k))
    cuts = [K + (K * j // m) // ALIGN * ALIGN for j in range(1, m)]
    bounds = [0] + [b for b in cuts if K < b < 2 * K] + [2 * K]
    calls = [(a, a, b - a, int(i > 0)) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return calls + [(K, 2 * K, K, 1)]


# ------------------------------------------------------------------ accumulation models
def fma_gemm(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """A @ B.T with one fp32 FMA per k in order (products exact in float64, one rounding each)."""
    A64, B64 = A.astype(F64), B.astype(F64)
    acc = np.zeros((A.shape[0], B.shape[0]), F32)
    for k in range(A.shape[1]):
        acc = (acc.astype(F64) + np.outer(A64[:, k], B64[:, k])).astype(F32)
    return acc


def _rz32(s: np.ndarray) -> np.ndarray:
    r = s.astype(F32)
    over = np.abs(r.astype(F64)) > np.abs(s)
    r[over] = np.nextafter(r[over], F32(0))
    return r


def tc_gemm(A: np.ndarray, B: np.ndarray, block: int = 16, extra: int = 0) -> np.ndarray:
    """A @ B.T (fp16 inputs) as the tensor-core model: per k-block, the accumulator and the block's
    exact products aligned to the largest exponent and cut (toward zero) to 24 + extra bits,
    summed, and the sum truncated to fp32."""
    A64, B64 = A.astype(F64), B.astype(F64)
    c = np.zeros((A.shape[0], B.shape[0]), F32)
    for k0 in range(0, A.shape[1], block):
        P = A64[:, None, k0:k0 + block] * B64[None, :, k0:k0 + block]
        terms = np.concatenate([c.astype(F64)[..., None], P], axis=-1)
        q = np.ldexp(1.0, np.max(np.frexp(terms)[1], axis=-1, keepdims=True) - 24 - extra)
        c = _rz32(np.sum(np.trunc(terms / q) * q, axis=-1))
    return c


def split_gemm(x16: np.ndarray, w16: np.ndarray, K: int, gemm=fma_gemm, main_k: int = MAIN_K_PER_CALL) -> np.ndarray:
    """s y = the cuBLAS calls of one projection over split rows (x16: T x 3K, w16: N x 2K): each
    call accumulates from zero, and beta = 1 adds the previous result with one fp32 rounding."""
    y = None
    for wc, xc, kk, beta in split_calls(K, main_k):
        part = gemm(x16[:, xc:xc + kk], w16[:, wc:wc + kk]).astype(F64)
        y = part.astype(F32) if not beta else (y.astype(F64) + part).astype(F32)
    return y


def split16_matmul(X: np.ndarray, W: np.ndarray, gemm=fma_gemm, main_k: int = MAIN_K_PER_CALL) -> np.ndarray:
    x16, inv = split_rows(X)
    return split_gemm(x16, weight_rows(W), X.shape[1], gemm, main_k) * inv[:, None]


def fp16_matmul(X: np.ndarray, W: np.ndarray, gemm=fma_gemm) -> np.ndarray:
    """The single-fp16 path ("fp16" prefill) on the same row scaling."""
    x16, inv = split_rows(X)
    K = X.shape[1]
    return gemm(x16[:, K:2 * K], np.asarray(W, F32).astype(F16)) * inv[:, None]


def rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(F64) - ref) / np.linalg.norm(ref))


# The bound on split16's error (rel, against float64) under the tensor cores' truncating
# accumulation, as a function of K. A sum of K terms whose roundings (or truncations) of about one
# unit of 2^-24 of the running sum fall with no common pattern grows like sqrt(K) 2^-24. Measured as
# multiples of sqrt(K) 2^-24: split16 on the H100 0.23-0.92 (tests/gpu/test_prefill_split.py, six
# shapes, K 640-8960), cuBLAS fp32 SGEMM 0.07-0.27, the (pessimistic) tensor-core models of this twin
# 0.4-1.1 (real weights). The bound is 4x that (H100 worst: 4.3x below it).
# Single fp16 inputs err by their own rounding, ~2^-12 per input: 2e-4..4e-4 at any K, 13x or more
# above the bound for K <= 8960 and still 6x at K = 16384, so an fp16-class result cannot pass.
SPLIT16_SQRT_K = 4.0


def split16_error_bound(K: int) -> float:
    """The largest rel error split16 may show against float64 at K inputs per row: 4 sqrt(K) 2^-24."""
    return SPLIT16_SQRT_K * float(np.sqrt(K)) * 2.0 ** -24


# ------------------------------------------------------------------ synthetic data
def outlier_rows(T: int, K: int, rng) -> np.ndarray:
    """Activations with LLM-like outlier channels (x100), one row 1e4 larger than the others and
    a row of tiny values."""
    X = rng.standard_normal((T, K)).astype(F32)
    X[:, rng.choice(K, 4, replace=False)] *= 100
    X[1] *= 1e4
    X[2] *= 1e-6
    return X
