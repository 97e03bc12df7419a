"""kernels/mmv8.cu (the one-row GEMVs on 8-bit activations) run on the CPU (tests/host/mmv8_emu.cpp
over cuda_emu.h: every thread a fiber, the warp shuffles rendezvous of the real 32 lanes, warps at
random speeds) against NumPy in float64, for every type the kernel takes, in the device layouts
(formats/gpu_layout.py): the activations quantized by mmv8_q8, whose twin is `q8_twin` (per 32 values,
d = max|x| / 127, q = rint(x / d)), then W @ (q d) in float64; the error is measured against sum |w x|
as the GPU self-check does. Shapes whose units leave a lane pass part-empty, rows no row group or
block divides, grids smaller than the row groups (blocks stride over them), every warps-per-row
the host may pick; the segments, bias, residual, folded RMSNorm and argmax of mmv8, ffn8's fused
gate/up with both activations, and the experts' pairs (moe8) with their down projection fused with
the combine into the residual. Outputs are poisoned before each launch and what lies past
the rows must stay so. A changed copy of the kernel must fail (the checks can fail), and the
outputs must be bitwise the same whatever the warps' speeds (the split of K is reduced in a fixed
order). The GPU tests (tests/gpu/test_kernels_f32.py) check the same launches on the device.
Skipped where g++ is absent."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.formats.gpu_layout import device_row_bytes, to_device
from realizar_backend.formats.quants import dequantize, random_matrix
from realizar_backend.kernels import catalog
from realizar_backend.model.math import gelu_tanh, silu
from support import host_emu
from support.host_emu import GXX, KERNELS
from support.q8 import normed, q8_twin

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

TOL = 2e-5     # error over sum |w x| against the quantized activations: fp32 arithmetic
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]   # mmv8.cu's
# (rows, K, warps per row, grid.x): K of 5 units (a pass of 32 lanes mostly empty), 41 and 152 units
# (passes ending part-way), 256-weight types at 1, 9 and 19 blocks; rows no group of 2 divides;
# grids smaller than the groups need
SHAPES = {32: [(37, 160, 1, 3), (5, 1312, 2, 1), (61, 4864, 16, 7)],
          256: [(37, 256, 1, 3), (5, 2304, 4, 2), (33, 4864, 16, 5)]}
WARPS = catalog.MMV8_WARPS


def _exe(tmp_path_factory, kind: int, include_first=None, tag: str = "", ring: int | None = None):
    """The emulator of kind `kind` with the loader's defines (ring: MMV8_RING instead of the catalog's)."""
    d = tmp_path_factory.mktemp(f"mmv8_{kind}{tag}")
    opts = catalog.mmv8_options(kind)
    if ring is not None:
        opts = tuple(o for o in opts if not o.startswith("-DMMV8_RING=")) + (f"-DMMV8_RING={ring}",)
    flags = ("-std=c++17", "-O1") + opts
    return host_emu.build("mmv8_emu.cpp", d / "mmv8_emu", flags=flags, include_first=include_first)


def _mutant(tmp_path_factory, kind: int, name: str, old: str, new: str, ring: int | None = None):
    """The emulator of kind `kind` built on mmv8.cu with its one `old` replaced by `new`."""
    src = (KERNELS / "mmv8.cu").read_text()
    assert src.count(old) == 1, f"the mutation {name} no longer applies"
    d = tmp_path_factory.mktemp(f"broken_{name}")
    (d / "mmv8.cu").write_text(src.replace(old, new))
    return _exe(tmp_path_factory, kind, include_first=d, tag=name, ring=ring)


@pytest.fixture(scope="module")
def emu1(tmp_path_factory):
    return _exe(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def emu2(tmp_path_factory):
    return _exe(tmp_path_factory, 2)


def weight(qt, rows: int, cols: int, rng):
    raw = random_matrix(qt, rows, cols, rng)
    return to_device(qt, raw, cols), device_row_bytes(qt, cols), dequantize(raw, qt, (rows, cols)).astype(np.float64)


def err(got, ref, scale) -> float:
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(scale), 1e-30))


def run_mmv8(exe, tmp_path, segs, K: int, nb: int, wpr: int, grid_x: int, rng, bias=False, accumulate=False,
             norm=False, amax=False, xs=None, env=None):
    """One mmv8_nb1 launch over segs = [(qtype, rows)]; returns (max error, outputs, amax)."""
    xs = xs or K
    x = (rng.standard_normal((nb, xs)) * rng.uniform(0.1, 30.0, (nb, 1))).astype(np.float32)
    nw = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32) if norm else None
    eps = 1e-6
    xin = [normed(x[b, :K], nw, eps) if norm else x[b, :K] for b in range(nb)]
    xq = np.stack([q8_twin(v) for v in xin])
    params = {"kernel": "mmv8", "K": K, "xs": xs, "nb": nb, "wpr": wpr, "eps": eps, "grid_x": grid_x,
              "segments": len(segs), "accumulate": int(accumulate)}
    arrays = {"x": x}
    if norm:
        arrays["nw"] = nw
    checks, outputs = [], {}
    for s, (qt, n) in enumerate(segs):
        dev, rb, w64 = weight(qt, n, K, rng)
        ys = n + 3
        y0 = rng.standard_normal((nb, ys)).astype(np.float32) if accumulate else np.full((nb, ys), np.nan, np.float32)
        arrays[f"w{s}"], arrays[f"y{s}"] = dev, y0
        params.update({f"rb{s}": rb, f"n{s}": n, f"qt{s}": int(qt), f"ys{s}": ys})
        ref, scale = xq @ w64.T, np.abs(xq) @ np.abs(w64).T
        if bias:
            b = rng.standard_normal(n).astype(np.float32)
            arrays[f"b{s}"] = b
            ref, scale = ref + b, scale + np.abs(b)
        if accumulate:
            ref, scale = ref + y0[:, :n], scale + np.abs(y0[:, :n])
        checks.append((s, n, y0, ref, scale))
        outputs[f"y{s}"] = (np.float32, (nb, ys))
    if amax:
        arrays["amax"] = np.zeros(nb, np.uint64)
        outputs["amax"] = np.uint64
    res = host_emu.launch(exe, tmp_path / f"l{len(list(tmp_path.iterdir()))}", params, arrays, outputs, env=env,
                          label="mmv8")
    errs = []
    for s, n, y0, ref, scale in checks:
        got = res[f"y{s}"]
        tail = np.array_equal(got[:, n:], y0[:, n:], equal_nan=True)
        errs.append(err(got[:, :n], ref, scale) if tail else float("inf"))
    return max(errs), res


def _cases():
    from realizar_backend.backends.cuda.matrices import QTYPES
    return [(q, *shape) for q in TYPES for shape in SHAPES[QTYPES[q].block]]


def _id(c):
    return f"{c[0].name}-{c[1]}x{c[2]}-wpr{c[3]}-grid{c[4]}"


@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_mmv8_every_type(emu1, tmp_path, case):
    qt, n, K, wpr, grid_x = case
    rng = np.random.default_rng(n * K + int(qt) + wpr)
    e, _ = run_mmv8(emu1, tmp_path, [(qt, n)], K, 1, wpr, grid_x, rng)
    assert e <= TOL, f"{_id(case)}: {e:.2e}"


def test_mmv8_segments_bias_residual_rows(emu1, tmp_path):
    """Three segments of three types sharing one input (a padded row stride), with bias; then into
    the residual; two activation rows (grid.y)."""
    rng = np.random.default_rng(5)
    segs = [(Q.Q4_K, 37), (Q.Q6_K, 5), (Q.Q8_0, 9)]
    e1, _ = run_mmv8(emu1, tmp_path, segs, 768, 2, 2, 4, rng, bias=True, xs=772)
    e2, _ = run_mmv8(emu1, tmp_path, segs[:2], 768, 1, 4, 2, rng, bias=True, accumulate=True)
    assert max(e1, e2) <= TOL, (e1, e2)


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_mmv8_folded_norm_and_argmax(emu1, tmp_path, qt):
    """RMSNorm folded into the quantization, and the argmax of the outputs (the LM head's fold):
    the packed key holds the largest output and its row."""
    rng = np.random.default_rng(int(qt))
    e, res = run_mmv8(emu1, tmp_path, [(qt, 45)], 2304, 1, 2, 3, rng, norm=True, amax=True)
    assert e <= TOL, e
    y = res["y0"][0, :45]
    key = int(res["amax"][0])
    assert 0xFFFFFFFF - (key & 0xFFFFFFFF) == int(np.argmax(y))


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu"])
def test_ffn8_gate_up(emu2, tmp_path, qt, act):
    """act(gate . x) * (up . x) over rows no block divides, a row of 48 units (K = 1536: a pass
    half-empty) with the norm folded in, at two warps per row."""
    from realizar_backend.backends.cuda.matrices import QTYPES
    rng = np.random.default_rng(int(qt) * 3 + act)
    N, K = 41, (1536 if QTYPES[qt].block == 256 else 1312)
    (dg, rb, wg64), (du, _, wu64) = weight(qt, N, K, rng), weight(qt, N, K, rng)
    x = rng.standard_normal(K).astype(np.float32)
    nw = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    xq = q8_twin(normed(x, nw, 1e-6))
    a0 = np.full(N + 5, np.nan, np.float32)
    params = {"kernel": "ffn8", "K": K, "xs": K, "nb": 1, "wpr": 2, "eps": 1e-6, "grid_x": 3, "rb": rb, "N": N,
              "qt": int(qt), "act": act, "as": N + 5}
    res = host_emu.launch(emu2, tmp_path / "ffn", params, {"x": x, "nw": nw, "wg": dg, "wu": du, "a": a0},
                          {"a": np.float32}, label="ffn8")
    got = res["a"]
    assert np.all(np.isnan(got[N:]))
    g, u = wg64 @ xq, wu64 @ xq
    ag = gelu_tanh(g) if act else silu(g)
    scale = 1.2 * (np.abs(wg64) @ np.abs(xq)) * np.abs(u) + np.abs(ag) * (np.abs(wu64) @ np.abs(xq))
    e = err(got[:N], ag * u, scale)
    assert e <= TOL, e


def test_outputs_bitwise_the_same_at_any_warp_speed(emu1, tmp_path):
    """The split of a row over 16 warps is summed in warp order: two runs whose warps drift apart
    differently (EMU_SEED) give the same bits."""
    outs = []
    for seed in ("1", "977"):
        rng = np.random.default_rng(11)
        _, res = run_mmv8(emu1, tmp_path, [(Q.Q4_K, 21)], 4864, 1, 16, 3, rng, env={"EMU_SEED": seed})
        outs.append(res["y0"])
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


# changed copies of the kernel that must fail the checks (and the type each is seen with): Q4_K's
# high nibbles against the low nibbles' activations, a unit's second half read from its first
# half's place, and the quantization's scale off by one step
BROKEN = {"q4k_half": ("*(const int4*)(sm + ao + 128)", "*(const int4*)(sm + ao)", Q.Q4_K),
          "unit_half": ("c = mmv8_sel(odd, f, s);", "c = mmv8_sel(odd, s, f);", Q.Q6_K),
          "scale": ("float d = m / 127.0f;", "float d = m / 126.0f;", Q.Q4_K)}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_kernel_fails(tmp_path_factory, tmp_path, name):
    old, new, qt = BROKEN[name]
    exe = _mutant(tmp_path_factory, 1, name, old, new)
    rng = np.random.default_rng(3)
    e, _ = run_mmv8(exe, tmp_path, [(qt, 9)], 512, 1, 1, 2, rng)
    assert e > 10 * TOL, e    # the checks above would fail it


# Q4_K's shared-memory ring (mmv8_q4k_ring, catalog.MMV8_RING): rows of 13 trips (K = 13,312) walk
# the ring's stages round several times, at one and two warps a row (trips 7 and 6 a warp)
RING_K = 13312


@pytest.mark.skipif(not catalog.MMV8_RING[1], reason="mmv8_nb1 is built without the Q4_K ring")
@pytest.mark.parametrize("eager", ["0", "1"], ids=["copies-at-wait", "copies-at-issue"])
@pytest.mark.parametrize("wpr", [1, 2])
def test_q4k_ring_round_and_round(emu1, tmp_path, wpr, eager):
    """Many trips a warp through the ring give mmv8's sums, whether a copy lands at its wait (a
    stage read before its wait would be stale) or at its issue (a stage refilled while a lane still
    reads it would be overwritten)."""
    rng = np.random.default_rng(wpr)
    e, _ = run_mmv8(emu1, tmp_path, [(Q.Q4_K, 9), (Q.Q4_K, 4)], RING_K, 1, wpr, 1, rng, bias=True,
                    env={"EMU_CP_EAGER": eager})
    assert e <= TOL, e


@pytest.mark.skipif(not catalog.MMV8_RING[2], reason="ffn8_nb1 is built without the Q4_K ring")
def test_ffn8_q4k_ring(emu2, tmp_path):
    """ffn8's gate and up rows share each trip's stage: act(gate . x) * (up . x) over 13 trips."""
    rng = np.random.default_rng(5)
    N, K = 7, RING_K
    (dg, rb, wg64), (du, _, wu64) = weight(Q.Q4_K, N, K, rng), weight(Q.Q4_K, N, K, rng)
    x = rng.standard_normal(K).astype(np.float32)
    xq = q8_twin(x)
    params = {"kernel": "ffn8", "K": K, "xs": K, "nb": 1, "wpr": 1, "eps": 1e-6, "grid_x": 1, "rb": rb, "N": N,
              "qt": int(Q.Q4_K), "act": 0, "as": N}
    res = host_emu.launch(emu2, tmp_path / "ffn", params, {"x": x, "wg": dg, "wu": du, "a": np.full(N, np.nan, np.float32)},
                          {"a": np.float32}, env={"EMU_CP_EAGER": "1"}, label="ffn8")
    g, u = wg64 @ xq, wu64 @ xq
    scale = 1.2 * (np.abs(wg64) @ np.abs(xq)) * np.abs(u) + np.abs(silu(g)) * (np.abs(wu64) @ np.abs(xq))
    e = err(res["a"], silu(g) * u, scale)
    assert e <= TOL, e


# ring copies that must fail: a stage read one trip before its copies are waited for, and a stage
# refilled before every lane is done with it (seen with copies landing at issue)
BROKEN_RING = {"ring_wait": ("cp_wait<NS - 1>();", "cp_wait<NS>();", "0"),
               "ring_refill": ("__syncwarp();                                                // every lane",
                               "// every lane", "1")}


@pytest.mark.skipif(not catalog.MMV8_RING[1], reason="mmv8_nb1 is built without the Q4_K ring")
@pytest.mark.parametrize("name", sorted(BROKEN_RING))
def test_a_broken_ring_fails(tmp_path_factory, tmp_path, name):
    old, new, eager = BROKEN_RING[name]
    exe = _mutant(tmp_path_factory, 1, name, old, new)
    rng = np.random.default_rng(4)
    e, _ = run_mmv8(exe, tmp_path, [(Q.Q4_K, 5)], RING_K, 1, 1, 1, rng, env={"EMU_CP_EAGER": eager})
    assert e > 10 * TOL, e


def test_a_read_past_shared_memory_stops_the_emulator(tmp_path_factory, tmp_path):
    """Lanes of the Q4_K register path (mmv8_q4k: the experts' kernels, and mmv8 built without the
    ring) past a short row's end (K = 512: two super-blocks, four a warp's trip) must read trip 0's
    activations, not bytes past the staged row: the emulator's shared memory ends at a page no
    access may touch, so the unclamped read stops it (on the GPU: an illegal address)."""
    old = "mmv8_q4k_act(sm, ok ? aoff + 1024 * tk : a0off, ok ? doff + 256 * tk : d0off, hm)"
    exe = _mutant(tmp_path_factory, 1, "oob", old, "mmv8_q4k_act(sm, aoff + 1024 * tk, doff + 256 * tk, hm)", ring=0)
    with pytest.raises(AssertionError, match="past its block's dynamic shared memory"):
        run_mmv8(exe, tmp_path, [(Q.Q4_K, 9)], 512, 1, 1, 2, np.random.default_rng(4))


@pytest.fixture(scope="module")
def emu3(tmp_path_factory):
    return _exe(tmp_path_factory, 3)


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.Q8_0, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "gemv"])
@pytest.mark.parametrize("units", [5, 8, 16])
def test_moe8_pairs(emu3, tmp_path, qt, gated, units):
    """A mixture of experts' pairs (moe8_gate_up_nb1 / moe8_gemv_nb1): block column p is pair p, whose
    expert ids[p] picks the matrices of a stack of 5 and whose input is row p / xdiv (gate and up: the
    token's of 2 pairs; the down projection: its own); an out-of-range id writes NaN; rows past N and
    a grid smaller than the row groups (blocks stride over them); biases; outputs poisoned."""
    from realizar_backend.backends.cuda.matrices import QTYPES
    rng = np.random.default_rng(int(qt) * 7 + gated + units)
    blk = QTYPES[qt].block
    E, N, K, xdiv = 5, 37, -(-32 * units // blk) * blk, (2 if gated else 1)
    ids = np.array([3, 0, 4, 3, 1, 7], np.int32)               # pair 5's expert is out of range
    pairs, rows = len(ids), -(-len(ids) // xdiv)
    mats = [weight(qt, E * N, K, rng) for _ in range(2 if gated else 1)]
    rb, eb = mats[0][1], mats[0][1] * N
    x = (rng.standard_normal((rows, K)) * rng.uniform(0.1, 30.0, (rows, 1))).astype(np.float32)
    xq = np.stack([q8_twin(v) for v in x])
    bias = [rng.standard_normal(E * N).astype(np.float32) for _ in mats]
    ys = N + 3
    y0 = np.full((pairs, ys), np.nan, np.float32)
    params = {"kernel": "moe8_gate_up" if gated else "moe8_gemv", "K": K, "xs": K, "nb": rows, "wpr": 1,
              "eps": 1e-6, "grid_x": 1, "rb": rb, "eb": eb, "E": E, "N": N, "qt": int(qt), "xdiv": xdiv,
              "act": 0, "ys": ys, "pairs": pairs}
    arrays = {"x": x, "ids": ids, "wg": mats[0][0], "bg": bias[0], "y": y0}
    if gated:
        arrays.update(wu=mats[1][0], bu=bias[1])
    res = host_emu.launch(emu3, tmp_path / "moe8", params, arrays, {"y": (np.float32, (pairs, ys))}, label="moe8")
    got = res["y"]
    assert np.all(np.isnan(got[:, N:])) and np.all(np.isnan(got[5, :N]))
    for p, e in enumerate(ids[:5]):
        xp = xq[p // xdiv]
        lin = [m[2][e * N:(e + 1) * N] @ xp + b[e * N:(e + 1) * N] for m, b in zip(mats, bias)]
        sc = [np.abs(m[2][e * N:(e + 1) * N]) @ np.abs(xp) + np.abs(b[e * N:(e + 1) * N]) for m, b in zip(mats, bias)]
        if gated:
            ref, scale = silu(lin[0]) * lin[1], 1.2 * sc[0] * np.abs(lin[1]) + np.abs(silu(lin[0])) * sc[1]
        else:
            ref, scale = lin[0], sc[0]
        assert err(got[p, :N], ref, scale) <= TOL, (p, err(got[p, :N], ref, scale))


def run_pairs(exe, d, kernel: str, qt, rb: int, ids, x, params: dict, arrays: dict, outputs: dict):
    """One moe8 launch (kernel: moe8_gemv, moe8_down_combine) of a stack of rb-byte rows, params["N"]
    an expert, over the pairs' input rows x (quantized by mmv8_q8 first), experts ids."""
    base = {"kernel": kernel, "K": x.shape[1], "xs": x.shape[1], "nb": x.shape[0], "eps": 1e-6, "rb": rb,
            "eb": rb * params["N"], "qt": int(qt)}
    return host_emu.launch(exe, d, {**base, **params}, {"x": x, "ids": ids, **arrays}, outputs, label=kernel)


def check_down_combine(exe, tmp_path, case):
    """test_moe8_down_combine's checks of one case (an AssertionError where one fails)."""
    from realizar_backend.backends.cuda.matrices import QTYPES
    qt, top, wpr, biased, grid_x, bad = case
    rng = np.random.default_rng(int(qt) * 31 + top + wpr)
    T, E, N, K = 2, 9, 37, (512 if QTYPES[qt].block == 256 else 160)
    ids = np.stack([rng.permutation(E)[:top] for _ in range(T)]).astype(np.int32)
    if bad:
        ids[0, top // 2] = E + 2
    pairs = T * top
    dev, rb, w64 = weight(qt, E * N, K, rng)
    a = (rng.standard_normal((pairs, K)) * rng.uniform(0.1, 30.0, (pairs, 1))).astype(np.float32)
    aq = np.stack([q8_twin(v) for v in a])
    bd = rng.standard_normal(E * N).astype(np.float32) if biased else np.zeros(E * N, np.float32)
    bias = {"bd": bd} if biased else {}
    w = rng.random((T, top)).astype(np.float32)
    xrs = N + 3
    x0 = rng.standard_normal((T, xrs)).astype(np.float32)
    got = run_pairs(exe, tmp_path / "fused", "moe8_down_combine", qt, rb, ids, a,
                    {"N": N, "E": E, "top": top, "T": T, "xrs": xrs, "wpr": wpr, "grid_x": grid_x},
                    {"wd": dev, "w": w, "xr": x0, **bias}, {"xr": (np.float32, (T, xrs))})["xr"]
    assert np.array_equal(got[:, N:], x0[:, N:]), "columns past N written"
    for t in range(T):
        if bad and t == 0:
            assert np.all(np.isnan(got[t, :N])), "a pair out of range must show in its token's row"
            continue
        ref, scale = x0[t, :N].astype(np.float64), np.abs(x0[t, :N]).astype(np.float64)
        for j, e in enumerate(ids[t]):
            m, v, b = w64[e * N:(e + 1) * N], aq[t * top + j], bd[e * N:(e + 1) * N]
            ref = ref + w[t, j] * (m @ v + b)
            scale = scale + w[t, j] * (np.abs(m) @ np.abs(v) + np.abs(b))
        assert err(got[t, :N], ref, scale) <= TOL, (t, err(got[t, :N], ref, scale))
    # the unfused path: the down projection's rows y, then moe_combine's sum of them (float32, j in order)
    ys = N + 1
    y = run_pairs(exe, tmp_path / "unfused", "moe8_gemv", qt, rb, ids, a,
                  {"N": N, "E": E, "xdiv": 1, "act": 0, "ys": ys, "pairs": pairs, "wpr": 1, "grid_x": grid_x},
                  {"wg": dev, "y": np.full((pairs, ys), np.nan, np.float32), **({"bg": bd} if biased else {})},
                  {"y": (np.float32, (pairs, ys))})["y"]
    want = x0.copy()
    for t in range(T):
        s = np.zeros(N, np.float32)
        for j in range(top):
            s = s + w[t, j] * y[t * top + j, :N]
        want[t, :N] += s
    assert np.array_equal(got, want, equal_nan=True), "the fused sum is not the unfused path's, bit for bit"


# (type, top_k, warps a row group, biases, grid.x, a pair of token 0 out of range): Qwen3-30B-A3B's
# 8 of Q4_K / Q6_K experts and gpt-oss's 4 MXFP4 ones with biases; every warps-per-group split the
# host may pick (one warp all pairs; the pairs dealt over 2, 4 warps; more warps than pairs, some
# idle); grids smaller than the row groups need (blocks stride over them)
COMBINE_CASES = [(Q.Q4_K, 8, 2, False, 2, True), (Q.Q4_K, 8, 1, True, 3, False), (Q.MXFP4, 4, 4, True, 2, True),
                 (Q.MXFP4, 4, 1, False, 5, False), (Q.Q6_K, 8, 4, True, 1, False), (Q.IQ4_XS, 4, 2, False, 2, True),
                 (Q.Q5_K, 4, 8, True, 1, False), (Q.IQ4_NL, 8, 16, True, 1, True), (Q.Q8_0, 4, 2, True, 3, False)]


@pytest.mark.parametrize("case", COMBINE_CASES,
                         ids=lambda c: f"{c[0].name}-top{c[1]}-wpr{c[2]}-{'bias' if c[3] else 'nobias'}-grid{c[4]}"
                                       + ("-bad" if c[5] else ""))
def test_moe8_down_combine(emu3, tmp_path, case):
    """moe8_down_combine_nb1: x[t] += sum_j w[t, j] (down_e_j . a_j + bd_e_j) over each of 2 tokens'
    top pairs (expert ids[t, j] of a stack of 9, input row a_j = the pair's gated row, quantized by
    mmv8_q8), against NumPy in float64 over the 8-bit rows; the residual's columns past N untouched; a
    pair whose id is out of range turns its token's row NaN (the other token's stays right). And bit
    for bit the unfused path's result: moe8_gemv_nb1's rows y of the same pairs, summed into x in
    float32, j in order, as moe.cu's moe_combine sums them (the emulator's float arithmetic is
    NumPy's: no fused multiply-adds)."""
    check_down_combine(emu3, tmp_path, case)


# changed copies of moe8_down_combine that must fail those checks (and the check that sees it, None:
# the float64 one): every pair reading the first pair's staged row; the pairs summed in reverse order
# (close, but not the unfused path's bits)
BROKEN_COMBINE = {"one_row": ("sm + j * S, acc);", "sm, acc);", None),
                  "order": ("for (int j = 0; j < top; ++j) s +=", "for (int j = top - 1; j >= 0; --j) s +=",
                            "bit for bit")}


@pytest.mark.parametrize("name", sorted(BROKEN_COMBINE))
def test_a_broken_combine_fails(tmp_path_factory, tmp_path, name):
    old, new, seen_by = BROKEN_COMBINE[name]
    exe = _mutant(tmp_path_factory, 3, name, old, new)
    with pytest.raises(AssertionError) as info:
        check_down_combine(exe, tmp_path, (Q.Q4_K, 8, 2, True, 2, False))
    assert seen_by is None or seen_by in str(info.value), str(info.value)
