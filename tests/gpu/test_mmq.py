"""The batched-decode tensor-core kernels (kernels/mmq.cu, backends/cuda/mmq.py) against float64
NumPy (gguf's dequantize of the same blocks) on fresh random inputs, beside the fp32 GEMV (mmvf.cu)
on the same data: every type in its device layout, M from 1 to 256 (every token-tile width, several
token tiles, partial ones), K = 896 .. 20608 (partial last chunks, long rows split over CTAs), odd
row counts, the LM head's 151936 rows with its fused argmax, Q/K/V segments of mixed types with
biases, the residual add, the fused FFN, the folded RMSNorm, activations from 1e-6 to 1e4, every
output poisoned (NaN) before the launch and the row tails checked untouched, forced K splits,
determinism, CUDA-graph capture and programmatic dependent launch. The 8-bit-activation variant
(MmqPrep(..., a8=True): mmq.cu built with MMQ_A8) through the same launches against W @ its quantized
activations (selfcheck's twin of mmv8.cu's, the same scheme).

Errors are in units of sum |w x| (selfcheck.dot_err, the fp32 GEMV's measure), taken per token row
(the worst row counts); the bound is the fp32 GEMV tests' own (test_kernels_f32.py FP32_TOL). tests/kernels/test_mmq_emu.py runs the same
kernel code on the CPU."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.dispatch import MMQ8_TYPES, MMQ_TYPES, MMQS_TYPES
from realizar_backend.backends.cuda.matrices import QTYPES

pytestmark = pytest.mark.gpu

FP32_TOL = 2e-5
# every type of the dispatcher's tensor-core rows (mmq.cu; mmqs.cu), and those of 256-weight blocks
TYPES = sorted(MMQ_TYPES)
SMALL = sorted(MMQS_TYPES)
KQUANT = tuple(q for q in TYPES if QTYPES[q].block == 256)
MS = [1, 2, 3, 8, 13, 16, 17, 64, 100, 256]
A8 = sorted(MMQ8_TYPES)             # the 8-bit variant's types
# the 8-bit variant with the folded norm: its float32 rounding may put an activation on the other side
# of a half step from the twin's, an error of d |w| (d ~ 3 sigma / 127) against sum |w x| ~ 0.8 K sigma
# |w| (test_kernels_f32.py Q8_NORM_TOL, the same bound for mmv8.cu)
A8_NORM_TOL = 2e-4
KERNEL = Path(__file__).resolve().parents[2] / "realizar_backend" / "kernels" / "mmq.cu"


@pytest.fixture(scope="module")
def k(kernels):
    """The kernels, with mmq's modules compiled side by side before the first test (first use
    compiles them one at a time otherwise)."""
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda key: kernels.mmq[key], [8, 16, 32, 64, "prep"]))
        ex.submit(lambda: kernels.mmqs[8])
    return kernels


@pytest.fixture(scope="module")
def bufs(k):
    from realizar_backend.backends.cuda.mmq import MmqPrep, MmqScratch
    return MmqPrep(256, 20608), MmqScratch(64 << 20, 1 << 16)


@pytest.fixture(scope="module")
def k8(kernels):
    """The kernels, with the 8-bit variant's modules compiled side by side first."""
    with ThreadPoolExecutor(5) as ex:
        list(ex.map(lambda key: kernels.mmq8[key], [8, 16, 32, 64, "prep"]))
    return kernels


@pytest.fixture(scope="module")
def bufs8(k8):
    """A prep buffer of int8 records (it selects the 8-bit variant) and a scratch of its own."""
    from realizar_backend.backends.cuda.mmq import MmqPrep, MmqScratch
    return MmqPrep(256, 20608, a8=True), MmqScratch(64 << 20, 1 << 16)


def _poison(shape):
    import cupy
    a = cupy.empty(shape, cupy.float32)
    cupy.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, cupy.cuda.get_current_stream().ptr)
    return a


def _dev(a):
    import cupy
    return cupy.asarray(np.ascontiguousarray(a))


def _weight(qt, N, K, rng):
    from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight
    from realizar_backend.formats.quants import dequantize
    host = random_weight(qt, N, K, rng)
    w, keep = upload_weight(qt, host)
    return w, keep, dequantize(host, qt, (N, K)).astype(np.float64)


def _x(rng, M, K, stress=False, pad=4):
    x = rng.standard_normal((M, K + pad)) * rng.uniform(0.1, 30.0, (M, 1))
    if stress:   # outlier channels, and rows spread over ten decades (the down projection's input)
        x[:, rng.choice(K, 4, replace=False)] *= 300
        x *= 10.0 ** rng.uniform(-6, 4, (M, 1))
        x[0, : K // 2] *= 1e-5
    return x.astype(np.float32)


def _rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6) * w.astype(np.float64)


