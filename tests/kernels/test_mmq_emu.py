"""kernels/mmq.cu and kernels/mmqs.cu run on the CPU (tests/host/mmq_emu.cpp: a fiber per CUDA thread, ldmatrix and
mma.sync emulated from their PTX fragment layouts) against float64 NumPy: every weight type in its
device layout (formats/gpu_layout.py), K with a partial last chunk, rows and tokens that no tile
divides, every token-tile width, K split over CTAs (with the counters left at zero and a second
launch bit-identical), Q/K/V segments of mixed types with biases, the residual add, the fused FFN,
the folded RMSNorm, the LM head's argmax, and activations spanning 1e-6 to 1e4; under an exact and
a truncating tensor-core accumulation model. mmq.cu's 8-bit variant (MMQ_A8: int8 activations per
32 values, int8 mma) goes through the same launches against W @ (its quantized activations) in
float64 (support.q8, the measure of tests/kernels/test_mmv8_host.py). The GPU tests
(tests/gpu/test_mmq.py) check the same kernels on the device. Skipped where g++ is absent."""

from __future__ import annotations

import struct
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.formats.gpu_layout import device_row_bytes, to_device
from realizar_backend.formats.quants import dequantize, random_matrix
from support import host_emu
from support.host_emu import GXX
from support.q8 import normed, q8_twin

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

F64 = np.float64
# the types of 256-weight blocks (rows of whole blocks)
KQUANT = (Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)
# lowbit.cuh's types on the tensor cores (the rest of the dispatcher's rows)
LOWBIT = [Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S]
FP32_TOL = 2e-5          # the fp32 GEMV's bound (tests/gpu/test_kernels_f32.py)
EXACT_TOL = 2e-6         # with exact tensor-core sums only fp32 roundings are left
# the 8-bit variant against its own quantized activations: fp32 roundings, and a value the folded
# norm rounds the other way than the twin's float64 rms (one q off by one) now and then; measured
# as test_mmv8_host.py measures mmv8.cu (norm of the error over norm of sum |w x|), with its bound
A8_TOL = 2e-5


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return host_emu.build("mmq_emu.cpp", tmp_path_factory.mktemp("mmq") / "mmq_emu")


@pytest.fixture(scope="module")
def emu8(tmp_path_factory):
    return host_emu.build("mmq_emu.cpp", tmp_path_factory.mktemp("mmq8") / "mmq8_emu",
                          flags=("-std=c++17", "-O1", "-DMMQ_A8=1"))


