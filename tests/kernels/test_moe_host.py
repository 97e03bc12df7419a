"""kernels/moe.cu run on the CPU (tests/host/moe_emu.cpp over cuda_emu.h: every thread a fiber, the
warp shuffles rendezvous of the real 32 lanes) against NumPy in float64: the routing (model/math.py
route: top k of a softmax, ties to the lower index, renormalised or not) on logits with ties and
row strides whose padding would win if read; the experts' gated MLP over (row, expert) pairs and
the per-pair GEMV (the down projection, and gate or up alone) with each pair's expert read through
its id, on stacks of Q4_K, Q6_K, Q8_0 (in their device layouts, formats/gpu_layout.py) and F32
experts at odd shapes; gpt-oss's experts (per-expert biases, the clamped SwiGLU); the weighted sum
into the residual and a shared expert's gated output; and the chain of the four as
backends/cuda/experts.py launches them. Outputs are poisoned before each launch and every value
past the rows must stay so. The GPU tests (tests/gpu/test_moe.py) check the same on the device.
Skipped where g++ is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.formats.gpu_layout import device_row_bytes, to_device
from realizar_backend.formats.quants import dequantize
from realizar_backend.model.math import SWIGLU_LIMIT, gelu_tanh, route, silu, swiglu_oai
from support import host_emu
from support.host_emu import GXX
from support.synth import TOLERANCE, quantize, random_quant

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

F64 = np.float64
TOL = 2e-5                # error over sum |w x|: fp32 dot products (the GEMVs' bound)
# and of lowbit.cuh's decoders: a stack of MXFP4 experts in its device layout (gpt-oss), of IQ4_XS and
# of Q3_K (dynamic mixes' experts), of IQ2_XXS (a codebook type)
TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32, Q.MXFP4, Q.IQ4_XS, Q.Q3_K, Q.IQ2_XXS]
SFX = {q: q.name.lower() for q in TYPES}
# (E experts, F expert FFN rows, H hidden) per type: rows no 4-row block divides; K-quants take
# whole 256-weight blocks, Q8_0 32-weight units, F32 any width (a row ending inside a unit)
SHAPES = {Q.Q4_K: (5, 37, 256), Q.Q6_K: (4, 19, 512), Q.Q8_0: (6, 45, 96), Q.F32: (5, 29, 45),
          Q.MXFP4: (4, 21, 160), Q.IQ4_XS: (3, 23, 256), Q.Q3_K: (4, 17, 512), Q.IQ2_XXS: (3, 19, 256)}
# the expert FFN widths of the down projections (its columns): whole blocks of each type
DOWN_F = {Q.Q4_K: 256, Q.Q6_K: 256, Q.Q8_0: 64, Q.F32: 37, Q.MXFP4: 96, Q.IQ4_XS: 256, Q.Q3_K: 256, Q.IQ2_XXS: 256}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return host_emu.build("moe_emu.cpp", tmp_path_factory.mktemp("moe_emu") / "moe_emu")


class Launch:
    """One kernel launch in the emulator: its directory, scalar parameters and arrays."""

    def __init__(self, emu, tmp_path: Path, kernel: str, **params):
        self.emu, self.kernel, self.params = emu, kernel, params
        self.dir = tmp_path / f"launch{len(list(tmp_path.iterdir()))}"
        self.dir.mkdir()

    def run(self, outputs: dict[str, np.dtype], **arrays: np.ndarray) -> dict[str, np.ndarray]:
        return host_emu.launch(self.emu, self.dir, {"kernel": self.kernel, **self.params}, arrays, outputs,
                               label=self.kernel)


def stack(qtype, E: int, rows: int, cols: int, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """E experts' random [rows, cols] matrices, quantized as a converter would: (device bytes of the
    stack, its float64 weights [E, rows, cols], bytes a row on the device)."""
    w = (rng.standard_normal((E * rows, cols)) * rng.uniform(0.05, 0.3, (E * rows, 1))).astype(np.float32)
    # types gguf-py cannot quantize: valid random blocks of the same spread (synth.random_quant)
    raw = quantize(w, qtype) if qtype in TOLERANCE else random_quant(qtype, E * rows, cols, float(w.std()), rng)
    dev = to_device(qtype, np.ascontiguousarray(raw).view(np.uint8).reshape(E * rows, -1), cols)
    return dev, dequantize(raw, qtype, (E, rows, cols)).astype(F64), device_row_bytes(qtype, cols)


def routing(rng, T: int, E: int, k: int) -> np.ndarray:
    """Each row's k distinct experts (rows share some), int32 [T, k]."""
    return np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)


