"""The split16 prefill on the GPU: the coalesced dequantize kernels (dequant.cu) and the split
kernels (prefill.cu) against NumPy with outputs poisoned (NaN) before the launch, the split GEMM
(cuBLAS on fp16 halves) against float64 beside cuBLAS fp32 SGEMM and single fp16, and whole-model
parity of the split16 steps against the oracle (fp16 KV cache, as the GPU stores it)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.matrices import QTYPES
from support.paging import contiguous_table, contiguous_tables

pytestmark = pytest.mark.gpu

F16, F32, F64 = np.float16, np.float32, np.float64
POISON16 = 0xFFFF       # a NaN in fp16 and in bf16
# every quantized type of the GPU's table: 32-weight blocks, and 256-weight blocks (K-quants, I-quants)
BLOCK32 = [q for q, i in QTYPES.items() if i.blocks and i.block == 32]
KQUANT = [q for q, i in QTYPES.items() if i.block == 256]
FLOATS = [Q.F32, Q.F16, Q.BF16]
# N odd and K = 896 (28 units: no warp of 32 units lines up with a row), 8960 (280 units), rows
# of one unit, float rows no unit size divides
SHAPES = {**{q: [(1, 896), (37, 896), (151, 224), (3, 32)] for q in BLOCK32},
          **{q: [(1, 256), (33, 1536), (7, 8960), (5, 2304)] for q in KQUANT},
          **{q: [(1, 1), (33, 37), (17, 896), (7, 1000)] for q in FLOATS}}
CASES = [(q, n, k) for q, shapes in SHAPES.items() for n, k in shapes]


@pytest.fixture(scope="module")
def kx():
    from realizar_backend.backends.cuda.split16 import load_kernels
    return load_kernels(0)


def _id(c):
    return f"{c[0].name}-{c[1]}x{c[2]}"


def _quant(qtype, N, K, rng):
    from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight
    from realizar_backend.formats.quants import dequantize
    host = random_weight(qtype, N, K, rng)
    w, keep = upload_weight(qtype, host)
    return w, keep, dequantize(host, qtype, (N, K)).astype(F32)


# ------------------------------------------------------------------ dequantize kernels (dequant.cu)
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("pad", [0, 3], ids=["dense", "stride+3"])
def test_dequant_kernels(kernels, rng, case, pad):
    """dequant (fp32) and embed against gguf's dequantize: within one ulp (the decode is exact in
    fp32), and nothing written past a row's K or the last row."""
    import cupy

    from realizar_backend.backends.cuda import ops
    q, n, k = case
    w, keep, ref = _quant(q, n, k, rng)
    os_ = k + pad
    out = cupy.full((n + 1, os_), np.nan, F32)
    ops.dequant(kernels, w, out.data.ptr, os_)
    got = out.get()
    assert np.all(np.isnan(got[:n, k:])) and np.all(np.isnan(got[n:]))
    np.testing.assert_array_max_ulp(got[:n, :k], ref, maxulp=1)
    tok = rng.integers(0, n, 9).astype(np.int32)
    emb = cupy.full((9, os_), np.nan, F32)
    tokd = cupy.asarray(tok)
    ops.embed(kernels, w, tokd.data.ptr, 9, 1.5, emb.data.ptr, os_)
    e = emb.get()
    assert np.all(np.isnan(e[:, k:]))
    np.testing.assert_array_max_ulp(e[:, :k], ref[tok] * F32(1.5), maxulp=1)


# ------------------------------------------------------------------ split kernels (prefill.cu)
SPLIT_SEGS = [(2304, [(Q.Q4_K, 33), (Q.Q4_K, 7), (Q.Q6_K, 7)]),      # q, k, v of a Q4_K_M model
              (896, [(Q.Q5_0, 15), (Q.Q5_0, 2), (Q.Q8_0, 2)]),
              (640, [(Q.Q5_0, 9), (Q.Q4_1, 3)]),
              (8960, [(Q.Q6_K, 5)]),
              (1000, [(Q.F16, 9)]),
              (37, [(Q.F32, 3), (Q.BF16, 2), (Q.F16, 1)]),
              (1536, [(Q.IQ4_XS, 17), (Q.Q3_K, 3), (Q.IQ3_S, 5)]),        # the low-bit types of dynamic mixes
              (2304, [(Q.IQ2_XXS, 9), (Q.IQ2_XS, 4), (Q.IQ2_S, 4)]),
              (2880, [(Q.MXFP4, 11), (Q.IQ4_NL, 3)]),
              (4864, [(Q.Q2_K, 7), (Q.IQ3_XXS, 6), (Q.Q5_K, 2)])]