def activations(rng, M: int, K: int, stress: bool) -> np.ndarray:
    x = rng.standard_normal((M, K)) * rng.uniform(0.1, 30.0, (M, 1))
    if stress:   # LLM-like outlier channels, rows of 1e4 and of 1e-6, and values spread over 10 decades
        x[:, rng.choice(K, 3, replace=False)] *= 300
        x *= 10.0 ** rng.uniform(-6, 4, (M, 1))
        x[0, : K // 2] *= 1e-5
    return x.astype(np.float32)


def run_case(emu, tmp_path, rng, segs, K, M, bn, splits, *, mode=0, act=0, bias=False, accumulate=False,
             norm=False, amax=False, stress=False, tc_model=0, twice=True, prep_splits=1, a8=False):
    """segs: [(qtype, rows)] (mode 1: [(qtype, F)], gate and up drawn here). Returns (max error in
    units of sum |w x|, outputs per segment, argmax keys, outputs untouched past the rows, status).
    prep_splits: blocks a row of the prep launch (each writes its share of the row's records).
    a8: emu is the 8-bit variant's; the reference takes the activations as it quantizes them and
    the error is A8_TOL's measure."""
    nch = -(-K // 128)
    cps = -(-nch // splits)
    if bn > 0:                   # mmq.cu: no empty K range; mmqs.cu (bn < 0): `splits` is the warps per block
        splits = -(-nch // cps)
    xs = K + 3
    x = activations(rng, M, xs, stress)
    nw = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    if mode:
        segs = [segs[0], segs[0]]
    hdr = struct.pack("15i", mode, K, M, len(segs), bn, splits, cps, act, int(accumulate), int(norm), int(amax), xs,
                      tc_model, int(twice and not accumulate), prep_splits) + struct.pack("f", 1e-6)
    body, ref_parts = [hdr], []
    for qt, n in segs:
        raw = random_matrix(qt, n, K, rng)
        dev = to_device(qt, raw, K)
        rb = device_row_bytes(qt, K)
        b = rng.standard_normal(n).astype(np.float32) if bias and not mode else None
        ys = n + 5
        y0 = rng.standard_normal((M, ys)).astype(np.float32) if accumulate else np.full((M, ys), np.nan, np.float32)
        body += [struct.pack("4iq", int(qt), n, ys, int(b is not None), rb), dev.tobytes()]
        if b is not None:
            body.append(b.tobytes())
        body.append(y0.tobytes())
        ref_parts.append((dequantize(raw, qt, (n, K)).astype(F64), b, y0, ys))
    body.append(x.tobytes())
    if norm:
        body.append(nw.tobytes())
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    inp.write_bytes(b"".join(body))
    r = subprocess.run([str(emu), str(inp), str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"emulator failed ({r.returncode}): {r.stderr}"
    data = out.read_bytes()
    clean, same = struct.unpack_from("2i", data, 0)
    off = 8
    ys_list = []
    for _, _, _, ys in ref_parts[:1 if mode else None]:
        ys_list.append(np.frombuffer(data, np.float32, M * ys, off).reshape(M, ys))
        off += 4 * M * ys
    keys = np.frombuffer(data, np.uint64, M, off)

    h = x[:, :K].astype(F64)
    if a8:
        h = np.stack([q8_twin(normed(x[t, :K], nw, 1e-6) if norm else x[t, :K]) for t in range(M)])
    elif norm:
        h = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-6) * nw.astype(F64)
    err = _err8 if a8 else _err
    errs, tails = [], []
    if mode:
        (wg, _, y0, ys), (wu, _, _, _) = ref_parts
        g, u = h @ wg.T, h @ wu.T
        actg = 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) if act else g / (1 + np.exp(np.minimum(-g, 700.0)))
        scale = 1.2 * (np.abs(h) @ np.abs(wg).T) * np.abs(u) + np.abs(actg) * (np.abs(h) @ np.abs(wu).T)
        got = ys_list[0]
        n = wg.shape[0]
        errs.append(err(got[:, :n], actg * u, scale))
        tails.append(bool(np.all(np.isnan(got[:, n:]))))
    else:
        for (w, b, y0, ys), got in zip(ref_parts, ys_list):
            n = w.shape[0]
            ref, scale = h @ w.T, np.abs(h) @ np.abs(w).T
            if b is not None:
                ref, scale = ref + b, scale + np.abs(b)
            if accumulate:
                ref, scale = ref + y0[:, :n], scale + np.abs(y0[:, :n])
            errs.append(err(got[:, :n], ref, scale))
            tails.append(np.array_equal(got[:, n:], y0[:, n:], equal_nan=True))
    return max(errs), ys_list, keys, all(tails), bool(clean), bool(same)


def _err(got, ref, scale) -> float:
    got = np.asarray(got, F64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30)))


def _err8(got, ref, scale) -> float:
    got = np.asarray(got, F64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(scale), 1e-30))


def check(name, res, tol):
    err, _, _, tails, clean, same = res
    print(f"{name}: max error {err:.2e} (of sum |w x|), tail untouched {tails}, counters reset {clean}, "
          f"repeat identical {same}")
    assert tails, f"{name}: outputs past the rows were written"
    assert clean, f"{name}: split-K counters not reset"
    assert same, f"{name}: a second launch gave different bits"
    assert err <= tol, f"{name}: error {err:.2e} > {tol:.0e}"


TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_types_tiles_and_splits(emu, tmp_path, qt):
    """Each type through two token-tile widths, split and unsplit K, rows no tile divides."""
    rng = np.random.default_rng(int(qt) * 7919)
    K = 768 if qt in KQUANT else 544                 # 544: 5 chunks, the last of one unit
    i = TYPES.index(qt)
    for bn, M, splits in (((8, 16, 32, 64)[i % 4], (5, 13, 29, 37)[i % 4], 1), ((64, 32, 16, 8)[i % 4], (70, 17, 9, 8)[i % 4], 2)):
        res = run_case(emu, tmp_path, rng, [(qt, 131)], K, M, bn, splits, bias=True, prep_splits=1 + i % 3)
        check(f"{qt.name} bn{bn} M{M} splits{splits}", res, EXACT_TOL)


def test_qkv_segments_mixed_types_accumulate(emu, tmp_path):
    rng = np.random.default_rng(11)
    segs = [(Q.Q4_K, 130), (Q.Q4_K, 33), (Q.Q6_K, 17)]
    check("qkv bias", run_case(emu, tmp_path, rng, segs, 512, 13, 16, 2, bias=True), EXACT_TOL)
    check("qkv residual", run_case(emu, tmp_path, rng, segs[:2], 512, 6, 8, 1, accumulate=True, bias=True),
          EXACT_TOL)
    segs = [(Q.Q5_0, 70), (Q.Q8_0, 9), (Q.Q8_0, 9)]
    check("qkv q5_0/q8_0 norm", run_case(emu, tmp_path, rng, segs, 288, 20, 32, 1, bias=True, norm=True), EXACT_TOL)


@pytest.mark.parametrize("qt,F,K,M,bn,splits,act", [(Q.Q4_K, 70, 512, 20, 32, 2, 0), (Q.Q8_0, 64, 288, 3, 8, 1, 1),
                                                    (Q.Q6_K, 129, 256, 66, 64, 2, 0), (Q.Q4_1, 33, 160, 16, 16, 2, 1),
                                                    (Q.Q5_K, 65, 512, 9, 16, 2, 0), (Q.Q5_1, 40, 224, 5, 8, 1, 1)],
                         ids=["q4k-silu", "q8_0-gelu", "q6k-2tokentiles", "q4_1-gelu", "q5k-silu", "q5_1-gelu"])
def test_fused_ffn(emu, tmp_path, qt, F, K, M, bn, splits, act):
    rng = np.random.default_rng(F * K + M)
    check(f"ffn {qt.name}", run_case(emu, tmp_path, rng, [(qt, F)], K, M, bn, splits, mode=1, act=act, norm=True),
          EXACT_TOL)


@pytest.mark.parametrize("qt,N,splits,bn,M", [(Q.Q6_K, 300, 1, 16, 9), (Q.Q8_0, 257, 2, 8, 5), (Q.Q4_K, 200, 1, 64, 40)],
                         ids=["q6k", "q8_0-split", "q4k-bn64"])
def test_head_argmax(emu, tmp_path, qt, N, splits, bn, M):
    rng = np.random.default_rng(N + M)
    K = 256
    res = run_case(emu, tmp_path, rng, [(qt, N)], K, M, bn, splits, amax=True, norm=True)
    check(f"head {qt.name}", res, EXACT_TOL)
    logits, keys = res[1][0][:, :N], res[2]
    rows = (0xFFFFFFFF - (keys & np.uint64(0xFFFFFFFF))).astype(np.int64)
    assert rows.tolist() == np.argmax(logits, axis=1).tolist()


@pytest.mark.parametrize("tc_model", [0, 1], ids=["exact-sums", "truncating-sums"])
@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_1, Q.Q5_K], ids=lambda q: q.name)
def test_activation_range_stress(emu, tmp_path, qt, tc_model):
    """Rows from 1e-6 to 1e4 with outlier channels (the FFN down projection's input has no bound):
    the row scaling keeps fp16 from overflowing and the hi/lo split keeps fp32-class accuracy, also
    under truncating tensor-core sums, and through the folded norm."""
    rng = np.random.default_rng(int(qt) + 100 * tc_model)
    K = 1024 if qt in KQUANT else 992
    for norm in (False, True):
        res = run_case(emu, tmp_path, rng, [(qt, 37)], K, 11, 16, 2, stress=True, norm=norm, tc_model=tc_model,
                       twice=False, prep_splits=2)
        check(f"stress {qt.name} norm={norm} model={tc_model}", res, FP32_TOL if tc_model else EXACT_TOL)