def act_of(g: np.ndarray, act: int) -> np.ndarray:
    return gelu_tanh(g) if act else silu(g)


def err(got: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> float:
    got = np.asarray(got, F64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30)))


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    """An output before its launch: NaN (floats), -1 (expert ids)."""
    return np.full(shape, -1 if dtype == np.int32 else np.nan, dtype)


# ------------------------------------------------------------------ routing
@pytest.mark.parametrize("T,E,k,renorm", [(5, 8, 2, True), (7, 67, 8, True), (6, 128, 8, False), (3, 5, 5, True),
                                          (4, 256, 8, False), (9, 300, 32, True), (4, 300, 8, False)],
                         ids=["qwen3moe-tiny", "67-experts", "128-no-renorm", "all-experts",
                              "256-held-no-renorm", "300-experts-k32", "300-read-no-renorm"])
def test_topk(emu, tmp_path, T, E, k, renorm):
    rng = np.random.default_rng(E * 31 + k)
    z = (3.0 * rng.standard_normal((T, E))).astype(np.float32)
    z[:, E - 1] = z[:, 0]                           # a tie in every row: the lower index first
    z[1, [0, E // 2]] = z[1].max() + 1.0            # a tie at the top
    z[2, rng.choice(E, min(E, 40), replace=False)] = z[2, 3]     # many equal logits
    ls = E + 5
    padded = np.full((T, ls), np.inf, np.float32)   # read past E, the padding would win
    padded[:, :E] = z
    out = Launch(emu, tmp_path, "topk", T=T, E=E, k=k, ls=ls, renorm=int(renorm)).run(
        {"ids": np.int32, "w": np.float32}, logits=padded, ids=poisoned((T, k), np.int32), w=poisoned((T, k)))
    ref_ids, ref_w = route(z, k, renorm)
    ids, w = out["ids"].reshape(T, k), out["w"].reshape(T, k)
    assert np.array_equal(ids, ref_ids), f"ids\n{ids}\nexpected\n{ref_ids}"
    assert np.max(np.abs(w - ref_w) / ref_w) < 1e-5
    if renorm:
        assert np.allclose(w.sum(axis=1), 1.0, atol=1e-6)


# ------------------------------------------------------------------ the experts' projections
def gate_up(emu, tmp_path, rng, qtype, act: int, T: int = 3, k: int = 2, bad_id: bool = False, biases=None):
    """biases: (bg, bu) float32 [E, F] each, or None."""
    E, F, H = SHAPES[qtype]
    (wg, g64, rb), (wu, u64, _) = stack(qtype, E, F, H, rng), stack(qtype, E, F, H, rng)
    ids = routing(rng, T, E, k)
    if bad_id:
        ids[1, 0] = E                                # out of range: NaN, never a read past the stack
    xs, os = H + 3, F + 5
    x = (rng.standard_normal((T, xs)) * rng.uniform(0.3, 3.0, (T, 1))).astype(np.float32)
    pairs = T * k
    extra = {} if biases is None else dict(bg=biases[0], bu=biases[1])
    out = Launch(emu, tmp_path, f"gate_up_{SFX[qtype]}", row_bytes=rb, expert_bytes=F * rb, E=E, N=F, K=H,
                 pairs=pairs, xs=xs, os=os, k=k, act=act).run(
        {"out": np.float32}, wg=wg, wu=wu, ids=ids, x=x, out=poisoned((pairs, os)),
        **extra)["out"].reshape(pairs, os)
    return out, ids, x[:, :H].astype(F64), g64, u64, F, E


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu"])
def test_gate_up(emu, tmp_path, qtype, act):
    rng = np.random.default_rng(int(qtype) * 7 + act)
    out, ids, x, g64, u64, F, E = gate_up(emu, tmp_path, rng, qtype, act)
    k = ids.shape[1]
    for p, e in enumerate(ids.ravel()):
        h = x[p // k]
        g, u = g64[e] @ h, u64[e] @ h
        ref = act_of(g, act) * u
        scale = 1.2 * (np.abs(g64[e]) @ np.abs(h)) * np.abs(u) + np.abs(act_of(g, act)) * (np.abs(u64[e]) @ np.abs(h))
        e_ = err(out[p, :F], ref, scale)
        assert e_ <= TOL, f"{qtype.name} pair {p} (expert {e}): error {e_:.2e}"
    assert np.all(np.isnan(out[:, F:])), "values past the rows were written"


# gpt-oss's experts: MXFP4 in the real files; F32 and Q8_0 stacks beside them
@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_gate_up_gptoss(emu, tmp_path, qtype):
    """Each pair's gate and up plus its expert's biases, then the clamped SwiGLU (act 2) as the
    NumPy backend computes it (model/math.py swiglu_oai); values on both sides of the clamps."""
    rng = np.random.default_rng(int(qtype) + 101)
    E, F, _ = SHAPES[qtype]
    bg, bu = (rng.normal(0.0, 4.0, (E, F)).astype(np.float32) for _ in range(2))
    out, ids, x, g64, u64, F, E = gate_up(emu, tmp_path, rng, qtype, 2, T=4, biases=(bg, bu))
    k = ids.shape[1]
    gs, us = [], []
    for p, e in enumerate(ids.ravel()):
        h = x[p // k]
        g, u = g64[e] @ h + bg[e], u64[e] @ h + bu[e]
        gs.append(g)
        us.append(u)
        ref = swiglu_oai(g, u)
        gc, uc = np.minimum(g, SWIGLU_LIMIT), np.clip(u, -SWIGLU_LIMIT, SWIGLU_LIMIT)
        # the clamped terms' error bound: a rounding of each sum, through the function's slopes
        scale = 1.2 * (np.abs(g64[e]) @ np.abs(h) + np.abs(bg[e])) * (np.abs(uc) + 1.0) + \
            np.abs(gc) * (np.abs(u64[e]) @ np.abs(h) + np.abs(bu[e]))
        e_ = err(out[p, :F], ref, scale)
        assert e_ <= TOL, f"{qtype.name} pair {p} (expert {e}): error {e_:.2e}"
    gs, us = np.concatenate(gs), np.concatenate(us)
    assert np.any(gs > SWIGLU_LIMIT) and np.any(us > SWIGLU_LIMIT) and np.any(us < -SWIGLU_LIMIT)
    assert np.all(np.isnan(out[:, F:])), "values past the rows were written"


def test_gate_up_out_of_range_expert_gives_nan(emu, tmp_path):
    rng = np.random.default_rng(3)
    out, ids, *_, F, E = gate_up(emu, tmp_path, rng, Q.Q8_0, 0, bad_id=True)
    k = ids.shape[1]
    assert np.all(np.isnan(out[k, :F]))                    # pair (row 1, expert E)
    others = [p for p in range(ids.size) if p != k]
    assert np.all(np.isfinite(out[others, :F]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("xdiv", ["down", "gate", "down-bias"])
def test_pair_gemv(emu, tmp_path, qtype, xdiv):
    """y[p] = W_e x[p]: the down projection (each pair its own input row; gpt-oss: plus its
    expert's bias), and x[p // k]: gate or up on its own (each pair its token's row)."""
    rng = np.random.default_rng(int(qtype) * 13 + len(xdiv))
    bias = xdiv == "down-bias"
    xdiv = "down" if bias else xdiv
    E = SHAPES[qtype][0]
    T, k = 4, 3
    if xdiv == "down":
        N, K = SHAPES[qtype][2] - 3, DOWN_F[qtype]      # rows: a hidden size no 4-row block divides
    else:
        N, K = SHAPES[qtype][1], SHAPES[qtype][2]
    dev, w64, rb = stack(qtype, E, N, K, rng)
    ids = routing(rng, T, E, k)
    pairs = T * k
    div = 1 if xdiv == "down" else k
    xs, os = K + 4, N + 2
    x = rng.standard_normal((pairs // div, xs)).astype(np.float32)
    b = rng.normal(0.0, 2.0, (E, N)).astype(np.float32) if bias else np.zeros((E, N), np.float32)
    out = Launch(emu, tmp_path, f"gemv_{SFX[qtype]}", row_bytes=rb, expert_bytes=N * rb, E=E, N=N, K=K,
                 pairs=pairs, xs=xs, os=os, xdiv=div).run(
        {"out": np.float32}, w=dev, ids=ids, x=x, out=poisoned((pairs, os)),
        **(dict(b=b) if bias else {}))["out"].reshape(pairs, os)
    for p, e in enumerate(ids.ravel()):
        h = x[p // div, :K].astype(F64)
        e_ = err(out[p, :N], w64[e] @ h + b[e], np.abs(w64[e]) @ np.abs(h) + np.abs(b[e]))
        assert e_ <= TOL, f"{qtype.name} pair {p}: error {e_:.2e}"
    assert np.all(np.isnan(out[:, N:]))


# ------------------------------------------------------------------ into the residual
def test_combine(emu, tmp_path):
    rng = np.random.default_rng(5)
    T, k, H = 5, 3, 300                               # two blocks of columns, the second part empty
    xs, ys = H + 2, H + 7
    x = rng.standard_normal((T, xs)).astype(np.float32)
    y = rng.standard_normal((T * k, ys)).astype(np.float32)
    y[:, H:] = np.nan                                 # never read
    w = rng.random((T, k)).astype(np.float32)
    x[:, H:] = np.nan                                 # never written
    got = Launch(emu, tmp_path, "combine", T=T, k=k, H=H, xs=xs, ys=ys).run(
        {"x": np.float32}, x=x, y=y, w=w)["x"].reshape(T, xs)
    ref = x[:, :H].astype(F64) + np.einsum("tj,tjh->th", w.astype(F64), y[:, :H].reshape(T, k, H).astype(F64))
    scale = np.abs(x[:, :H]) + np.einsum("tj,tjh->th", w, np.abs(y[:, :H]).reshape(T, k, H))
    assert err(got[:, :H], ref, scale) <= 1e-6
    assert np.all(np.isnan(got[:, H:]))


def test_shared_add(emu, tmp_path):
    """A shared expert's output into the residual, weighted by the sigmoid of its gate logit."""
    rng = np.random.default_rng(11)
    T, H = 4, 300
    xs, ys = H + 2, H + 5
    x = rng.standard_normal((T, xs)).astype(np.float32)
    x[:, H:] = np.nan                                 # never written
    y = rng.standard_normal((T, ys)).astype(np.float32)
    y[:, H:] = np.nan                                 # never read
    s = (3.0 * rng.standard_normal(T)).astype(np.float32)
    got = Launch(emu, tmp_path, "shared_add", T=T, H=H, xs=xs, ys=ys).run(
        {"x": np.float32}, x=x, y=y, s=s)["x"].reshape(T, xs)
    gate = 1.0 / (1.0 + np.exp(-s.astype(F64)))
    ref = x[:, :H].astype(F64) + gate[:, None] * y[:, :H]
    assert err(got[:, :H], ref, np.abs(x[:, :H]) + np.abs(y[:, :H])) <= 1e-6
    assert np.all(np.isnan(got[:, H:]))


# ------------------------------------------------------------------ the chain
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q6_K, Q.Q8_0)],
                         ids=["q4_k_m-fused", "mixed-unfused"])
def test_chain(emu, tmp_path, types):
    """Router logits -> moe_topk -> the experts (one fused gate/up launch, or gate and up apart and
    their product) -> the down projections -> moe_combine, through workspace-like buffers (pair rows
    of a, y rows of max(H, 2 F)), against the NumPy backend's math."""
    rng = np.random.default_rng(len(set(types)))
    T, E, k, F, H = 5, 6, 2, 256, 256                  # F: the down projections' columns, whole blocks
    tg, tu, td = types
    (wg, g64, rbg), (wu, u64, rbu), (wd, d64, rbd) = (stack(tg, E, F, H, rng), stack(tu, E, F, H, rng),
                                                       stack(td, E, H, F, rng))
    h = rng.standard_normal((T, H)).astype(np.float32)
    logits = (2.0 * rng.standard_normal((T, E))).astype(np.float32)
    x0 = rng.standard_normal((T, H)).astype(np.float32)
    out = Launch(emu, tmp_path, "topk", T=T, E=E, k=k, ls=E, renorm=1).run(
        {"ids": np.int32, "w": np.float32}, logits=logits, ids=poisoned((T, k), np.int32), w=poisoned((T, k)))
    ids, w = out["ids"].reshape(T, k), out["w"].reshape(T, k)
    pairs, ys = T * k, max(H, 2 * F)
    fused = tg == tu
    if fused:
        a = Launch(emu, tmp_path, f"gate_up_{SFX[tg]}", row_bytes=rbg, expert_bytes=F * rbg, E=E, N=F, K=H,
                   pairs=pairs, xs=H, os=F, k=k, act=0).run(
            {"out": np.float32}, wg=wg, wu=wu, ids=ids, x=h, out=poisoned((pairs, F)))["out"]
    else:
        g, u = (Launch(emu, tmp_path, f"gemv_{SFX[t]}", row_bytes=rb, expert_bytes=F * rb, E=E, N=F, K=H,
                       pairs=pairs, xs=H, os=F, xdiv=k).run(
            {"out": np.float32}, w=dev, ids=ids, x=h, out=poisoned((pairs, F)))["out"]
            for t, dev, rb in ((tg, wg, rbg), (tu, wu, rbu)))
        a = (silu(g.astype(F64)) * u).astype(np.float32)        # act_mul (elementwise.cu, checked elsewhere)
    y = Launch(emu, tmp_path, f"gemv_{SFX[td]}", row_bytes=rbd, expert_bytes=H * rbd, E=E, N=H, K=F,
               pairs=pairs, xs=F, os=ys, xdiv=1).run(
        {"out": np.float32}, w=wd, ids=ids, x=a, out=poisoned((pairs, ys)))["out"]
    got = Launch(emu, tmp_path, "combine", T=T, k=k, H=H, xs=H, ys=ys).run(
        {"x": np.float32}, x=x0, y=y, w=w)["x"].reshape(T, H)
    ref_ids, ref_w = route(logits, k, True)
    assert np.array_equal(ids, ref_ids)
    ref = x0.astype(F64)
    for t in range(T):
        h64 = h[t].astype(F64)
        for j, e in enumerate(ref_ids[t]):
            ref[t] += float(ref_w[t, j]) * (d64[e] @ (silu(g64[e] @ h64) * (u64[e] @ h64)))
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"chain {[t.name for t in types]}: relative error {rel:.2e}")
    assert rel <= 1e-5


def test_chain_gptoss(emu, tmp_path):
    """gpt-oss's experts end to end as experts.py launches them: router logits with the router's
    bias (added by the router's GEMV) -> moe_topk (softmax over the top k: renormalised) -> MXFP4
    gate/up with their biases and the clamped SwiGLU -> MXFP4 down plus its bias -> moe_combine,
    against the NumPy backend's math (backends/cpu.py norm_moe_residual)."""
    rng = np.random.default_rng(17)
    T, E, k, F, H = 6, 8, 4, 64, 96
    (wg, g64, rb), (wu, u64, _), (wd, d64, rbd) = (stack(Q.MXFP4, E, F, H, rng), stack(Q.MXFP4, E, F, H, rng),
                                                    stack(Q.MXFP4, E, H, F, rng))
    bg, bu = (rng.normal(0.0, 3.0, (E, F)).astype(np.float32) for _ in range(2))
    bd = rng.normal(0.0, 1.0, (E, H)).astype(np.float32)
    h = (2.0 * rng.standard_normal((T, H))).astype(np.float32)
    logits = (2.0 * rng.standard_normal((T, E))).astype(np.float32)     # router output, bias included
    x0 = rng.standard_normal((T, H)).astype(np.float32)
    out = Launch(emu, tmp_path, "topk", T=T, E=E, k=k, ls=E, renorm=1).run(
        {"ids": np.int32, "w": np.float32}, logits=logits, ids=poisoned((T, k), np.int32), w=poisoned((T, k)))
    ids, w = out["ids"].reshape(T, k), out["w"].reshape(T, k)
    pairs, ys = T * k, max(H, 2 * F)
    a = Launch(emu, tmp_path, "gate_up_mxfp4", row_bytes=rb, expert_bytes=F * rb, E=E, N=F, K=H, pairs=pairs,
               xs=H, os=F, k=k, act=2).run(
        {"out": np.float32}, wg=wg, wu=wu, ids=ids, x=h, out=poisoned((pairs, F)), bg=bg, bu=bu)["out"]
    y = Launch(emu, tmp_path, "gemv_mxfp4", row_bytes=rbd, expert_bytes=H * rbd, E=E, N=H, K=F, pairs=pairs,
               xs=F, os=ys, xdiv=1).run(
        {"out": np.float32}, w=wd, ids=ids, x=a, out=poisoned((pairs, ys)), b=bd)["out"]
    got = Launch(emu, tmp_path, "combine", T=T, k=k, H=H, xs=H, ys=ys).run(
        {"x": np.float32}, x=x0, y=y, w=w)["x"].reshape(T, H)
    ref_ids, ref_w = route(logits, k, True)
    assert np.array_equal(ids, ref_ids)
    ref = x0.astype(F64)
    for t in range(T):
        h64 = h[t].astype(F64)
        for j, e in enumerate(ref_ids[t]):
            act = swiglu_oai(g64[e] @ h64 + bg[e], u64[e] @ h64 + bu[e])
            ref[t] += float(ref_w[t, j]) * (d64[e] @ act + bd[e])
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"chain gpt-oss: relative error {rel:.2e}")
    assert rel <= 1e-5