@pytest.mark.parametrize("K,segs", SPLIT_SEGS, ids=[f"K{k}-" + "+".join(q.name for q, _ in s) for k, s in SPLIT_SEGS])
def test_split_weights(kernels, kx, rng, K, segs):
    """split_weights against gguf's dequantize (within the split's precision), and bit for bit against
    the NumPy twin of the split applied to the device's own decode (dequant.cu: within one ulp of gguf's,
    test_dequant_kernels), so that the twin's emulation of the split itself is exact."""
    import cupy
    from support.split16_twin import LO_SHIFT, weight_rows

    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.split16 import split_weights
    keep, mats, refs, decoded = [], [], [], []
    for q, n in segs:
        w, dev, ref = _quant(q, n, K, rng)
        dq = cupy.full((n, K), np.nan, F32)
        ops.dequant(kernels, w, dq.data.ptr, K)
        keep.append(dev)
        mats.append(w)
        refs.append(ref)
        decoded.append(dq.get())
    W = np.concatenate(refs)
    N = W.shape[0]
    out = cupy.full((N + 1, 2 * K), POISON16, cupy.uint16)
    split_weights(kx, tuple(mats), out.data.ptr)
    got = out.get()
    assert np.all(got[N:] == POISON16)
    lo, hi = got[:N, :K].view(F16).astype(F64), got[:N, K:].view(F16).astype(F64)
    err = np.abs(hi + lo * 2.0 ** -LO_SHIFT - W)
    assert np.all(err <= 2.0 ** -21 * np.abs(W) + 2.0 ** -36)
    twin = weight_rows(np.concatenate(decoded)).view(np.uint16)
    for (q, n), rows in zip(segs, np.split(np.arange(N), np.cumsum([n for _, n in segs])[:-1])):
        same = np.mean(got[rows] == twin[rows])
        print(f"split_weights K={K} {q.name}: {same:.6f} of the halves bit-equal to the twin")
        assert same >= 0.999, f"{q.name}: {same:.6f} of the halves bit-equal to the twin"


@pytest.mark.parametrize("T,K,norm", [(1, 576, True), (5, 640, True), (17, 1536, True), (3, 8960, False),
                                      (4, 1000, True), (2, 37, False)])
def test_norm_split(kx, rng, T, K, norm):
    import cupy
    from support.split16_twin import LO_SHIFT, outlier_rows, split_rows as twin_split

    from realizar_backend.model.math import rms_norm
    from realizar_backend.backends.cuda.split16 import split_rows
    X = np.zeros((T, K + 5), F32)
    X[:, :K] = outlier_rows(max(T, 3), K, rng)[:T]
    w = (1 + 0.5 * rng.standard_normal(K)).astype(F32) if norm else None
    xd, wd = cupy.asarray(X), (cupy.asarray(w) if norm else None)
    out = cupy.full(((T + 1) * 3 * K,), POISON16, cupy.uint16)
    inv = cupy.full(T + 1, np.nan, F32)
    split_rows(kx, xd.data.ptr, K + 5, wd.data.ptr if norm else 0, T, K, 1e-6, out.data.ptr, inv.data.ptr)
    got, iv = out.get(), inv.get()
    assert np.all(got[T * 3 * K:] == POISON16) and np.isnan(iv[T])
    g = got[:T * 3 * K].reshape(T, 3 * K).view(F16)
    iv = iv[:T]
    if not norm:        # no rounding of its own: the twin exactly
        want, winv = twin_split(X[:, :K])
        assert np.array_equal(g.view(np.uint16), want.view(np.uint16)) and np.array_equal(iv, winv)
        return
    v = rms_norm(X[:, :K], w, 1e-6).astype(F64)
    xh2, xh, xl = g[:, :K], g[:, K:2 * K], g[:, 2 * K:]
    assert np.all(np.log2(iv) == np.round(np.log2(iv)))
    mx = np.max(np.abs(xh.astype(F32)), axis=1)
    assert np.all((mx >= 2 ** 14) & (mx <= 2 ** 15))
    assert np.array_equal(xh2, (xh.astype(F32) * F32(2.0 ** -LO_SHIFT)).astype(F16))
    rec = (xh.astype(F64) + xl.astype(F64)) * iv[:, None]
    assert np.max(np.abs(rec - v) / np.max(np.abs(v), axis=1, keepdims=True)) <= 1e-6


