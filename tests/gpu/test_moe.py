"""Mixture of experts on the GPU: moe.cu's kernels against their NumPy twins (backends/cuda/selfcheck.py:
the routing against model/math.py route, the experts through experts.py's launches against float64)
at several shapes with outputs poisoned (the per-pair GEMVs and the grouped tiles), and whole qwen3moe models, CUDABackend against the NumPy
oracle (CPUBackend), in prompt steps of every family and decode steps of 1 and 8 rows.

The models are tests/support/moe_models.py's tiny qwen3moe (transformers' own, converted by llama.cpp's
converter): F32, and a wider one requantized to Q4_K/Q6_K with one layer's gate and up of two types.
This machine cannot make them without transformers and the network: make them where it can
(`python tests/support/moe_models.py .device/moe`) and point $REALIZAR_MOE_MODELS at that directory."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.matrices import QTYPES

from support.moe_models import model_path
from support.parity import ParityRun
from test_model_parity import _backends

pytestmark = pytest.mark.gpu

TOL = 1e-3                  # selfcheck's bound (relative error; measured errors are ~1e-6)


@pytest.mark.parametrize("T,E,k,renorm", [(1, 128, 8, True), (8, 128, 8, True), (37, 8, 2, True), (5, 64, 6, False),
                                          (3, 512, 10, True), (16, 300, 32, True), (4, 4, 4, True)],
                         ids=["30b-a3b-1row", "30b-a3b-8rows", "tiny-37rows", "no-renorm", "512-experts",
                              "k32", "all-experts"])
def test_topk(kernels, rng, T, E, k, renorm):
    from realizar_backend.backends.cuda.selfcheck import check_moe_topk
    err = check_moe_topk(kernels, T, E, k, renorm, rng)
    print(f"moe_topk T={T} E={E} k={k} renorm={renorm}: weights rel.err {err:.2e} (inf: an expert id differs)")
    assert err <= TOL


# (gate, up, down) storage types: one type throughout (one fused gate/up launch), and mixes that
# take gate and up apart
TYPES = [(q, q, q) for q in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32, Q.Q5_0, Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q5_K, Q.F16, Q.BF16)]
TYPES += [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q6_K, Q.Q4_K), (Q.Q8_0, Q.F32, Q.Q5_0)]
# lowbit.cuh's types: every one throughout, and a dynamic mix's experts
TYPES += [(q, q, q) for q in (Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.Q3_K, Q.Q2_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS,
                              Q.IQ3_S)]
TYPES += [(Q.IQ4_XS, Q.IQ4_XS, Q.Q5_K), (Q.IQ3_S, Q.IQ3_XXS, Q.Q4_K)]


@pytest.mark.parametrize("types", TYPES, ids=lambda t: "-".join(q.name for q in t))
@pytest.mark.parametrize("T", [1, 8, 37])
def test_experts(kernels, rng, types, T):
    from realizar_backend.backends.cuda.selfcheck import check_moe_experts
    kq = any(QTYPES[q].block == 256 for q in types)
    floats = all(q in (Q.F32, Q.F16, Q.BF16) for q in types)
    # odd shapes: expert FFN and hidden widths in whole blocks of every type involved (floats: any)
    F, H = (256, 512) if kq else ((45, 37) if floats else (96, 160))
    for act in (0, 1):
        err = check_moe_experts(kernels, types, 7, F, H, T, 3, act, rng)
        print(f"moe experts {[q.name for q in types]} T={T} act={act}: rel.err {err:.2e}")
        assert err <= TOL


@pytest.mark.parametrize("types", [(Q.MXFP4,) * 3, (Q.F32,) * 3, (Q.F16, Q.F16, Q.MXFP4), (Q.MXFP4, Q.Q8_0, Q.MXFP4)],
                         ids=["mxfp4", "f32", "f16-mxfp4-down", "mxfp4-q8_0-unfused"])
@pytest.mark.parametrize("T", [1, 8, 37])
def test_experts_gptoss(kernels, rng, types, T):
    """gpt-oss's experts: each expert's gate, up and down biases and the clamped SwiGLU (code 2),
    fused and with gate and up apart (act_mul)."""
    from realizar_backend.backends.cuda.selfcheck import check_moe_experts
    F, H = (96, 160)
    err = check_moe_experts(kernels, types, 8, F, H, T, 4, 2, rng, biases=True)
    print(f"gpt-oss experts {[q.name for q in types]} T={T}: rel.err {err:.2e}")
    assert err <= TOL


# the one-row pairs on mmv8.cu (experts.py expert_pairs8, dispatch.py MOE_PAIRS8): its types
# throughout, and Q4_K_M's and an IQ4_XS file's mixes (a down of another type)
PAIRS8_TYPES = [(q, q, q) for q in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.Q8_0, Q.Q4_0, Q.Q5_1)]
PAIRS8_TYPES += [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.IQ4_XS, Q.IQ4_XS, Q.Q5_K)]


@pytest.mark.parametrize("types", PAIRS8_TYPES, ids=lambda t: "-".join(q.name for q in t))
@pytest.mark.parametrize("T", [1, 4])
def test_experts_pairs8(kernels, rng, types, T):
    """mmv8.cu's pairs (8-bit activations) against float64 over the 8-bit activations they multiply:
    gate and up (and gpt-oss's clamped SwiGLU with every bias), then the down projection of each pair's
    own row; T x 3 pairs over 7 experts."""
    from realizar_backend.backends.cuda.selfcheck import check_moe_experts
    kq = any(QTYPES[q].block == 256 for q in types)
    F, H = (256, 512) if kq else (96, 160)
    for act in (0, 1, 2):
        err = check_moe_experts(kernels, types, 7, F, H, T, 3, act, rng, biases=act == 2, pairs8=True)
        print(f"pairs8 experts {[q.name for q in types]} T={T} act={act}: rel.err {err:.2e}")
        assert err <= TOL


# the one-row pairs' down projection fused with the combine (ops.moe8_down_combine, mmv8.cu
# moe8_down_combine_nb1): (down type, experts, hidden H, expert FFN F, top_k, tokens, biases, a pair out
# of range): Qwen3-30B-A3B's [128, 2048, 768] and gpt-oss-20b's [32, 2880, 2880] with fewer experts (the
# reference dequantizes each it uses), Q4_K_M's Q6_K down, and small stacks of the other MMV8_TYPES
# at several tokens (grid.y) and odd row counts
COMBINE_CASES = [(Q.Q4_K, 16, 2048, 768, 8, 1, False, False), (Q.Q6_K, 16, 2048, 768, 8, 1, False, True),
                 (Q.MXFP4, 6, 2880, 2880, 4, 1, True, False), (Q.MXFP4, 6, 2880, 2880, 4, 1, True, True),
                 (Q.Q5_K, 9, 1000, 512, 8, 3, False, True), (Q.IQ4_XS, 9, 333, 256, 4, 2, True, False),
                 (Q.IQ4_NL, 9, 333, 160, 6, 2, True, True)]


@pytest.mark.parametrize("case", COMBINE_CASES,
                         ids=lambda c: f"{c[0].name}-E{c[1]}-{c[2]}x{c[3]}-top{c[4]}-T{c[5]}"
                                       + ("-bias" if c[6] else "") + ("-bad" if c[7] else ""))
def test_moe8_down_combine(kernels, rng, case):
    """x[t] += sum_j w[t, j] (down_e_j @ a[t top + j] + bd_e_j) in one launch (the path of one-row decode
    steps) against the unfused launches (moe8's down projection into y, then moe_combine: the same sum
    in the same order, so equal up to the compiler's rounding of each, expected bit for bit) and against
    float64 over the 8-bit rows it multiplies; the residual's columns past H untouched; a pair whose id
    is out of range turns its token's row NaN on both paths."""
    import cupy

    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.dispatch import moe8_combine_ok
    from realizar_backend.backends.cuda.selfcheck import _dev, _nan, q8_rows, random_weight, rel_err, upload_weight
    from realizar_backend.formats.quants import dequantize
    qt, E, H, F, top, T, biased, bad = case
    host = random_weight(qt, E * H, F, rng)
    wd, keep = upload_weight(qt, host)
    wd = dataclasses.replace(wd, rows=H, experts=E)
    assert moe8_combine_ok(wd, top)
    ids = np.stack([rng.permutation(E)[:top] for _ in range(T)]).astype(np.int32)
    if bad:
        ids[0, top // 2] = E + 3
    pairs, xs = T * top, H + 4
    a = (rng.standard_normal((pairs, F)) * rng.uniform(0.1, 10.0, (pairs, 1))).astype(np.float32)
    wts = rng.random((T, top)).astype(np.float32)
    bd = rng.normal(0.0, 2.0, (E, H)).astype(np.float32) if biased else np.zeros((E, H), np.float32)
    x0 = rng.standard_normal((T, xs)).astype(np.float32)
    ad, idd, wtd, bdd, xf, xu = (_dev(v) for v in (a, ids, wts, bd, x0, x0))
    bias = bdd.data.ptr if biased else 0
    ops.moe8_down_combine(kernels, wd, idd.data.ptr, top, T, ad.data.ptr, F, xf.data.ptr, xs, wtd.data.ptr, bias)
    y = _nan((pairs, H))
    ops.moe8(kernels, wd, None, idd.data.ptr, pairs, ad.data.ptr, F, 1, y.data.ptr, H, bg=bias)
    ops.moe_combine(kernels, xu.data.ptr, xs, y.data.ptr, H, wtd.data.ptr, top, T, H)
    cupy.cuda.get_current_stream().synchronize()
    got, unfused = xf.get(), xu.get()
    assert np.array_equal(got[:, H:], x0[:, H:]), "columns past H written"
    ok = np.ones(T, bool)
    if bad:
        ok[0] = False
        assert np.all(np.isnan(got[0, :H])) and np.all(np.isnan(unfused[0, :H]))
    if not ok.any():                   # one token, its pair's id out of range: the NaN row is the result
        return
    assert np.all(np.isfinite(got[ok, :H]))
    diff = float(np.max(np.abs(got[ok] - unfused[ok])) / max(float(np.max(np.abs(unfused[ok]))), 1e-30))
    print(f"moe8_down_combine {qt.name} E={E} {H}x{F} top={top} T={T}: fused vs unfused max rel.diff {diff:.1e}"
          f" (bitwise {np.array_equal(got[ok], unfused[ok])})")
    assert diff <= 1e-6
    aq = q8_rows(a)
    deq = {}
    ref = x0[ok].astype(np.float64)
    for i, t in enumerate(np.flatnonzero(ok)):
        for j, e in enumerate(ids[t]):
            if e not in deq:
                deq[e] = dequantize(host[e * H:(e + 1) * H], qt, (H, F)).astype(np.float64)
            ref[i, :H] += float(wts[t, j]) * (deq[e] @ aq[t * top + j] + bd[e])
    err = rel_err(got[ok], ref)
    print(f"  against float64: rel.err {err:.2e}")
    assert err <= TOL


# the grouped path's stacks (mmq.cu types; gate and up of one type): one type throughout, a down of
# another, gpt-oss's MXFP4
GROUPED_TYPES = [(q, q, q) for q in (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q5_0, Q.Q4_0, Q.Q5_K, Q.IQ4_XS, Q.MXFP4)]
GROUPED_TYPES += [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.IQ3_S, Q.IQ3_S, Q.Q4_K)]


def grouped_routing(kind: str, T: int, E: int, k: int, rng) -> np.ndarray | None:
    """A routing [T, k] of the grouped tests: random (None), all rows on experts 0..k-1 (one expert
    of every row, the rest of none), or a third of the experts unused."""
    if kind == "random":
        return None
    if kind == "one-expert":
        return np.tile(np.arange(k, dtype=np.int32), (T, 1))
    return np.stack([rng.choice(np.arange(E // 3, E), k, replace=False) for _ in range(T)]).astype(np.int32)


@pytest.mark.parametrize("types", GROUPED_TYPES, ids=lambda t: "-".join(q.name for q in t))
@pytest.mark.parametrize("T", [1, 8, 37, 200])
@pytest.mark.parametrize("routing", ["random", "one-expert", "unused-experts"])
@pytest.mark.parametrize("records", ["fp16", "a8"])
def test_experts_grouped(kernels, rng, types, T, routing, records):
    """The grouped path (experts.py expert_groups: bucketing, mmq.cu's grouped tiles, combine) at the
    per-pair path's bound, tile heights 8 to 64 (T x 3 pairs over 7 experts), on fp16 records and on
    8-bit ones (mmq8_moe_bnBN, where every stack is of dispatch.MMQ8_TYPES: against the activations
    as quantized)."""
    from realizar_backend.backends.cuda.dispatch import MMQ8_TYPES
    from realizar_backend.backends.cuda.selfcheck import check_moe_experts
    a8 = records == "a8"
    if a8 and not all(q in MMQ8_TYPES for q in types):
        pytest.skip("a stack of a type the 8-bit variant does not take")
    kq = any(QTYPES[q].block == 256 for q in types)
    F, H = (256, 512) if kq else (96, 160)
    for act in (0, 1, 2):
        err = check_moe_experts(kernels, types, 7, F, H, T, 3, act, rng, biases=act == 2, grouped=True,
                                ids=grouped_routing(routing, T, 7, 3, rng), a8=a8)
        print(f"grouped experts {[q.name for q in types]} T={T} {routing} act={act} {records}: rel.err {err:.2e}")
        assert err <= TOL


@pytest.mark.parametrize("T", [37, 512])
@pytest.mark.parametrize("a8", [False, True], ids=["fp16", "a8"])
def test_experts_grouped_bitwise_repeat(kernels, rng, T, a8):
    """The grouped path twice on the same inputs gives the same bits (no order-dependent float
    atomics: integer counts, one CTA an output, the combine's fixed order), on Qwen3-30B-A3B's
    expert count and top k at a narrow width, on either kind of records."""
    import cupy
    from realizar_backend.backends.cuda.experts import GroupedBuffers, expert_groups
    from realizar_backend.backends.cuda.mmq import bn_limits as mmq_bn_limits
    from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight
    E, top, F, H = 128, 8, 256, 512
    mats, keep = [], []
    for r, c in ((F, H), (F, H), (H, F)):
        w, dev = upload_weight(Q.Q4_K, random_weight(Q.Q4_K, E * r, c, rng))
        mats.append(dataclasses.replace(w, rows=r, experts=E))
        keep.append(dev)
    ids = cupy.asarray(np.stack([rng.permutation(E)[:top] for _ in range(T)]).astype(np.int32))
    h = cupy.asarray(rng.standard_normal((T, H)).astype(np.float32))
    buf = GroupedBuffers(T, top, E, H, F, mmq_bn_limits(kernels, (a8,)))
    ys = [cupy.full((T * top, H), np.nan, cupy.float32) for _ in range(2)]
    for y in ys:
        expert_groups(kernels, *mats, ids.data.ptr, top, T, h.data.ptr, H, y.data.ptr, H, 0, buf, a8=a8)
    a, b = (y.get() for y in ys)
    assert np.all(np.isfinite(a))
    assert a.tobytes() == b.tobytes()


@pytest.fixture(scope="module", params=["f32", "q4k"])
def moe_model(request):
    path = model_path(request.param)
    if path is None:
        pytest.skip(f"tiny qwen3moe {request.param} not made: python tests/support/moe_models.py DIR, then "
                    f"REALIZAR_MOE_MODELS=DIR")
    from realizar_backend.formats import open_model
    return request.param, open_model(path)


@pytest.mark.parametrize("path", ["pairs", "grouped"])
@pytest.mark.usefixtures("fp16_expert_records")
def test_model_parity(moe_model, rng, monkeypatch, path):
    """Prompt steps on the GEMVs (a few tokens), the tensor-core buckets or GEMVs (eight short prompts
    at once) and the split16 GEMMs (100 tokens), then decode steps of one row and of eight rows
    (captured graphs, replayed): every row's logits at cosine >= COS_MIN to the NumPy backend's.
    path: the routed experts on the per-pair GEMVs, or forced onto the grouped tiles at every row
    count (dispatch.MOE_GROUPED_MIN_ROWS = 1; stacks without mmq.cu kernels, the F32 model's, stay
    on the pairs)."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import dispatch
    monkeypatch.setattr(dispatch, "MOE_GROUPED_MIN_ROWS", 1 if path == "grouped" else None)
    name, model = moe_model
    if path == "grouped" and name == "f32":
        pytest.skip("F32 stacks have no mmq.cu kernel: the grouped path does not take them")
    cpu, gpu = _backends(model, slots=8, ctx=256)
    assert gpu.fwd.model.layers[0].ffn.gate.experts == model.config.n_experts
    V = model.config.vocab_size
    lens = [100, 5] + [int(n) for n in rng.integers(3, 12, 6)]
    steps = [[PrefillItem(1, rng.integers(0, V, lens[1]).astype(np.int32))],
             [PrefillItem(s, rng.integers(0, V, lens[s]).astype(np.int32)) for s in range(2, 8)],
             [PrefillItem(0, rng.integers(0, V, lens[0]).astype(np.int32))]]
    run = ParityRun(cpu, gpu, rng, V, slots=8)
    for items in steps:
        run.prompt(items)
    for rows, n_steps in ((1, 4), (8, 6)):
        run.decode(list(range(rows)), n_steps)
    run.finish_greedy("qwen3moe", name)
