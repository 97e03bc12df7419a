"""The grouped experts' chain (backends/cuda/experts.py GroupedExperts) run on the CPU through
tests/host/moe_grouped_emu.cpp (mmq_emu.cpp's fibers and tensor-core emulation): moe.cu's bucketing
(per-expert counts, the pairs of each expert in row order in a slot range padded to the tile
height, the token-tile table up to the host's bound), mmq.cu's mmq_moe_bnBN tiles over each
expert's gate and up (rows gathered through the list) and down (outputs scattered to the pairs'
rows), and moe_combine into the residual, each stage against NumPy on the stage before it: the
lists exactly, the projections in float64 at the tensor-core path's bound. Routings with experts of
no rows, an expert of every row, top_k > 1, odd row counts; Q4_K and Q8_0 stacks (and a mix, with
gpt-oss's biases and clamped SwiGLU). The 8-bit variant (mmq8_prep, mmq8_moe_bnBN) the same way,
against the activations as it quantizes them (support.q8: the rows h, and the gated rows it wrote
itself). A broken bucketing (a copy of moe.cu whose lists skip the scan) and a broken gather
(mmq.cu) must fail the same checks. Skipped where g++ is absent."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.dispatch import moe_grouped_plan
from realizar_backend.model.math import gelu_tanh, silu, swiglu_oai
from support import host_emu
from support.host_emu import GXX, KERNELS
from support.q8 import q8_twin
from test_moe_host import F64, err, stack

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

EXACT_TOL = 2e-6          # tests/kernels/test_mmq_emu.py: with exact tensor-core sums only fp32 roundings
COMBINE_TOL = 1e-6        # fp32 sums of top_k weighted rows
# the 8-bit variant against its own quantized activations: the per-unit scales' fp32 products
# (float(q.q) dx d) round where the fp16 records' exact sums do not
A8_TOL = 2e-5


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return host_emu.build("moe_grouped_emu.cpp", tmp_path_factory.mktemp("moe_grouped") / "moe_grouped_emu")


@pytest.fixture(scope="module")
def emu8(tmp_path_factory):
    return host_emu.build("moe_grouped_emu.cpp", tmp_path_factory.mktemp("moe_grouped8") / "moe_grouped_emu8",
                          flags=("-std=c++17", "-O1", "-DMMQ_A8=1"))


def expected_lists(ids: np.ndarray, E: int, bn: int, TB: int):
    """(cnt, list, tiles) as the bucketing must write them (list entries past the last tile: None)."""
    flat = ids.reshape(-1)
    cnt = np.bincount(flat, minlength=E).astype(np.int32)
    lst = np.full(TB * bn, -7, np.int32)         # -7: the emulator's poison, never written
    tiles = np.tile(np.array([-1, 0, 0], np.int32), (TB, 1))
    slot = tb = 0
    for e in range(E):
        ps = np.flatnonzero(flat == e)
        nt = -(-len(ps) // bn)
        lst[slot:slot + len(ps)] = ps
        lst[slot + len(ps):slot + nt * bn] = -1
        for j in range(nt):
            tiles[tb + j] = (e, slot + j * bn, slot + len(ps))
        slot, tb = slot + nt * bn, tb + nt
    assert tb <= TB
    return cnt, lst, tiles.reshape(-1)


def gated(g, u, act):
    return swiglu_oai(g, u) if act == 2 else (gelu_tanh(g) if act else silu(g)) * u


def run_chain(emu, tmp_path, rng, types, E, T, k, H, F, ids, act=0, biases=False, label="", a8=False):
    """The chain on a routing ids [T, k] (a8: emu is the 8-bit variant's); returns the emulator's
    outputs and the plan."""
    qg, qd = types
    bn, TB = moe_grouped_plan(T, k, E)
    wg, g64, rb_gu = stack(qg, E, F, H, rng)
    wu, u64, _ = stack(qg, E, F, H, rng)
    wd, d64, rb_d = stack(qd, E, H, F, rng)
    h = rng.standard_normal((T, H)).astype(np.float32) * (4.0 if act == 2 else 1.0)
    x0 = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    arrays = dict(h=h, x=x0, ids=ids.astype(np.int32), w=w, wg=wg, wu=wu, wd=wd)
    bs = [np.zeros((E, n), np.float32) for n in (F, F, H)]
    if biases:
        bs = [rng.normal(0.0, 1.0, (E, n)).astype(np.float32) for n in (F, F, H)]
        arrays.update(bg=bs[0], bu=bs[1], bd=bs[2])
    params = dict(T=T, k=k, E=E, H=H, F=F, bn=bn, TB=TB, qt_gu=int(qg), qt_d=int(qd), act=act, rb_gu=rb_gu, rb_d=rb_d)
    out = host_emu.launch(emu, tmp_path / f"chain{len(list(tmp_path.iterdir()))}", params, arrays,
                          {"cnt": np.int32, "list": np.int32, "tiles": np.int32, "a": (np.float32, (TB * bn, F)),
                           "y": (np.float32, (T * k, H)), "x": (np.float32, (T, H))}, label=label)
    return out, dict(bn=bn, TB=TB, ids=ids, h=h, x0=x0, w=w, g64=g64, u64=u64, d64=d64, bs=bs, act=act, E=E, k=k,
                     a8=a8)


def q8_rows(x: np.ndarray) -> np.ndarray:
    """Rows of float32 x as the 8-bit variant's prep quantizes them (float64 values)."""
    return np.stack([q8_twin(r) for r in x]) if len(x) else np.zeros(x.shape)


def check_chain(out, c) -> list[str]:
    """Every stage against NumPy on the stage before it; the failures, as messages."""
    bad = []
    cnt, lst, tiles = expected_lists(c["ids"], c["E"], c["bn"], c["TB"])
    if not np.array_equal(out["cnt"], cnt):
        bad.append(f"counts {out['cnt']} != {cnt}")
    if not np.array_equal(out["list"], lst):
        bad.append(f"list {out['list']} != {lst}")
    if not np.array_equal(out["tiles"], tiles):
        bad.append(f"tiles {out['tiles']} != {tiles}")
    if bad:
        return bad
    k, flat, act, a8 = c["k"], c["ids"].reshape(-1), c["act"], c["a8"]
    tol = A8_TOL if a8 else EXACT_TOL
    h64 = q8_rows(c["h"]) if a8 else c["h"].astype(F64)
    bg, bu, bd = (b.astype(F64) for b in c["bs"])
    a, y = out["a"], out["y"]
    used = lst >= 0
    # gate and up: each slot of a pair against its expert's float64 MLP of its row
    p = lst[used]
    e, t = flat[p], p // k
    g = np.einsum("sfh,sh->sf", c["g64"][e], h64[t]) + bg[e]
    u = np.einsum("sfh,sh->sf", c["u64"][e], h64[t]) + bu[e]
    # test_mmq_emu's bound of the fused FFN: the error of g through act' (<= 1.2) times u (gpt-oss: u + 1,
    # and the activation's own value, ~g) and of u times act(g)
    sg = np.einsum("sfh,sh->sf", np.abs(c["g64"][e]), np.abs(h64[t])) + np.abs(bg[e])
    su = np.einsum("sfh,sh->sf", np.abs(c["u64"][e]), np.abs(h64[t])) + np.abs(bu[e])
    ga = np.abs(gated(g, np.ones_like(u) * (0 if act == 2 else 1), act))
    scale = 1.2 * sg * (np.abs(u) + (1 if act == 2 else 0)) + (ga + np.abs(g)) * su
    ea = err(a[used], gated(g, u, act), scale)
    if ea > tol:
        bad.append(f"gate/up error {ea:.2e}")
    if not np.all(np.isnan(a[~used])):
        bad.append("gate/up wrote a padding or unused slot")
    # down: each pair's row from its slot's gated row
    a64 = q8_rows(a[used]) if a8 else a[used].astype(F64)
    ref = np.einsum("shf,sf->sh", c["d64"][e], a64) + bd[e]
    sc = np.einsum("shf,sf->sh", np.abs(c["d64"][e]), np.abs(a64)) + np.abs(bd[e])
    ed = err(y[p], ref, sc)
    if ed > tol:
        bad.append(f"down error {ed:.2e}")
    if len(p) != len(flat) or len(set(p.tolist())) != len(flat):
        bad.append("not every pair has one slot")
    # the weighted sum into the residual, j in order
    w = c["w"].astype(F64)
    yp = y.astype(F64).reshape(-1, k, y.shape[1])
    xr = c["x0"] + np.einsum("tj,tjh->th", w, yp)
    ex = err(out["x"], xr, np.abs(c["x0"]) + np.einsum("tj,tjh->th", w, np.abs(yp)))
    if ex > COMBINE_TOL:
        bad.append(f"combine error {ex:.2e}")
    return bad


def routing_with(rng, T, k, experts) -> np.ndarray:
    """Each row's k distinct experts drawn from `experts` only."""
    return np.stack([rng.choice(experts, k, replace=False) for _ in range(T)]).astype(np.int32)


# (types (gate and up, down), E, T, k, H, F, routing, act, biases)
CASES = {
    # experts 1, 4, 5 of none; 7 rows (odd), top 2
    "q4k-empty-experts": ((Q.Q4_K, Q.Q4_K), 6, 7, 2, 256, 256, lambda r, T, k: routing_with(r, T, k, [0, 2, 3]), 0, False),
    # expert 4 in every row, top 3 of 5, 9 rows; tiles of 8 with two partial
    "q8_0-one-expert-every-row": ((Q.Q8_0, Q.Q8_0), 5, 9, 3, 96, 96,
                                  lambda r, T, k: np.stack([np.r_[4, r.choice(4, k - 1, replace=False)]
                                                            for _ in range(T)]).astype(np.int32), 1, False),
    # every row to one expert (top 1): 19 rows, three tiles of 8 of one expert
    "q8_0-all-rows-one-expert": ((Q.Q8_0, Q.Q8_0), 4, 19, 1, 64, 160, lambda r, T, k: np.full((T, k), 2, np.int32), 0,
                                 False),
    # a 16-row tile height (33 pairs over 3 experts), Q4_K gate/up and Q8_0 down, gpt-oss's biases and SwiGLU
    "mixed-biases-swiglu": ((Q.Q4_K, Q.Q8_0), 3, 11, 3, 256, 96, lambda r, T, k: routing_with(r, T, k, [0, 1, 2]), 2,
                            True),
    # tiles of 32 (45 pairs over 2 experts, top 1) and of 64 (every row on both of 2 experts: 70 pairs each)
    "q8_0-tiles-of-32": ((Q.Q8_0, Q.Q8_0), 2, 45, 1, 64, 96, lambda r, T, k: r.integers(0, 2, (T, k)).astype(np.int32),
                         1, False),
    "q4k-tiles-of-64": ((Q.Q4_K, Q.Q4_K), 2, 70, 2, 256, 256, lambda r, T, k: np.tile(np.int32([1, 0]), (T, 1)), 0,
                        False),
    # gpt-oss's stacks: MXFP4 throughout, its biases and clamped SwiGLU, top 2 of 4 (tiles of 8)
    "mxfp4-biases-swiglu": ((Q.MXFP4, Q.MXFP4), 4, 9, 2, 96, 64,
                            lambda r, T, k: np.stack([r.permutation(4)[:k] for _ in range(T)]).astype(np.int32), 2,
                            True),
    # one 32-column unit a gated row (the down projection's K = 32: a chunk of one unit), 64 wide
    "q8_0-one-unit-rows": ((Q.Q8_0, Q.Q8_0), 8, 13, 2, 64, 32,
                           lambda r, T, k: np.stack([r.permutation(8)[:k] for _ in range(T)]).astype(np.int32), 0, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_chain(emu, tmp_path, case):
    types, E, T, k, H, F, route_fn, act, biases = CASES[case]
    rng = np.random.default_rng(len(case))
    ids = route_fn(rng, T, k)
    out, c = run_chain(emu, tmp_path, rng, types, E, T, k, H, F, ids, act, biases, label=case)
    print(f"{case}: tiles of {c['bn']}, {c['TB']} token tiles, counts {out['cnt']}")
    assert check_chain(out, c) == []


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_chain_8bit(emu8, tmp_path, case):
    """The same chains on the 8-bit records (every case's stacks are of dispatch.MMQ8_TYPES)."""
    types, E, T, k, H, F, route_fn, act, biases = CASES[case]
    rng = np.random.default_rng(len(case) + 1)
    ids = route_fn(rng, T, k)
    out, c = run_chain(emu8, tmp_path, rng, types, E, T, k, H, F, ids, act, biases, label=case, a8=True)
    print(f"{case} (8-bit): tiles of {c['bn']}, {c['TB']} token tiles, counts {out['cnt']}")
    assert check_chain(out, c) == []


BROKEN = {
    # the fill gives every segment's first pair the expert's first slot (the scan's offsets dropped)
    "bucketing": ("moe.cu", "int slot = s0 + moe_block_scan(mine, sm, total) - mine;",
                  "int slot = s0; moe_block_scan(mine, sm, total);", "list"),
    # the gate/up gather reads every token of a tile from the tile's first pair's row
    "gather": ("mmq.cu", "const long long row = gi ? gi[tok0 + t] / gdiv : tok0 + t;",
               "const long long row = gi ? gi[tok0] / gdiv : tok0 + t;", "gate/up"),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_broken_kernel_is_caught(tmp_path, what):
    """A kernel source with one mistake (a changed copy, searched before the real ones) must fail
    check_chain at the stage it breaks."""
    name, old, new, stage = BROKEN[what]
    src = (KERNELS / name).read_text()
    assert old in src
    d = tmp_path / "broken"
    d.mkdir()
    (d / name).write_text(src.replace(old, new))
    exe = host_emu.build("moe_grouped_emu.cpp", tmp_path / "broken_emu", include_first=d)
    rng = np.random.default_rng(3)
    ids = routing_with(rng, 9, 2, [0, 1, 3])
    out, c = run_chain(exe, tmp_path, rng, (Q.Q8_0, Q.Q8_0), 4, 9, 2, 64, 96, ids, label=what)
    bad = check_chain(out, c)
    print(what, bad)
    assert any(m.startswith(stage) for m in bad)