@pytest.mark.parametrize("T,F,act", [(1, 8960, 0), (7, 2048, 1), (3, 4864, 0), (2, 40, 1)])
def test_act_split(kx, rng, T, F, act):
    import cupy

    from realizar_backend.model.math import gelu_tanh, silu
    from realizar_backend.backends.cuda.split16 import act_split
    y = (rng.standard_normal((T, 2 * F)) * 3e4).astype(F32)
    y[0, :3] = [4e6, -4e6, 0.0]                  # large activations (x100 after act * u)
    inv_in = np.ldexp(F32(1), rng.integers(-15, -12, T)).astype(F32)
    out = cupy.full(((T + 1) * 3 * F,), POISON16, cupy.uint16)
    inv = cupy.full(T + 1, np.nan, F32)
    # the device copies must stay referenced until the launch: `cupy.asarray(y).data.ptr` hands the
    # block back to CuPy's pool at once, and the next upload (inv_in) may land on y[0, :T]
    yd, ivd = cupy.asarray(y), cupy.asarray(inv_in)
    act_split(kx, yd.data.ptr, F, ivd.data.ptr, act, T, out.data.ptr, inv.data.ptr)
    got, iv = out.get(), inv.get()
    assert np.all(got[T * 3 * F:] == POISON16) and np.isnan(iv[T])
    g = got[:T * 3 * F].reshape(T, 3 * F).view(F16)
    iv = iv[:T]
    gg, uu = y[:, :F] * inv_in[:, None], y[:, F:] * inv_in[:, None]
    a = ((gelu_tanh(gg) if act else silu(gg)) * uu).astype(F64)
    rec = (g[:, F:2 * F].astype(F64) + g[:, 2 * F:].astype(F64)) * iv[:, None]
    assert np.max(np.abs(rec - a) / np.max(np.abs(a), axis=1, keepdims=True)) <= 2e-6


def test_unscale_kernels(kx, rng):
    import cupy

    from realizar_backend.model.math import rms_norm
    from realizar_backend.backends.cuda.split16 import unscale_add, unscale_scatter
    T, n = 9, (1536, 256, 256)
    ys = sum(n)
    y = (rng.standard_normal((T, ys)) * 1e4).astype(F32)
    inv = np.ldexp(F32(1), rng.integers(-16, -10, T)).astype(F32)
    yd, ivd = cupy.asarray(y), cupy.asarray(inv)
    dst = [cupy.full((T + 1, m + 3), np.nan, F32) for m in n]
    bias = [rng.standard_normal(n[0]).astype(F32), None, rng.standard_normal(n[2]).astype(F32)]
    bd = [cupy.asarray(b) if b is not None else None for b in bias]
    unscale_scatter(kx, yd.data.ptr, ys, ivd.data.ptr, T,
                    [(d.data.ptr, m + 3, m, b.data.ptr if b is not None else 0) for d, m, b in zip(dst, n, bd)])
    off = 0
    for d, m, b in zip(dst, n, bias):
        got = d.get()
        want = y[:, off:off + m] * inv[:, None] + (b if b is not None else F32(0))
        assert np.array_equal(got[:T, :m], want) and np.all(np.isnan(got[:, m:])) and np.all(np.isnan(got[T:]))
        off += m
    H = 640
    for post_norm in (False, True):
        x0 = rng.standard_normal((T + 1, H)).astype(F32)
        t = (rng.standard_normal((T, H + 2)) * 1e4).astype(F32)
        w = (1 + 0.3 * rng.standard_normal(H)).astype(F32)
        xd, wd, td = cupy.asarray(x0), cupy.asarray(w), cupy.asarray(t)
        unscale_add(kx, xd.data.ptr, H, td.data.ptr, H + 2, ivd.data.ptr,
                    wd.data.ptr if post_norm else 0, T, H, 1e-6)
        got = xd.get()
        v = t[:, :H] * inv[:, None]
        want = x0[:T] + (rms_norm(v, w, 1e-6) if post_norm else v)
        assert np.array_equal(got[T:], x0[T:])
        if post_norm:
            assert np.max(np.abs(got[:T] - want)) <= 1e-5 * max(1.0, float(np.abs(want).max()))
        else:
            assert np.array_equal(got[:T], want)