def _q8(x, nw=None):
    """The activations the 8-bit variant multiplies, as float64 (selfcheck's twin of mmv8.cu's: the
    same quantization, the folded norm rounded as the kernels round it)."""
    from realizar_backend.backends.cuda.selfcheck import _q8_input
    return _q8_input(np.ascontiguousarray(x, np.float32), nw, 1e-6)


def _on(request, a8: bool):
    """(kernels, (prep, scratch)) of a variant: fp16 records (k, bufs) or int8 ones (k8, bufs8)."""
    names = ("k8", "bufs8") if a8 else ("k", "bufs")
    return tuple(request.getfixturevalue(n) for n in names)


def _h(x, nw=None, a8=False):
    """The activations a variant multiplies, float64: x (RMSNorm'ed with nw), or as the 8-bit
    variant quantizes them."""
    if a8:
        return _q8(x, nw)
    return _rms(x, nw) if nw is not None else x.astype(np.float64)


def _tol(a8: bool, norm: bool) -> float:
    return A8_NORM_TOL if a8 and norm else FP32_TOL


def _variants(types):
    """pytest params (qtype, a8): every type on the fp16 variant, the 8-bit variant's on it too."""
    return ([pytest.param(q, False, id=q.name) for q in types]
            + [pytest.param(q, True, id=f"{q.name}-8bit") for q in types if q in MMQ8_TYPES])


def _err(got, ref, scale):
    """The worst token row's error in units of its sum |w x| (selfcheck.dot_err per row): rows of
    1e-6 and of 1e4 are each held to fp32 accuracy. inf if an output is not finite."""
    from realizar_backend.backends.cuda.selfcheck import dot_err
    got = np.asarray(got)
    return max(dot_err(got[t:t + 1], ref[t:t + 1], scale[t:t + 1]) for t in range(got.shape[0]))


def run_mmq(k, bufs, segs, K, xd, xs, M, *, bias=False, accumulate=False, norm=None, amax=0, splits=None,
            rng=None, pdl=False):
    """Launch prep + mmq over segs [(WeightRef, W64)] into fresh outputs of row stride rows + 3;
    returns [(output, y0, bias)] per segment."""
    from realizar_backend.backends.cuda import mmq
    prep, scratch = bufs
    launch, outs = [], []
    for w, _ in segs:
        ys = w.rows + 3
        b = rng.standard_normal(w.rows).astype(np.float32) if bias else None
        y0 = rng.standard_normal((M, ys)).astype(np.float32) if accumulate else None
        y = _dev(y0) if accumulate else _poison((M, ys))
        bd = _dev(b) if bias else None
        outs.append((y, y0, b, bd))
        launch.append((w, bd.data.ptr if bias else 0, y.data.ptr, ys))
    mmq.prep(k, xd.data.ptr, xs, M, K, prep, norm=norm, pdl=pdl)
    mmq.mmq(k, launch, K, prep, M, scratch, accumulate=accumulate, amax=amax, splits=splits, pdl=pdl)
    return outs


def check_outputs(segs, outs, h64, M):
    """Max error over segments, or inf when an output is missing or a row tail was written."""
    errs = []
    for (w, W64), (y, y0, b, _) in zip(segs, outs):
        got = y.get()
        n = w.rows
        ref, scale = h64 @ W64.T, np.abs(h64) @ np.abs(W64).T
        if b is not None:
            ref, scale = ref + b, scale + np.abs(b)
        if y0 is not None:
            ref, scale = ref + y0[:, :n], scale + np.abs(y0[:, :n])
        tail_ok = np.array_equal(got[:, n:], y0[:, n:]) if y0 is not None else bool(np.all(np.isnan(got[:, n:])))
        errs.append(_err(got[:, :n], ref, scale) if tail_ok else float("inf"))
    return max(errs)


def mmvf_err(k, w, W64, xd, xs, M, K, h64):
    """The fp32 GEMV on the same input: its error is what fp32-class means here."""
    from realizar_backend.backends.cuda import ops
    y = _poison((M, w.rows))
    ops.mmvf(k, [(w, 0, y.data.ptr, w.rows)], K, xd.data.ptr, xs, M)
    return _err(y.get(), h64 @ W64.T, np.abs(h64) @ np.abs(W64).T)


# ------------------------------------------------------------------ plumbing
def _variant(src: str, a8: bool) -> tuple[dict, str]:
    """kernels/mmq.cu as one variant compiles it: its MMQ_ #defines evaluated, and the lines kept by
    its `#if MMQ_A8` / `#else` / `#endif` blocks (other conditionals keep every branch)."""
    stack, lines = [], []
    for line in src.splitlines():
        t = line.strip()
        if t.startswith("#if"):
            stack.append({"#if MMQ_A8": a8, "#if !MMQ_A8": not a8}.get(t))
        elif t.startswith("#else") and stack and stack[-1] is not None:
            stack[-1] = not stack[-1]
        elif t.startswith("#endif"):
            stack.pop()
        elif all(v is None or v for v in stack):
            lines.append(line)
    text = "\n".join(lines)
    d: dict = {}
    for name, expr in re.findall(r"^#define (MMQ_\w+) ([\w()+* ]+?)\s*(?://.*)?$", text, re.M):
        d[name] = eval(expr, {}, dict(d))       # numbers and the defines before it
    return d, text