# ------------------------------------------------------------------ mmqs.cu (batches of 2 to 16 rows)
SMALL_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("qt", SMALL_TYPES, ids=lambda q: q.name)
def test_small_types_tokens_and_warps(emu, tmp_path, qt):
    """Each type of mmqs.cu through both token tiles, batches that fill them or not and batches in
    several token groups, K split over 1 to 8 warps (more warps than items too), and rows no
    16-row tile divides."""
    rng = np.random.default_rng(int(qt) * 104729)
    K = 768 if qt in KQUANT else 576
    for bn, M, warps in ((-8, 1, 1), (-8, 5, 3), (-8, 8, 8), (-16, 9, 2), (-16, 16, 7), (-16, 37, 4), (-8, 19, 2)):
        res = run_case(emu, tmp_path, rng, [(qt, 37)], K, M, bn, warps, bias=True)
        check(f"mmqs {qt.name} t{-bn} M{M} warps{warps}", res, EXACT_TOL)


@pytest.mark.parametrize("K", [4_352, 18_944, 20_608], ids=["in-registers", "ffn-down-7b", "past-registers"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_prep_rows_in_split_rounds(emu, tmp_path, norm, K):
    """Rows of several rounds of 32 units, each round dealt to one of 3 blocks: all records written,
    same results. 20,608 columns is past the prep's registers (MMQ_PREP_NJ x 1024: the row is read twice)."""
    rng = np.random.default_rng(K + norm)
    res = run_case(emu, tmp_path, rng, [(Q.Q8_0, 9)], K, 3, -8, 8, norm=norm, prep_splits=3, stress=True,
                   twice=False)
    check(f"split prep K={K} norm={norm}", res, EXACT_TOL)


def test_small_qkv_ffn_head(emu, tmp_path):
    """mmqs.cu's epilogues: Q/K/V segments of mixed types with biases, the residual add, the fused
    FFN with the folded norm, the LM head's argmax, activations over ten decades."""
    rng = np.random.default_rng(5)
    segs = [(Q.Q4_K, 48), (Q.Q4_K, 17), (Q.Q6_K, 16)]
    check("mmqs qkv bias", run_case(emu, tmp_path, rng, segs, 512, 4, -8, 4, bias=True, norm=True), EXACT_TOL)
    check("mmqs residual", run_case(emu, tmp_path, rng, [(Q.Q6_K, 40)], 512, 11, -16, 3, accumulate=True),
          EXACT_TOL)
    for qt, act in ((Q.Q4_K, 0), (Q.Q6_K, 1), (Q.Q8_0, 0), (Q.Q5_K, 1), (Q.Q5_1, 0)):
        check(f"mmqs ffn {qt.name}", run_case(emu, tmp_path, rng, [(qt, 33)], 512, 6, -8, 2, mode=1, act=act,
                                               norm=True), EXACT_TOL)
    check("mmqs ffn t16", run_case(emu, tmp_path, rng, [(Q.Q4_K, 20)], 256, 13, -16, 4, mode=1, norm=True), EXACT_TOL)
    check("mmqs ffn groups", run_case(emu, tmp_path, rng, [(Q.Q6_K, 20)], 256, 35, -16, 2, mode=1, norm=True),
          EXACT_TOL)
    check("mmqs qkv groups", run_case(emu, tmp_path, rng, segs, 512, 21, -8, 3, bias=True, accumulate=True),
          EXACT_TOL)
    for qt, M, bn in ((Q.Q6_K, 3, -8), (Q.Q4_K, 14, -16), (Q.Q6_K, 40, -16)):
        res = run_case(emu, tmp_path, rng, [(qt, 90)], 256, M, bn, 2, amax=True, norm=True)
        check(f"mmqs head {qt.name}", res, EXACT_TOL)
        logits, keys = res[1][0][:, :90], res[2]
        rows = (0xFFFFFFFF - (keys & np.uint64(0xFFFFFFFF))).astype(np.int64)
        assert rows.tolist() == np.argmax(logits, axis=1).tolist()
    for tc_model in (0, 1):
        res = run_case(emu, tmp_path, rng, [(Q.Q4_K, 21)], 1024, 7, -8, 4, stress=True, tc_model=tc_model, twice=False)
        check(f"mmqs stress model={tc_model}", res, FP32_TOL if tc_model else EXACT_TOL)


@pytest.mark.parametrize("qt", LOWBIT, ids=lambda q: q.name)
def test_lowbit_types_both_kernels(emu, tmp_path, qt):
    """lowbit.cuh's types (Q3_K, the I-quants, MXFP4) through mmq.cu (a token-tile width, K split
    over CTAs, rows no tile divides, a partial last chunk where the type allows it) and mmqs.cu (one
    and two token tiles, K over 1 to 8 warps, a batch in two token groups), and the fused FFN on each:
    exact against gguf's dequantize of the same blocks."""
    rng = np.random.default_rng(int(qt) * 31337)
    i = LOWBIT.index(qt)
    for bn, M, splits in (((8, 16, 32, 64)[i % 4], (5, 13, 29, 37)[i % 4], 2), (-8, 7, 3), (-16, 16, 8), (-16, 19, 2)):
        K = 768 if qt in KQUANT else (544 if bn > 0 else 576)       # mmqs.cu: whole 64-column items
        res = run_case(emu, tmp_path, rng, [(qt, 37)], K, M, bn, splits, bias=True)
        check(f"{qt.name} bn{bn} M{M} splits/warps {splits}", res, EXACT_TOL)
    for bn, M, splits in ((16, 9, 1), (-8, 6, 2)):
        res = run_case(emu, tmp_path, rng, [(qt, 33)], 512, M, bn, splits, mode=1, act=i % 2, norm=True)
        check(f"{qt.name} ffn bn{bn}", res, EXACT_TOL)


# ------------------------------------------------------------------ mmq.cu's 8-bit variant (MMQ_A8)
A8_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]


@pytest.mark.parametrize("qt", A8_TYPES, ids=lambda q: q.name)
def test_a8_types_tiles_and_splits(emu8, tmp_path, qt):
    """Each type of the 8-bit variant through two token-tile widths, split and unsplit K, rows and
    tokens no tile divides, a partial last chunk where the type allows it."""
    rng = np.random.default_rng(int(qt) * 6151)
    K = 768 if qt in KQUANT else 544
    i = A8_TYPES.index(qt)
    for bn, M, splits in (((64, 32, 16, 8)[i % 4], (37, 29, 13, 5)[i % 4], 1), ((32, 64, 8, 16)[i % 4], (17, 70, 8, 9)[i % 4], 2)):
        res = run_case(emu8, tmp_path, rng, [(qt, 131)], K, M, bn, splits, bias=True, prep_splits=1 + i % 3, a8=True)
        check(f"a8 {qt.name} bn{bn} M{M} splits{splits}", res, A8_TOL)


def test_a8_qkv_segments_accumulate_norm(emu8, tmp_path):
    """Q/K/V segments of mixed types with biases, the residual add, the folded RMSNorm."""
    rng = np.random.default_rng(12)
    segs = [(Q.Q4_K, 130), (Q.Q4_K, 33), (Q.Q6_K, 17)]
    check("a8 qkv bias norm", run_case(emu8, tmp_path, rng, segs, 512, 45, 64, 2, bias=True, norm=True, a8=True),
          A8_TOL)
    check("a8 residual", run_case(emu8, tmp_path, rng, [(Q.Q6_K, 70)], 512, 19, 32, 1, accumulate=True, a8=True),
          A8_TOL)
    segs = [(Q.Q5_0, 70), (Q.Q8_0, 9), (Q.Q8_0, 9)]
    check("a8 qkv q5_0/q8_0 norm", run_case(emu8, tmp_path, rng, segs, 288, 20, 32, 1, bias=True, norm=True, a8=True),
          A8_TOL)


@pytest.mark.parametrize("qt,F,K,M,bn,splits,act", [(Q.Q4_K, 70, 512, 40, 64, 2, 0), (Q.Q6_K, 65, 256, 70, 64, 1, 1),
                                                    (Q.Q8_0, 64, 288, 20, 32, 2, 0), (Q.Q5_K, 33, 256, 9, 16, 1, 1),
                                                    (Q.Q4_1, 33, 160, 5, 8, 2, 0)],
                         ids=["q4k-silu", "q6k-gelu-2tokentiles", "q8_0-silu", "q5k-gelu", "q4_1-silu"])
def test_a8_fused_ffn(emu8, tmp_path, qt, F, K, M, bn, splits, act):
    rng = np.random.default_rng(F * K + M + 1)
    check(f"a8 ffn {qt.name}", run_case(emu8, tmp_path, rng, [(qt, F)], K, M, bn, splits, mode=1, act=act, norm=True,
                                         a8=True), A8_TOL)


@pytest.mark.parametrize("qt,N,splits,bn,M", [(Q.Q6_K, 300, 2, 64, 50), (Q.Q4_K, 200, 1, 32, 21)],
                         ids=["q6k-bn64-split", "q4k-bn32"])
def test_a8_head_argmax(emu8, tmp_path, qt, N, splits, bn, M):
    rng = np.random.default_rng(N + M + 1)
    res = run_case(emu8, tmp_path, rng, [(qt, N)], 256, M, bn, splits, amax=True, norm=True, a8=True)
    check(f"a8 head {qt.name}", res, A8_TOL)
    logits, keys = res[1][0][:, :N], res[2]
    rows = (0xFFFFFFFF - (keys & np.uint64(0xFFFFFFFF))).astype(np.int64)
    assert rows.tolist() == np.argmax(logits, axis=1).tolist()


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_a8_activation_range_stress(emu8, tmp_path, qt):
    """Rows from 1e-6 to 1e4 with outlier channels: each 32 values get their own scale, so a row's
    quiet units keep their precision beside its outliers, with and without the folded norm."""
    rng = np.random.default_rng(int(qt) + 7)
    for norm in (False, True):
        res = run_case(emu8, tmp_path, rng, [(qt, 37)], 1024, 11, 16, 2, stress=True, norm=norm, twice=False,
                       prep_splits=2, a8=True)
        check(f"a8 stress {qt.name} norm={norm}", res, A8_TOL)