def test_paired_rows(kx, rng):
    """The paired layout of steps of few tokens (prefill.cu): norm_split and act_split write each
    token as [xh*2^-12 | xh | 0 | xl], the same halves as the plain row; act_split, unscale_scatter
    and unscale_add read GEMM row pairs as their sum (bit-equal to the plain launch where the
    second row is 0)."""
    import cupy

    from realizar_backend.backends.cuda.split16 import (LAYOUT_PAIRED, act_split, split_rows, unscale_add,
                                                        unscale_scatter)
    T, K, F, H = 5, 1536, 1024, 640
    X = (rng.standard_normal((T, K)) * 3).astype(F32)
    w = (1 + 0.5 * rng.standard_normal(K)).astype(F32)
    xd, wd = cupy.asarray(X), cupy.asarray(w)
    plain, paired = cupy.empty((T, 3 * K), cupy.uint16), cupy.full((T, 4 * K), POISON16, cupy.uint16)
    inv1, inv2 = cupy.empty(T, F32), cupy.empty(T, F32)
    split_rows(kx, xd.data.ptr, K, wd.data.ptr, T, K, 1e-6, plain.data.ptr, inv1.data.ptr)
    split_rows(kx, xd.data.ptr, K, wd.data.ptr, T, K, 1e-6, paired.data.ptr, inv2.data.ptr, layout=LAYOUT_PAIRED)
    a, b = plain.get(), paired.get()
    assert np.array_equal(inv1.get(), inv2.get())
    assert np.array_equal(b[:, :2 * K], a[:, :2 * K]) and np.all(b[:, 2 * K:3 * K] == 0)
    assert np.array_equal(b[:, 3 * K:], a[:, 2 * K:])

    y = (rng.standard_normal((T, 2 * F)) * 3e4).astype(F32)
    inv_in = np.ldexp(F32(1), rng.integers(-15, -12, T)).astype(F32)
    pairs = np.zeros((2 * T, 2 * F), F32)
    pairs[0::2] = y
    yd, pd, ivd = cupy.asarray(y), cupy.asarray(pairs), cupy.asarray(inv_in)
    a1, a2 = cupy.empty((T, 3 * F), cupy.uint16), cupy.full((T, 4 * F), POISON16, cupy.uint16)
    act_split(kx, yd.data.ptr, F, ivd.data.ptr, 0, T, a1.data.ptr, inv1.data.ptr)
    act_split(kx, pd.data.ptr, F, ivd.data.ptr, 0, T, a2.data.ptr, inv2.data.ptr, layout=LAYOUT_PAIRED)
    a, b = a1.get(), a2.get()
    assert np.array_equal(inv1.get(), inv2.get()) and np.array_equal(b[:, :2 * F], a[:, :2 * F])
    assert np.all(b[:, 2 * F:3 * F] == 0) and np.array_equal(b[:, 3 * F:], a[:, 2 * F:])

    n = (512, 128, 128)
    ys = sum(n)
    y = (rng.standard_normal((T, ys)) * 1e4).astype(F32)
    lo = (rng.standard_normal((T, ys)) * 1e-2).astype(F32)
    pairs = np.stack([y, lo], 1).reshape(2 * T, ys)
    pd = cupy.asarray(pairs)
    dst = [cupy.full((T, m), np.nan, F32) for m in n]
    unscale_scatter(kx, pd.data.ptr, ys, ivd.data.ptr, T, [(d.data.ptr, m, m, 0) for d, m in zip(dst, n)],
                    layout=LAYOUT_PAIRED)
    want = (y + lo) * inv_in[:, None]
    assert np.array_equal(np.concatenate([d.get() for d in dst], 1), want)
    x0 = rng.standard_normal((T, H)).astype(F32)
    t = np.stack([y[:, :H], lo[:, :H]], 1).reshape(2 * T, H)
    xd2, td = cupy.asarray(x0), cupy.asarray(t)
    unscale_add(kx, xd2.data.ptr, H, td.data.ptr, H, ivd.data.ptr, 0, T, H, 1e-6, layout=LAYOUT_PAIRED)
    assert np.array_equal(xd2.get(), x0 + (y[:, :H] + lo[:, :H]) * inv_in[:, None])