def test_host_constants_match_the_kernel():
    """mmq.py and modules.py restate kernels/mmq.cu's tile constants (of both variants); they must agree."""
    from realizar_backend.backends.cuda import mmq
    from realizar_backend.backends.cuda.modules import MMQ_BN, mmq_smem_bytes
    src = KERNEL.read_text()
    small = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (MMQS_\w+) (\d+)",
                                                              KERNEL.with_name("mmqs.cu").read_text(), re.M)}
    assert (small["MMQS_MAXW"], small["MMQS_REC"]) == (mmq.SMALL_MAX_WARPS, mmq.REC)
    for a8 in (False, True):
        d, text = _variant(src, a8)
        assert (d["MMQ_THREADS"], d["MMQ_BM"], d["MMQ_KC"], d["MMQ_REC"]) == \
            (mmq.THREADS, mmq.BM, mmq.KC, mmq.REC8 if a8 else mmq.REC)
        assert d["MMQ_PREP_THREADS"] == mmq.PREP_THREADS
        assert mmq.prep_row_bytes(300, a8) == 3 * d["MMQ_REC"]
        cfg = {int(b): (int(mt), int(nt), int(dd)) for b, mt, nt, dd in
               re.findall(r"struct MmqCfg<(\d+)> \{ static constexpr int MT = (\d+), NT = (\d+), WM = \d+, D = (\d+)",
                          text)}
        assert sorted(cfg) == list(MMQ_BN)
        for bn, (mt, nt, depth) in cfg.items():
            assert mmq.ACC[bn] == mt * nt * 4
            smem = d["MMQ_BM"] * d["MMQ_AROW"] + d["MMQ_BM"] * 16 * d["MMQ_MROW"] + (depth + 1) * bn * d["MMQ_REC"]
            assert mmq_smem_bytes(bn, a8) == smem, (bn, a8)


