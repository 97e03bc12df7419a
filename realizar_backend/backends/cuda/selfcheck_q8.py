"""NumPy twins and checks of the 8-bit-activation kernels (mmvq.cu, rms_norm_q8, the attention
epilogue) and of the fp16 prefill path (dequant16, the tensor-core GEMM).

The twin of the activation quantizer is exact (same float32 operations, round half to even), so
a GEMV is checked against float64 W_deq @ x_deq of the very 8-bit values the kernel read; the
quantizer itself is checked element by element (|q d - v| <= d / 2, s = d * sum q).
"""

from __future__ import annotations

import cupy
import numpy as np

from ...formats.quants import dequantize
from ..cpu import gelu_tanh, rms_norm, silu
from . import ops
from .modules import Kernels
from .selfcheck import Paged, _dev, _nan, _poison, random_weight, rel_err, upload_weight


# ------------------------------------------------------------------ twins
def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, K] float32 (K % 32 == 0) -> (q int8 [rows, K], ds float32 [rows, K/32, 2] = (d, d*sum q))."""
    x = np.asarray(x, np.float32)
    rows, K = x.shape
    b = x.reshape(rows, K // 32, 32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    s = (d * q.astype(np.float32).sum(-1)).astype(np.float32)
    return q.reshape(rows, K), np.stack([d, s], -1)


def dequantize_q8(q: np.ndarray, ds: np.ndarray) -> np.ndarray:
    rows, K = q.shape
    return (q.reshape(rows, K // 32, 32).astype(np.float64) * ds[..., 0:1]).reshape(rows, K)


def q8_violation(q: np.ndarray, ds: np.ndarray, v: np.ndarray) -> float:
    """How far GPU 8-bit blocks (q, ds) are from a faithful quantization of the fp32 values v:
    max |q d - v| / (d/2) (<= 1 when right) and the stored sum's error. The slack is fp32's: the
    kernels round 1/d and v (1/d), up to 2^-23 x 127 of d each way, so |q d - v| may pass d/2 by
    ~3e-5 of it (a strict 1e-5 failed about one random start-up check in 600)."""
    rows, K = q.shape
    ds = ds.reshape(rows, K // 32, 2).astype(np.float64)
    d = ds[..., 0]
    err = np.abs(dequantize_q8(q, ds) - v.astype(np.float64)).reshape(rows, K // 32, 32).max(-1)
    bound = np.maximum(0.5 * d * (1 + 1e-4), 1e-30)
    qsum = q.reshape(rows, K // 32, 32).astype(np.float64).sum(-1)
    sum_ratio = np.abs(ds[..., 1] - d * qsum) / (1e-5 * d * 32 * 127 + 1e-30)
    amax = np.abs(v.astype(np.float64)).reshape(rows, K // 32, 32).max(-1)
    if not np.all(np.isfinite(ds)) or not np.all(np.abs(d - amax / 127) <= 1e-6 * amax + 1e-30):
        return float("inf")
    return float(max((err / bound).max(), sum_ratio.max()))


# ------------------------------------------------------------------ checks
def check_mmv_q8(k: Kernels, segs, K: int, nb: int, rng, bias: bool = False, accumulate: bool = False) -> float:
    """segs: [(qtype, rows)], up to three matrices sharing one 8-bit input; max rel. error."""
    x = (rng.standard_normal((nb, K)) * 2).astype(np.float32)
    q, ds = quantize_q8(x)
    xq, xd = _dev(q), _dev(ds)
    xdeq = dequantize_q8(q, ds)
    keep, launch, checks = [], [], []
    for qt, N in segs:
        host = random_weight(qt, N, K, rng)
        w, dev = upload_weight(qt, host)
        b = rng.standard_normal(N).astype(np.float32) if bias else None
        y0 = rng.standard_normal((nb, N)).astype(np.float32)
        y = _dev(y0) if accumulate else _nan((nb, N))
        bd = _dev(b) if bias else None
        keep += [dev, bd, y]
        launch.append((w, 0 if bd is None else bd.data.ptr, y.data.ptr, N))
        ref = xdeq @ dequantize(host, qt, (N, K)).astype(np.float64).T
        if bias:
            ref += b
        if accumulate:
            ref += y0
        checks.append((y, ref))
    ops.mmv_q8(k, launch, K, xq.data.ptr, xd.data.ptr, nb, accumulate)
    return max(rel_err(y.get(), ref) for y, ref in checks)


def check_ffn_q8(k: Kernels, qtype, N: int, K: int, nb: int, act: int, rng) -> tuple[float, float]:
    """(rel. error of the fp32 activation output, 8-bit output violation)."""
    hg, hu = random_weight(qtype, N, K, rng), random_weight(qtype, N, K, rng)
    (wg, kg), (wu, ku) = upload_weight(qtype, hg), upload_weight(qtype, hu)
    x = rng.standard_normal((nb, K)).astype(np.float32)
    q, ds = quantize_q8(x)
    xq, xd = _dev(q), _dev(ds)
    aq = _poison((nb, N), cupy.int8, 99)
    ad, af = _nan((nb, N // 32, 2)), _nan((nb, N))
    ops.ffn_q8(k, wg, wu, xq.data.ptr, xd.data.ptr, nb, act, aq.data.ptr, ad.data.ptr, af.data.ptr)
    x64 = dequantize_q8(q, ds)
    g = x64 @ dequantize(hg, qtype, (N, K)).astype(np.float64).T
    u = x64 @ dequantize(hu, qtype, (N, K)).astype(np.float64).T
    a = af.get()
    return rel_err(a, (gelu_tanh(g) if act else silu(g)) * u), q8_violation(aq.get(), ad.get(), a)


def check_rms_norm_q8(k: Kernels, rows: int, width: int, rng, eps: float = 1e-6) -> tuple[float, float, float]:
    """(fp32 rel. error, fp16 rel. error, 8-bit violation against the kernel's own fp32 output)."""
    x = (rng.standard_normal((rows, width)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    xd_, wd = _dev(x), _dev(w)
    o32, o16 = _nan((rows, width)), _nan((rows, width), np.float16)
    q = _poison((rows, width), cupy.int8, 99)
    ds = _nan((rows, width // 32, 2))
    ops.rms_norm_q8(k, xd_.data.ptr, width, wd.data.ptr, o32.data.ptr, o16.data.ptr, q.data.ptr, ds.data.ptr,
                    rows, width, eps)
    ref = rms_norm(x, w, eps).astype(np.float64)
    got = o32.get()
    return rel_err(got, ref), rel_err(o16.get(), ref), q8_violation(q.get(), ds.get(), got)


def check_attention_outputs(k: Kernels, n: int, H: int, KVH: int, D: int, ctx: int, rng) -> tuple[float, float]:
    """The attention epilogue's extra outputs against its own fp32 output: (fp16 rel. error, 8-bit violation)."""
    n_slots = 2
    kc = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    vc = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    slots = rng.integers(0, n_slots, n).astype(np.int32)
    pos = rng.integers(0, ctx, n).astype(np.int32)
    pg = Paged(kc, vc, rng)
    qd, sd, pd = _dev(q), _dev(slots), _dev(pos)
    out, o16 = _nan((n, H * D)), _nan((n, H * D), np.float16)
    oq, od = _poison((n, H * D), cupy.int8, 99), _nan((n, H * D // 32, 2))
    ops.attention(k, qd.data.ptr, out.data.ptr, pg.kv, sd.data.ptr, pd.data.ptr,
                  H, KVH, D, D ** -0.5, 0, n, oq.data.ptr, od.data.ptr, o16.data.ptr)
    got = out.get()
    return rel_err(o16.get(), got), q8_violation(oq.get(), od.get(), got)


def check_dequant16(k: Kernels, qtype, N: int, K: int, rng) -> float:
    host = random_weight(qtype, N, K, rng)
    w, keep = upload_weight(qtype, host)
    out = _nan((N, K), np.float16)
    ops.dequant16(k, w, out.data.ptr, K)
    err = rel_err(out.get(), dequantize(host, qtype, (N, K)))
    bf = _poison((N, K), cupy.uint16)                # bf16 NaN pattern as poison
    ops.dequant16(k, w, bf.data.ptr, K, bf16=True)
    got = (bf.get().astype(np.uint32) << 16).view(np.float32)
    return max(err, rel_err(got, dequantize(host, qtype, (N, K))) / 4)   # bf16: 8-bit mantissa


def _to_bf16(a: np.ndarray) -> np.ndarray:
    b = a.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def check_gemm(T: int, N: int, K: int, rng, accumulate: bool, dtype: str = "fp16") -> float:
    """The GEMM call (fp16 / bf16 / fp32 in, fp32 out, beta = 1 when accumulating) on
    a strided output. Inputs are drawn exactly representable in the input type, so the only error
    left is the fp32 accumulation."""
    w = rng.standard_normal((N, K)).astype(np.float16).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        w = (_to_bf16(w).astype(np.uint32) << 16).view(np.float32)
        x = (_to_bf16(x).astype(np.uint32) << 16).view(np.float32)
        wd, xd = _dev(_to_bf16(w)), _dev(_to_bf16(x))
    elif dtype == "fp32":
        w, x = rng.standard_normal((N, K)).astype(np.float32), rng.standard_normal((T, K)).astype(np.float32)
        wd, xd = _dev(w), _dev(x)
    else:
        wd, xd = _dev(w.astype(np.float16)), _dev(x.astype(np.float16))
    ys = N + 3                                     # output rows wider than N: ldc is honoured
    y0 = rng.standard_normal((T, ys)).astype(np.float32)
    y = _dev(y0) if accumulate else _nan((T, ys))
    ops.gemm(wd.data.ptr, N, K, xd.data.ptr, K, y.data.ptr, ys, T, accumulate, cupy.cuda.get_current_stream().ptr,
             dtype)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + (y0[:, :N] if accumulate else 0)
    got = y.get()
    tail_ok = np.array_equal(got[:, N:], y0[:, N:]) if accumulate else bool(np.all(np.isnan(got[:, N:])))
    return rel_err(got[:, :N], ref) if tail_ok else float("inf")