def test_fp16_rows(kx, kernels, rng):
    """The fp16 precision's rows (prefill.cu LAYOUT_FP16): split_weights with lo off writes each
    weight's high half alone (bit-equal to the split row's, row stride K, nothing past the last
    row); norm_split and act_split write the split row's xh alone with the same 1/s; the unscale
    kernels read the GEMM rows as the split layout's."""
    import cupy

    from realizar_backend.backends.cuda.split16 import (LAYOUT_FP16, act_split, split_rows, split_weights, unscale_add,
                                                        unscale_scatter)
    N, K, F, T = 37, 1536, 1024, 5
    w, keep, _ = _quant(Q.Q4_K, N, K, rng)
    split, f16 = cupy.empty((N, 2 * K), cupy.uint16), cupy.full((N + 1, K), POISON16, cupy.uint16)
    split_weights(kx, (w,), split.data.ptr)
    split_weights(kx, (w,), f16.data.ptr, lo=False)
    a, b = split.get(), f16.get()
    assert np.array_equal(b[:N], a[:, K:]) and np.all(b[N:] == POISON16)

    X = (rng.standard_normal((T, K)) * 3).astype(F32)
    g = (1 + 0.5 * rng.standard_normal(K)).astype(F32)
    xd, gd = cupy.asarray(X), cupy.asarray(g)
    plain, one = cupy.empty((T, 3 * K), cupy.uint16), cupy.full((T + 1, K), POISON16, cupy.uint16)
    inv1, inv2 = cupy.empty(T, F32), cupy.full(T, np.nan, F32)
    split_rows(kx, xd.data.ptr, K, gd.data.ptr, T, K, 1e-6, plain.data.ptr, inv1.data.ptr)
    split_rows(kx, xd.data.ptr, K, gd.data.ptr, T, K, 1e-6, one.data.ptr, inv2.data.ptr, layout=LAYOUT_FP16)
    a, b = plain.get(), one.get()
    assert np.array_equal(inv1.get(), inv2.get())
    assert np.array_equal(b[:T], a[:, K:2 * K]) and np.all(b[T:] == POISON16)

    y = (rng.standard_normal((T, 2 * F)) * 3e4).astype(F32)
    inv_in = np.ldexp(F32(1), rng.integers(-15, -12, T)).astype(F32)
    yd, ivd = cupy.asarray(y), cupy.asarray(inv_in)
    a1, a2 = cupy.empty((T, 3 * F), cupy.uint16), cupy.full((T + 1, F), POISON16, cupy.uint16)
    act_split(kx, yd.data.ptr, F, ivd.data.ptr, 1, T, a1.data.ptr, inv1.data.ptr)
    act_split(kx, yd.data.ptr, F, ivd.data.ptr, 1, T, a2.data.ptr, inv2.data.ptr, layout=LAYOUT_FP16)
    a, b = a1.get(), a2.get()
    assert np.array_equal(inv1.get(), inv2.get())
    assert np.array_equal(b[:T], a[:, F:2 * F]) and np.all(b[T:] == POISON16)

    n = (512, 128, 128)
    ys = sum(n)
    y = (rng.standard_normal((T, ys)) * 1e4).astype(F32)
    yd = cupy.asarray(y)
    dst = [cupy.full((T, m), np.nan, F32) for m in n]
    unscale_scatter(kx, yd.data.ptr, ys, ivd.data.ptr, T, [(d.data.ptr, m, m, 0) for d, m in zip(dst, n)],
                    layout=LAYOUT_FP16)
    assert np.array_equal(np.concatenate([d.get() for d in dst], 1), y * inv_in[:, None])
    H = 640
    x0 = rng.standard_normal((T, H)).astype(F32)
    xd2 = cupy.asarray(x0)
    unscale_add(kx, xd2.data.ptr, H, yd.data.ptr, ys, ivd.data.ptr, 0, T, H, 1e-6, layout=LAYOUT_FP16)
    assert np.array_equal(xd2.get(), x0 + y[:, :H] * inv_in[:, None])