def test_plan_fills_the_gpu_and_bounds_the_split():
    """The plans of qwen15 / qwen05 / smol135 decode shapes: whole K ranges, a split only where the
    tiles leave SMs idle, at most MAX_PARTIAL_READ bytes for the split's last CTA to add."""
    from realizar_backend.backends.cuda.mmq import ACC, MAX_PARTIAL_READ, THREADS, plan
    for M in MS:
        for K, rows, ffn in ((1536, (1536, 256, 256), False), (1536, (1536,), False), (8960, (1536,), False),
                             (1536, (8960,), True), (896, (896, 128, 128), False), (576, (49152,), False)):
            p = plan(M, K, rows, ffn, 132)
            nch = -(-K // 128)
            base = p.tiles * p.token_tiles
            cap = MAX_PARTIAL_READ // (THREADS * ACC[p.bn] * 4)
            print(f"M={M} K={K} rows={rows} ffn={ffn}: bn {p.bn} x{p.token_tiles}, splits {p.splits} x {p.cps} "
                  f"chunks, grid {p.grid}")
            assert p.bn >= min(M, 64) and p.token_tiles * p.bn >= M
            assert (p.splits - 1) * p.cps < nch <= p.splits * p.cps          # no empty K range
            assert p.splits == 1 or p.splits <= cap
            assert base >= 132 or p.grid * 2 >= min(132, base * min(nch, cap))


def test_bad_launches_raise(k, bufs, rng):
    from realizar_backend.backends.cuda import mmq
    w, keep, _ = _weight(Q.Q4_K, 64, 512, rng)
    prep, scratch = bufs
    x = _dev(_x(rng, 4, 512))
    y = _poison((4, 64))
    mmq.prep(k, x.data.ptr, 516, 4, 512, prep)
    with pytest.raises(ValueError, match="prep buffer"):
        mmq.mmq(k, [(w, 0, y.data.ptr, 64)], 512, prep, 5, scratch)
    with pytest.raises(ValueError, match="scratch"):
        mmq.mmq(k, [(w, 0, y.data.ptr, 64)], 512, prep, 4, mmq.MmqScratch(1, 1), splits=4, small=False)
    with pytest.raises(ValueError, match="do not fit"):
        mmq.prep(k, x.data.ptr, 516, 300, 512, prep)
    f16 = mmq.WeightRef("f16", Q.F16, w.ptr, 64, 512, 1024)
    with pytest.raises(ValueError, match="no tensor-core kernel"):
        mmq.mmq(k, [(f16, 0, y.data.ptr, 64)], 512, prep, 4, scratch)


# ------------------------------------------------------------------ small batches (mmqs.cu)


@pytest.mark.parametrize("qt", SMALL, ids=lambda q: q.name)
def test_small_batches_both_kernels(k, bufs, rng, qt):
    """Batches of 1..16 rows on mmqs.cu (the default there) and on mmq.cu's tiles, at the warps per
    block the plan picks and at 1, 3 and 8 (K split unevenly, more warps than items), and 17 and 40
    rows on mmqs in token groups, on odd row counts and qwen-like shapes: all fp32-class."""
    from realizar_backend.backends.cuda import mmq
    prep, scratch = bufs
    shapes = [(1536, 1536), (1280, 131), (8960, 1536)] if qt in KQUANT else [(896, 896), (576, 49), (4864, 257)]
    for K, N in shapes:
        w, keep, W64 = _weight(qt, N, K, rng)
        x = _x(rng, 40, K)
        xd = _dev(x)
        for M in (1, 2, 3, 5, 8, 9, 12, 16, 17, 40):
            h64 = x[:M, :K].astype(np.float64)
            ref, scale = h64 @ W64.T, np.abs(h64) @ np.abs(W64).T
            for small, warps in ((True, None), (True, 1), (True, 3), (True, 8), (False, None)):
                y = _poison((M, N + 3))
                mmq.prep(k, xd.data.ptr, K + 4, M, K, prep)
                mmq.mmq(k, [(w, 0, y.data.ptr, N + 3)], K, prep, M, scratch, small=small, warps=warps)
                got = y.get()
                e = _err(got[:, :N], ref, scale) if np.all(np.isnan(got[:, N:])) else float("inf")
                assert e <= FP32_TOL, f"{qt.name} N={N} K={K} M={M} small={small} warps={warps}: error {e:.2e}"
        print(f"{qt.name}: mmqs and mmq within {FP32_TOL:.0e} for M 1..16")


def test_small_kernel_refuses_what_it_lacks(k, bufs, rng):
    from realizar_backend.backends.cuda import mmq
    prep, scratch = bufs
    w, keep, _ = _weight(Q.Q4_1, 64, 512, rng)
    x = _dev(_x(rng, 17, 512))
    y = _poison((17, 64))
    mmq.prep(k, x.data.ptr, 516, 17, 512, prep)
    with pytest.raises(ValueError, match="no small-batch kernel"):
        mmq.mmq(k, [(w, 0, y.data.ptr, 64)], 512, prep, 4, scratch, small=True)
    w, keep, _ = _weight(Q.Q4_K, 64, 512, rng)
    with pytest.raises(ValueError, match="warps per block"):
        mmq.mmq(k, [(w, 0, y.data.ptr, 64)], 512, prep, 4, scratch, warps=9)
    with pytest.raises(ValueError, match="blocks per cluster"):
        mmq.mmq(k, [(w, 0, y.data.ptr, 64)], 512, prep, 4, scratch, cluster=9)


@pytest.mark.parametrize("qt", SMALL, ids=lambda q: q.name)
def test_small_batches_in_clusters(k, bufs, rng, qt):
    """mmqs.cu with K split over the blocks of a thread-block cluster (sm_90), as the plan picks it
    for matrices of few 16-row tiles (qwen15's o and down projections at 1..16 rows) and forced to
    1, 2, 4 and 8 blocks per cluster and 1 or 8 warps: fp32-class, row tails untouched, the same bits
    when repeated; the fused FFN and the LM head's argmax in clusters too."""
    import cupy
    from realizar_backend.backends.cuda import mmq, ops
    if not mmq.clusters_ok(k):
        pytest.skip("thread-block clusters need compute capability 9.0")
    prep, scratch = bufs
    assert mmq.small_cluster(96, 8960, k.sm_count) > 1          # qwen15's down at 4 rows: 96 tiles
    assert mmq.small_cluster(560, 1536, k.sm_count) == 1        # its gate/up fill the GPU alone
    assert mmq.small_cluster(96, 1536, k.sm_count) == 1         # o: too short a K to share
    shapes = [(8960, 1536), (1536, 131)] if qt in KQUANT else [(4864, 896), (896, 257)]
    for K, N in shapes:
        w, keep, W64 = _weight(qt, N, K, rng)
        x = _x(rng, 16, K)
        xd = _dev(x)
        for M in (1, 4, 9, 16):
            h64 = x[:M, :K].astype(np.float64)
            ref, scale = h64 @ W64.T, np.abs(h64) @ np.abs(W64).T
            for cluster, warps in ((None, None), (2, None), (4, None), (8, 1), (2, 8)):
                got = []
                for _ in range(2):
                    y = _poison((M, N + 3))
                    mmq.prep(k, xd.data.ptr, K + 4, M, K, prep)
                    mmq.mmq(k, [(w, 0, y.data.ptr, N + 3)], K, prep, M, scratch, small=True, warps=warps,
                            cluster=cluster)
                    got.append(y.get())
                e = _err(got[0][:, :N], ref, scale) if np.all(np.isnan(got[0][:, N:])) else float("inf")
                assert e <= FP32_TOL, f"{qt.name} N={N} K={K} M={M} cluster={cluster} warps={warps}: error {e:.2e}"
                assert np.array_equal(got[0], got[1], equal_nan=True), f"{qt.name} M={M} cluster={cluster}: bits differ"
    # the fused FFN (gate and up share each block's K range) and the head's argmax, in clusters of 2 and 4
    F, K = 640, 2048 if qt not in KQUANT else 1536
    wg, kg, G64 = _weight(qt, F, K, rng)
    wu, ku, U64 = _weight(qt, F, K, rng)
    x = _x(rng, 5, K)
    xd = _dev(x)
    h64 = x[:, :K].astype(np.float64)
    g, u = h64 @ G64.T, h64 @ U64.T
    ref = g * np.exp(-np.logaddexp(0.0, -g)) * u          # SiLU without exp's overflow
    for cluster in (2, 4):
        a = _poison((5, F))
        mmq.prep(k, xd.data.ptr, K + 4, 5, K, prep)
        mmq.mmq_ffn(k, wg, wu, prep, 5, 0, a.data.ptr, F, scratch, small=True, cluster=cluster)
        got = a.get()
        assert np.all(np.isfinite(got))
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, f"{qt.name} ffn cluster={cluster}: {rel:.2e}"
        key = cupy.zeros(5, cupy.uint64)
        out = cupy.full(5, -7, cupy.int32)
        y = _poison((5, F))
        mmq.mmq(k, [(wg, 0, y.data.ptr, F)], K, prep, 5, scratch, amax=key.data.ptr, small=True, cluster=cluster)
        ops.argmax_unpack(k, key.data.ptr, out.data.ptr, 5)
        assert out.get().tolist() == np.argmax(y.get(), axis=1).tolist()
        assert int(key.sum().get()) == 0
    print(f"{qt.name}: mmqs in clusters within {FP32_TOL:.0e}, repeats identical")


# ------------------------------------------------------------------ accuracy
def _shapes(qt):
    if qt in KQUANT:
        return [(1280, 131), (1536, 288), (4864, 257), (8960, 1536)]
    return [(896, 896), (1536, 288), (4864, 257), (8960, 1536)]


@pytest.mark.parametrize("qt,a8", _variants(TYPES))
def test_mmq_every_type_m_and_k(request, rng, qt, a8):
    """Every M of the decode buckets on four row lengths per type, beside mmvf on the same input
    (8-bit: against W @ its quantized activations, the twin's q the kernel's, so fp32 roundings)."""
    k, bufs = _on(request, a8)
    worst = 0.0
    for K, N in _shapes(qt):
        w, keep, W64 = _weight(qt, N, K, rng)
        x = _x(rng, 256, K)
        xd = _dev(x)
        hx = _h(x[:, :K], a8=a8)
        for M in MS:
            h64 = x[:M, :K].astype(np.float64)
            outs = run_mmq(k, bufs, [(w, W64)], K, xd, K + 4, M, rng=rng)
            e = check_outputs([(w, W64)], outs, hx[:M], M)
            ev = mmvf_err(k, w, W64, xd, K + 4, M, K, h64)
            worst = max(worst, e)
            print(f"{qt.name} N={N} K={K} M={M}: mmq {e:.2e}  mmvf {ev:.2e}")
            assert e <= FP32_TOL, f"{qt.name} N={N} K={K} M={M}: error {e:.2e} (mmvf {ev:.2e})"
    print(f"{qt.name}: worst {worst:.2e}")


@pytest.mark.parametrize("segs,K", [([(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536),
                                    ([(Q.Q5_0, 896), (Q.Q5_0, 128), (Q.Q8_0, 128)], 896),
                                    ([(Q.Q8_0, 577), (Q.Q4_1, 33), (Q.Q4_0, 5)], 576),
                                    ([(Q.Q6_K, 3), (Q.Q4_K, 1), (Q.Q6_K, 130)], 8960),
                                    ([(Q.Q4_K, 40), (Q.Q8_0, 7)], 14336),
                                    ([(Q.Q8_0, 9), (Q.Q4_0, 3)], 20608),
                                    ([(Q.Q5_K, 3584), (Q.Q5_K, 512), (Q.Q6_K, 512)], 3584),
                                    ([(Q.Q5_1, 896), (Q.Q5_0, 128), (Q.Q5_1, 129)], 896),
                                    ([(Q.IQ4_XS, 3584), (Q.IQ4_XS, 512), (Q.Q6_K, 512)], 3584),
                                    ([(Q.MXFP4, 2880), (Q.IQ4_NL, 64), (Q.Q8_0, 65)], 2880),
                                    ([(Q.IQ3_S, 1000), (Q.Q3_K, 33), (Q.IQ2_S, 17)], 2048)],
                         ids=["qwen15-qkv", "qwen05-qkv", "odd-mixed", "long-tiny", "long-in-prep-registers", "past-prep-registers",
                              "q5km-qkv", "q5_1-qkv", "iq4xs-qkv", "mxfp4-mixed", "lowbit-mixed"])
@pytest.mark.parametrize("M", [1, 13, 64, 100, 256])
@pytest.mark.parametrize("a8", [False, True], ids=["fp16", "8bit"])
def test_mmq_segments_bias_residual_norm(request, rng, segs, K, M, a8):
    if a8 and not {qt for qt, _ in segs} <= MMQ8_TYPES:
        pytest.skip("types the 8-bit variant does not take")
    k, bufs = _on(request, a8)
    mats = [_weight(qt, n, K, rng) for qt, n in segs]
    sw = [(w, W64) for w, _, W64 in mats]
    x = _x(rng, M, K)
    xd = _dev(x)
    nw = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    nwd = _dev(nw)
    h64 = _h(x[:, :K], a8=a8)
    e1 = check_outputs(sw, run_mmq(k, bufs, sw, K, xd, K + 4, M, bias=True, rng=rng), h64, M)
    e2 = check_outputs(sw[:1], run_mmq(k, bufs, sw[:1], K, xd, K + 4, M, accumulate=True, rng=rng), h64, M)
    e3 = check_outputs(sw, run_mmq(k, bufs, sw, K, xd, K + 4, M, bias=True, accumulate=True,
                                   norm=(nwd.data.ptr, 1e-6), rng=rng), _h(x[:, :K], nw, a8), M)
    print(f"segments K={K} M={M}: bias {e1:.2e}  residual {e2:.2e}  bias+residual+norm {e3:.2e}")
    assert max(e1, e2) <= FP32_TOL and e3 <= _tol(a8, True)


def _ffn_ref(h64, G, U, act):
    g, u = h64 @ G.T, h64 @ U.T
    ag = 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) if act else g / (1 + np.exp(np.minimum(-g, 700.0)))
    scale = 1.2 * (np.abs(h64) @ np.abs(G).T) * np.abs(u) + np.abs(ag) * (np.abs(h64) @ np.abs(U).T)
    return ag * u, scale


@pytest.mark.parametrize("qt,F,K,act", [(Q.Q4_K, 8960, 1536, 0), (Q.Q5_0, 4864, 896, 0), (Q.Q4_1, 1536, 576, 0),
                                        (Q.Q8_0, 1000, 640, 1), (Q.Q6_K, 2048, 512, 1), (Q.Q4_0, 97, 896, 0),
                                        (Q.Q5_K, 2048, 1536, 0), (Q.Q5_1, 640, 896, 1), (Q.IQ4_XS, 2048, 1536, 0),
                                        (Q.Q3_K, 1024, 2304, 1), (Q.MXFP4, 2880, 2880, 0), (Q.IQ2_XS, 768, 1024, 0)],
                         ids=["qwen15", "qwen05", "smol", "gelu-odd", "q6k-gelu", "q4_0-tiny", "q5k", "q5_1-gelu",
                              "iq4xs", "q3k-gelu", "mxfp4", "iq2xs"])
@pytest.mark.parametrize("M", [3, 17, 64, 256])
@pytest.mark.parametrize("a8", [False, True], ids=["fp16", "8bit"])
def test_mmq_ffn(request, rng, qt, F, K, act, M, a8):
    from realizar_backend.backends.cuda import mmq
    if a8 and qt not in MMQ8_TYPES:
        pytest.skip("a type the 8-bit variant does not take")
    k, (prep, scratch) = _on(request, a8)
    mats = [_weight(qt, F, K, rng) for _ in range(2)]        # (WeightRef, device bytes, float64)
    (wg, _, G), (wu, _, U) = mats
    x = _x(rng, M, K)
    nw = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    xd, nwd = _dev(x), _dev(nw)
    errs = []
    for norm in (False, True):
        a = _poison((M, F + 5))
        mmq.prep(k, xd.data.ptr, K + 4, M, K, prep, norm=(nwd.data.ptr, 1e-6) if norm else None)
        mmq.mmq_ffn(k, wg, wu, prep, M, act, a.data.ptr, F + 5, scratch)
        ref, scale = _ffn_ref(_h(x[:, :K], nw if norm else None, a8), G, U, act)
        got = a.get()
        errs.append(_err(got[:, :F], ref, scale) if np.all(np.isnan(got[:, F:])) else float("inf"))
    print(f"ffn {qt.name} F={F} K={K} M={M} act={act}: {errs[0]:.2e}  norm {errs[1]:.2e}")
    assert errs[0] <= FP32_TOL and errs[1] <= _tol(a8, True)


@pytest.mark.parametrize("a8", [False, True], ids=["fp16", "8bit"])
def test_mmq_lm_head_argmax(request, rng, a8):
    """qwen15's head: 151936 Q6_K rows, the norm folded in, argmax fused (M = 16: one token tile;
    100: two); the key buffer is left zeroed by argmax_unpack for the next step. 8-bit: against W @
    its quantized activations, the argmax that of the logits the launch wrote."""
    import cupy
    from realizar_backend.backends.cuda import ops
    kk, bb = _on(request, a8)
    N, K = 151936, 1536
    w, keep, W64 = _weight(Q.Q6_K, N, K, rng)
    for M in (16, 100):
        x = _x(rng, M, K)
        nw = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
        xd, nwd = _dev(x), _dev(nw)
        key = cupy.zeros(M, cupy.uint64)
        out = cupy.full(M, -7, cupy.int32)
        outs = run_mmq(kk, bb, [(w, W64)], K, xd, K + 4, M, norm=(nwd.data.ptr, 1e-6), amax=key.data.ptr, rng=rng)
        ops.argmax_unpack(kk, key.data.ptr, out.data.ptr, M)
        e = check_outputs([(w, W64)], outs, _h(x[:, :K], nw, a8), M)
        logits = outs[0][0].get()[:, :N]
        print(f"head{' 8-bit' if a8 else ''} M={M}: {e:.2e}")
        assert e <= _tol(a8, True)
        assert out.get().tolist() == np.argmax(logits, axis=1).tolist()
        assert int(key.sum().get()) == 0


@pytest.mark.parametrize("qt,N,K", [(Q.Q6_K, 1536, 8960), (Q.Q4_K, 896, 4864), (Q.Q8_0, 640, 2048),
                                    (Q.Q5_0, 288, 4864), (Q.Q5_K, 1536, 8960), (Q.IQ4_XS, 1536, 8960),
                                    (Q.MXFP4, 640, 2880)],
                         ids=["qwen15-down", "q4k", "q8_0", "q5_0", "q5k", "iq4xs", "mxfp4"])
@pytest.mark.parametrize("M", [8, 64, 100])
@pytest.mark.parametrize("a8", [False, True], ids=["fp16", "8bit"])
def test_mmq_activation_range_stress(request, rng, qt, N, K, M, a8):
    """Down-projection-like inputs: outlier channels, rows from 1e-6 to 1e4 (the row scaling keeps
    fp16 in range; the hi/lo split keeps fp32-class accuracy; 8-bit: each 32 values their own
    scale, W @ the quantized rows within fp32 roundings), with the residual add."""
    if a8 and qt not in MMQ8_TYPES:
        pytest.skip("a type the 8-bit variant does not take")
    k, bufs = _on(request, a8)
    w, keep, W64 = _weight(qt, N, K, rng)
    x = _x(rng, M, K, stress=True)
    xd = _dev(x)
    h64 = x[:, :K].astype(np.float64)
    e = check_outputs([(w, W64)], run_mmq(k, bufs, [(w, W64)], K, xd, K + 4, M, accumulate=True, rng=rng),
                      _h(x[:, :K], a8=a8), M)
    ev = mmvf_err(k, w, W64, xd, K + 4, M, K, h64)
    print(f"stress {qt.name} {N}x{K} M={M}: mmq {e:.2e}  mmvf {ev:.2e}")
    assert e <= FP32_TOL


# ------------------------------------------------------------------ launch mechanics
@pytest.mark.parametrize("a8", [False, True], ids=["fp16", "8bit"])
def test_forced_splits_and_determinism(request, rng, a8):
    """Every K split gives fp32-class results (8-bit: of W @ its activations); one launch repeated
    gives the same bits (the split reduction runs in a fixed order and leaves its counters at zero)."""
    from realizar_backend.backends.cuda import mmq
    k, bufs = _on(request, a8)
    w, keep, W64 = _weight(Q.Q6_K, 1536, 8960, rng)
    M = 40
    x = _x(rng, M, 8960)
    xd = _dev(x)
    h64 = _h(x[:, :8960], a8=a8)
    _, scratch = bufs
    for splits in (1, 2, 7, 35, 70):
        outs = run_mmq(k, bufs, [(w, W64)], 8960, xd, 8964, M, splits=splits, rng=rng)
        e = check_outputs([(w, W64)], outs, h64, M)
        again = run_mmq(k, bufs, [(w, W64)], 8960, xd, 8964, M, splits=splits, rng=rng)
        same = np.array_equal(outs[0][0].get(), again[0][0].get(), equal_nan=True)   # row tails stay poisoned
        print(f"splits {splits} ({mmq.plan(M, 8960, (1536,), False, k.sm_count, splits).splits}): {e:.2e}, repeat identical {same}")
        assert e <= FP32_TOL and same
        assert int(scratch.cnt.sum().get()) == 0


@pytest.mark.parametrize("M,a8", [(24, False), (6, False), (64, True)], ids=["tiles", "small", "tiles-8bit"])
def test_graph_capture_and_pdl_match_eager(request, k, rng, M, a8):
    """prep + mmq (QKV with biases) + mmq_ffn + the down projection with the residual, captured in
    a CUDA graph and replayed (then launched as programmatic dependent launches): the same bits as
    eager launches; at 24 rows on mmq.cu's tiles, at 6 on mmqs.cu, at 64 on the 8-bit variant."""
    import cupy
    from realizar_backend.backends.cuda import mmq
    prep, scratch = request.getfixturevalue("bufs8" if a8 else "bufs")
    H, F = 1536, 8960
    wq, kq, _ = _weight(Q.Q4_K, 1536, H, rng)
    wk, kk, _ = _weight(Q.Q4_K, 256, H, rng)
    wv, kv, _ = _weight(Q.Q6_K, 256, H, rng)
    mats = [_weight(Q.Q4_K, F, H, rng), _weight(Q.Q4_K, F, H, rng), _weight(Q.Q6_K, H, F, rng)]
    (wg, _, _), (wu, _, _), (wd, _, _) = mats
    x0 = _dev(_x(rng, M, H, pad=0))
    nw = _dev((1.0 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    bq, bk, bv = (_dev(rng.standard_normal(n).astype(np.float32)) for n in (1536, 256, 256))
    q, kk_, v = cupy.empty((M, 1536), cupy.float32), cupy.empty((M, 256), cupy.float32), cupy.empty((M, 256), cupy.float32)
    a = cupy.empty((M, F), cupy.float32)
    x = cupy.empty_like(x0)

    def launches(pdl=False):
        cupy.copyto(x, x0)
        mmq.prep(k, x.data.ptr, H, M, H, prep, norm=(nw.data.ptr, 1e-6), pdl=pdl)
        mmq.mmq(k, [(wq, bq.data.ptr, q.data.ptr, 1536), (wk, bk.data.ptr, kk_.data.ptr, 256),
                    (wv, bv.data.ptr, v.data.ptr, 256)], H, prep, M, scratch, pdl=pdl)
        mmq.prep(k, x.data.ptr, H, M, H, prep, norm=(nw.data.ptr, 1e-6), pdl=pdl)
        mmq.mmq_ffn(k, wg, wu, prep, M, 0, a.data.ptr, F, scratch, pdl=pdl)
        mmq.prep(k, a.data.ptr, F, M, F, prep, pdl=pdl)
        mmq.mmq(k, [(wd, 0, x.data.ptr, H)], F, prep, M, scratch, accumulate=True, pdl=pdl)

    step_out = [q, kk_, v, a, x]
    launches()
    eager = [t.get() for t in step_out]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        launches()
        graph = stream.end_capture()
    for t in step_out:
        t.fill(np.nan)
    cupy.cuda.Device().synchronize()
    for _ in range(2):
        graph.launch(stream)
    stream.synchronize()
    replay = [t.get() for t in step_out]
    for name, e, r in zip(("q", "k", "v", "a", "x"), eager, replay):
        assert np.array_equal(e, r), f"graph replay differs from eager launches in {name}"
    if int(k.device.compute_capability) >= 90:
        launches(pdl=True)
        for name, e, r in zip(("q", "k", "v", "a", "x"), eager, [t.get() for t in step_out]):
            assert np.array_equal(e, r), f"programmatic dependent launches differ in {name}"
    assert np.all(np.isfinite(eager[4]))


# ------------------------------------------------------------------ the 8-bit variant (MMQ_A8)
def test_mmq8_refuses_what_it_lacks(k8, bufs8, bufs, rng):
    """Types the 8-bit variant does not take, mmqs.cu on int8 records, and records of the other
    kind raise before any launch."""
    from realizar_backend.backends.cuda import mmq
    prep8, scratch = bufs8
    prep16, _ = bufs
    x = _dev(_x(rng, 4, 512))
    y = _poison((4, 64))
    from realizar_backend.backends.cuda.dispatch import MMQ8_TYPES, MMQ_TYPES
    lacks = min(MMQ_TYPES - MMQ8_TYPES, key=lambda q: q.value)     # a tensor-core type the 8-bit variant lacks
    iq, keep, _ = _weight(lacks, 64, 512, rng)
    q4, keep4, _ = _weight(Q.Q4_K, 64, 512, rng)
    mmq.prep(k8, x.data.ptr, 516, 4, 512, prep8)
    with pytest.raises(ValueError, match="no 8-bit tensor-core kernel"):
        mmq.mmq(k8, [(iq, 0, y.data.ptr, 64)], 512, prep8, 4, scratch)
    with pytest.raises(ValueError, match="no 8-bit variant"):
        mmq.mmq(k8, [(q4, 0, y.data.ptr, 64)], 512, prep8, 4, scratch, small=True)
    mmq.prep(k8, x.data.ptr, 516, 4, 512, prep16)
    with pytest.raises(ValueError, match="records"):
        mmq.mmq(k8, [(q4, 0, y.data.ptr, 64)], 512, prep16, 4, scratch, a8=True)
    mmq.mmq(k8, [(q4, 0, y.data.ptr, 64)], 512, prep8, 4, scratch)          # small M: tiles, not mmqs
    assert np.all(np.isfinite(y.get()))