def test_split_calls_match_the_twin():
    from support import split16_twin as twin

    from realizar_backend.backends.cuda import split16 as prefill
    assert prefill.MAIN_K_PER_CALL == twin.MAIN_K_PER_CALL
    for K in (37, 640, 896, 1000, 1536, 2048, 4864, 8960, 14336):
        assert prefill.split_calls(K) == twin.split_calls(K), K


# ------------------------------------------------------------------ the split GEMM (cuBLAS)
GEMMS = [(Q.Q4_K, 2048, 1536, 64), (Q.Q6_K, 1536, 8960, 128), (Q.Q5_0, 2048, 640, 33),
         (Q.Q4_0, 1001, 896, 17), (Q.Q8_0, 640, 2048, 300), (Q.Q4_K, 17920, 1536, 512),
         (Q.IQ4_XS, 3584, 4096, 100), (Q.Q3_K, 1024, 2304, 64), (Q.Q2_K, 777, 1536, 20), (Q.MXFP4, 2880, 2880, 64),
         (Q.IQ2_XXS, 512, 2048, 33), (Q.IQ3_S, 4096, 1536, 128)]


@pytest.mark.parametrize("qtype,N,K,T", GEMMS, ids=lambda v: str(getattr(v, "name", v)))
def test_split_gemm_against_float64(kernels, kx, rng, qtype, N, K, T):
    """The split16 projection (split_weights, split_rows, split_gemm, 1/s) against float64, beside
    cuBLAS fp32 SGEMM and single fp16 on the same data (activations with outlier channels and
    rows 1e4 and 1e-6 times the others): within 4 sqrt(K) 2^-24 (split16_error_bound; the H100
    measured 0.23-0.92 sqrt(K) 2^-24, cuBLAS SGEMM 0.07-0.27), far below fp16's."""
    import cupy
    from support.split16_twin import fma_gemm, outlier_rows, rel, split16_error_bound, split16_matmul

    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.split16 import LAYOUT_FP16, LAYOUT_PAIRED, split_gemm, split_rows, split_weights
    w, keep, W = _quant(qtype, N, K, rng)
    X = outlier_rows(T, K, rng)
    ref = X.astype(F64) @ W.astype(F64).T
    xd = cupy.asarray(X)
    ws = cupy.full((N, 2 * K), POISON16, cupy.uint16)
    x16 = cupy.full((T, 3 * K), POISON16, cupy.uint16)
    inv = cupy.full(T, np.nan, F32)
    y = cupy.full((T, N), np.nan, F32)
    split_weights(kx, (w,), ws.data.ptr)
    split_rows(kx, xd.data.ptr, K, 0, T, K, 1e-6, x16.data.ptr, inv.data.ptr)
    split_gemm(ws.data.ptr, x16.data.ptr, N, K, T, y.data.ptr, N)
    e_split = rel(y.get() * inv.get()[:, None], ref)
    # paired rows (steps of few tokens): one pass over the split weights, the pairs summed after
    xp = cupy.full((T, 4 * K), POISON16, cupy.uint16)
    yp = cupy.full((2 * T, N), np.nan, F32)
    split_rows(kx, xd.data.ptr, K, 0, T, K, 1e-6, xp.data.ptr, inv.data.ptr, layout=LAYOUT_PAIRED)
    split_gemm(ws.data.ptr, xp.data.ptr, N, K, T, yp.data.ptr, N, layout=LAYOUT_PAIRED)
    ypair = yp.get()
    e_paired = rel((ypair[0::2] + ypair[1::2]) * inv.get()[:, None], ref)
    deq = cupy.empty((N, K), F32)
    ops.dequant(kernels, w, deq.data.ptr, K)
    e_sgemm = rel(cupy.matmul(xd, deq.T).get(), ref)                   # cuBLAS fp32 (no TF32)
    # single fp16 inputs (the scaled activations' hi half, the weights rounded), fp32 out
    xh = x16[:, K:2 * K].view(F16).astype(F32)
    e_fp16 = rel(cupy.matmul(xh, deq.astype(F16).astype(F32).T).get() * inv.get()[:, None], ref)
    # fp16 precision (Settings.gemm_precision): fp16 weight rows, fp16 activation rows, one call
    wf = cupy.full((N + 1, K), POISON16, cupy.uint16)
    xf = cupy.full((T, K), POISON16, cupy.uint16)
    yf = cupy.full((T, N), np.nan, F32)
    split_weights(kx, (w,), wf.data.ptr, lo=False)
    assert np.all(wf[N:].get() == POISON16)
    split_rows(kx, xd.data.ptr, K, 0, T, K, 1e-6, xf.data.ptr, inv.data.ptr, layout=LAYOUT_FP16)
    split_gemm(wf.data.ptr, xf.data.ptr, N, K, T, yf.data.ptr, N, layout=LAYOUT_FP16)
    e_f16 = rel(yf.get() * inv.get()[:, None], ref)
    rows = rng.choice(N, min(N, 64), replace=False)
    e_twin = rel(split16_matmul(X[:4], W[rows]), ref[:4, rows]) if K * 3 * 64 <= 2e6 else float("nan")
    sgemm_twin = rel(fma_gemm(X[:4], W[rows]), ref[:4, rows]) if K * 64 <= 2e6 else float("nan")
    print(f"{qtype.name} N={N} K={K} T={T}: split16 {e_split:.2e} (paired {e_paired:.2e})  cuBLAS sgemm {e_sgemm:.2e}  "
          f"fp16 {e_fp16:.2e} (the fp16 precision's launches {e_f16:.2e})"
          f"  (twin, fp32 accumulation, 4 rows: split16 {e_twin:.2e} sgemm {sgemm_twin:.2e})"
          f"  bound {split16_error_bound(K):.2e}")
    # fp32-class: the tensor cores' truncating accumulation grows like sqrt(K); the bound is
    # 4 sqrt(K) 2^-24 (support/split16_twin.py split16_error_bound: 4x the worst constant measured on the
    # H100), which single fp16 fails by 10x or more, and split16 stays far below single fp16
    bound = split16_error_bound(K)
    assert e_split <= bound and e_paired <= bound
    assert e_fp16 > bound and e_split <= e_fp16 / 20
    # the fp16 precision rounds each input once, as the fp16 reference does (within the tensor
    # cores' accumulation on top), and stays at fp16's error: a relative 2^-11 per value
    assert e_f16 <= 1.25 * e_fp16 + bound and e_f16 <= 2.0 ** -9


def test_split_gemm_in_a_cuda_graph(kx, rng):
    """The split16 GEMM calls (cuBLAS through blas.py, which CuPy's binding cannot do while a stream
    captures) captured in a CUDA graph: the replay gives the eager launch's bits, into an output
    poisoned in between, on a down-projection-like shape (K 8,960: four calls, beta = 1 joins)."""
    import cupy

    from realizar_backend.backends.cuda.split16 import split_calls, split_gemm, split_rows, split_weights
    N, K, T = 320, 8960, 24
    w, keep, W = _quant(Q.Q4_K, N, K, rng)
    assert len(split_calls(K)) == 4
    ws = cupy.empty((N, 2 * K), cupy.uint16)
    x16 = cupy.empty((T, 3 * K), cupy.uint16)
    inv = cupy.empty(T, F32)
    split_weights(kx, (w,), ws.data.ptr)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        xd = cupy.asarray(rng.standard_normal((T, K)).astype(F32))
        split_rows(kx, xd.data.ptr, K, 0, T, K, 1e-6, x16.data.ptr, inv.data.ptr)
        y = cupy.full((T, N), np.nan, F32)
        split_gemm(ws.data.ptr, x16.data.ptr, N, K, T, y.data.ptr, N)
        eager = y.get()
        stream.begin_capture()
        split_gemm(ws.data.ptr, x16.data.ptr, N, K, T, y.data.ptr, N)
        graph = stream.end_capture()
        y.fill(np.nan)
        graph.launch()
        replay = y.get()
    assert np.all(np.isfinite(eager))
    assert np.array_equal(eager, replay)


# ------------------------------------------------------------------ whole model
PROMPTS = [[64, 17], [100], [33, 48, 20], [129], [300]]


@pytest.mark.parametrize("precision", ["split", "fp16"])
@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270", "qwen15", "real"])
def test_split16_model_parity(name, precision, rng):
    """Every prompt set, prefill (GEMM path: > 64 tokens per call) and 8 decode steps after it:
    logits cosine against the oracle on every row >= 0.9999 at split precision, >= COS_MIN (the
    bar of every GPU step) at fp16; on the chaotic twins (gemma270, qwen05), the median row as
    close as fp32 gets, or fp16 at that precision (support/parity.py)."""
    from support.parity import CHAOTIC_MEDIAN_FP16, COS_MIN
    from test_model_parity import TWINS, _assert_parity, _backends, _cos, _open, _real_smol

    from realizar_backend.backends.base import PrefillItem
    path = _real_smol() if name == "real" else TWINS / f"{name}.gguf"
    if path is None or not path.exists():
        pytest.skip(f"{name} not on this machine")
    model = _open(path)
    cpu, gpu = _backends(model, slots=3, ctx=320, gemm_precision=precision)
    V = model.config.vocab_size
    rows = []
    for lens in PROMPTS:
        slots = list(range(len(lens)))
        items = [PrefillItem(s, rng.integers(0, V, n).astype(np.int32)) for s, n in zip(slots, lens)]
        lc, lg = cpu.prefill(items), gpu.prefill(items)
        pre = _cos(lc, lg)
        pos = list(lens)
        dec_rows = []
        for _ in range(8):
            tok = [int(t) for t in np.argmax(lc, axis=1)]
            lc, lg = cpu.decode(slots, tok, pos), gpu.decode(slots, tok, pos)
            dec_rows.append(_cos(lc, lg))
            pos = [p + 1 for p in pos]
        for s in slots:
            cpu.release(s)
            gpu.release(s)
            contiguous_table(cpu, s)
            contiguous_table(gpu, s)
        dec_min = min(r.min() for r in dec_rows)
        print(f"{name} {precision} prompts {lens}: prefill cos {' '.join(f'{c:.7f}' for c in pre)}; "
              f"decode min {dec_min:.7f}")
        rows += [pre, *dec_rows]
    gpu.close()
    if precision == "split":
        _assert_parity(name, np.concatenate(rows), 0.9999)
    else:
        _assert_parity(name, np.concatenate(rows), COS_MIN, chaotic_median=CHAOTIC_MEDIAN_FP16)


@pytest.mark.parametrize("precision", ["split", "fp16"])
@pytest.mark.parametrize("name", ["qwen05", "gemma270"])
def test_split_weight_cache_gives_the_same_logits(name, precision, rng):
    """Weights kept from start-up (prefill_weight_cache "on") give the prompt logits of
    dequantizing them in every prefill ("off") bit for bit, at either precision; "off" keeps none.
    (64 tokens: the GEMMs only with the tensor-core prompt steps off: the dispatcher's buckets
    emptied.)"""
    from test_model_parity import TWINS, _open

    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"{name} not on this machine")
    model = _open(path)
    V = model.config.vocab_size
    items = [PrefillItem(0, rng.integers(0, V, 41).astype(np.int32)),
             PrefillItem(1, rng.integers(0, V, 23).astype(np.int32))]
    out = {}
    for cache in ("on", "off"):
        be = contiguous_tables(CUDABackend(model, max_slots=2, max_context=64,
                                           settings=Settings(self_check=False, prefill_weight_cache=cache,
                                                             gemm_precision=precision)))
        be.fwd.dispatcher.buckets = ()
        assert be.fwd.prompt_step(64).family == "split16"
        assert len(be.fwd.split16.kept) == (4 * model.config.n_layers if cache == "on" else 0)
        # a kept weight takes 4 bytes (two fp16 halves, one float32 element) or 2 (one fp16)
        kept = np.float32 if precision == "split" else np.float16
        assert all(k.dtype == kept for k in be.fwd.split16.kept.values())
        out[cache] = be.prefill(items)
        be.close()
    assert np.isfinite(out["on"]).all()
    assert np.array_equal(out["on"], out["off"])

