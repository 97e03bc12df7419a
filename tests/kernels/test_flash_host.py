"""The flash attention kernels (kernels/flash_prefill.cu, flash_decode.cu) run on the CPU: the
sources compile with g++ against tests/host/cuda_emu.h (every thread a fiber; mma.sync, ldmatrix,
shuffles and barriers as rendezvous of the real lanes, fragment layouts from the PTX ISA;
cp.async copies land at their wait), launched with the plans of backends/cuda/flash.py, and must
match the float64 oracle on paged pools whose unread rows are NaN. This checks the indexing,
masking, online softmax, split-K combine and KV write logic before a GPU ever runs them (the GPU
tests, tests/gpu/test_flash_attention.py, check the same on the device). Skipped without g++."""

from __future__ import annotations

import numpy as np
import pytest

from support import host_emu
from support.flash_cases import (decode_case, decode_expected, head_norm_weights, oracle, prefill_case, rel_err,
                                 rope_table_host, row_cosine_min, same_bits)
from support.host_emu import GXX
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

TOL = 2e-3          # max abs error over max |ref| (fp16 q and P; the GPU test holds the same bound)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return host_emu.build("flash_emu.cpp", tmp_path_factory.mktemp("flash_emu") / "flash_emu")


def _run(exe, tmp_path, plan, arrays: dict, scalars: dict, rng) -> list[dict]:
    """Both copy models (late landing, then eager), each with its own warp speeds."""
    return [_run1(exe, tmp_path, plan, arrays, scalars, eager, int(rng.integers(1 << 31))) for eager in (False, True)]


def _run1(exe, tmp_path, plan, arrays: dict, scalars: dict, eager: bool, seed: int) -> dict:
    params = dict(kernel=plan.kernel, gx=plan.grid[0], gy=plan.grid[1], gz=plan.grid[2], threads=plan.threads,
                  smem=plan.smem, part_floats=plan.part_floats, ml_count=plan.ml_count,
                  counters_count=plan.counters, **scalars)
    n, H, D = scalars["n"], scalars["H"], scalars["D"]
    outputs = {"out": (np.float32, (n, H, D)), "counters": np.int32, "kpool": np.float16, "vpool": np.float16}
    if scalars.get("use_o16"):
        outputs["o16"] = (np.float16, (n, H, D))
    if scalars.get("use_oq"):
        outputs.update(oq=(np.int8, (n, H, D)), od=(np.float32, (n, H, D // 32, 2)))
    return host_emu.launch(exe, tmp_path / f"run{len(list(tmp_path.iterdir()))}", params, arrays, outputs,
                           env={"EMU_CP_EAGER": "1" if eager else "0", "EMU_SEED": str(seed)}, timeout=900,
                           label=f"eager={eager} EMU_SEED={seed}")


def _prefill(exe, tmp_path, rng, c, splits=1, nw=4, wm=None, qsplit=False, min_split_keys=16, o16=True,
             sinks=None):
    from realizar_backend.backends.cuda.flash import plan_prefill
    plan = plan_prefill(c.n, c.H, c.D, splits=splits, nw=nw, wm=wm, qsplit=qsplit)
    arrays = dict(q=c.q, kpool=c.pool.k, vpool=c.pool.v, bt=c.pool.bt, slots=c.slots, positions=c.positions)
    if sinks is not None:
        arrays["sinks"] = sinks
    res = _run(exe, tmp_path, plan, arrays,
               dict(n=c.n, H=c.H, KVH=c.KVH, D=c.D, scale=repr(c.scale), window=c.window,
                    max_blocks=c.pool.max_blocks, bs_log2=c.pool.bs_log2, min_split_keys=min_split_keys,
                    use_o16=int(o16), use_oq=0), rng)
    ref = oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window, sinks)
    for r in res:
        assert not np.any(r["counters"]), "split counters must be left at zero"
        assert same_bits(r["kpool"].reshape(c.pool.k.shape), c.pool.k), "prefill must not write the pool"
    return res, ref


# (items = [(cached prefix, rows)], H, KVH, D, block size, window)
PREFILL = [
    ([(0, 37), (50, 20), (3, 1)], 4, 2, 64, 16, 0),        # three sequences in one launch, one a chunk
    ([(0, 70)], 7, 1, 128, 4, 0),                          # GQA 7 (qwen05), tiny blocks, a 6-row tail tile
    ([(5, 40), (0, 30)], 2, 1, 256, 16, 24),               # gemma: 256 dims, a sliding window
    ([(90, 17)], 3, 3, 64, 8, 40),                         # MHA, a chunk past its window
]


@pytest.mark.parametrize("case", PREFILL, ids=lambda c: f"D{c[3]}-H{c[1]}/{c[2]}-w{c[5]}")
def test_prefill_matches_oracle(emu, tmp_path, rng, case):
    items, H, KVH, D, bs, window = case
    c = prefill_case(rng, items, H, KVH, D, bs, window)
    for r in _prefill(emu, tmp_path, rng, c)[0]:
        err = rel_err(r["out"], ref := oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window))
        print(f"prefill {case}: rel.err {err:.2e}, cos {row_cosine_min(r['out'], ref):.6f}")
        assert err <= TOL
        assert rel_err(r["o16"], ref) <= TOL


@pytest.mark.parametrize("splits", [2, 5])
def test_prefill_split_k(emu, tmp_path, rng, splits):
    """Split keys (a chunk after a long cached prefix): partials combined by the last block; a
    short run in the same tile (few keys) gets empty splits."""
    c = prefill_case(rng, [(200, 50), (0, 9)], 4, 2, 128, 16, 0)
    res, ref = _prefill(emu, tmp_path, rng, c, splits=splits, min_split_keys=32)
    for r in res:
        assert rel_err(r["out"], ref) <= TOL
        assert rel_err(r["o16"], ref) <= TOL


def test_prefill_split_window_and_qsplit(emu, tmp_path, rng):
    c = prefill_case(rng, [(150, 30)], 2, 1, 64, 16, 64, q_scale=3.0)
    res, ref = _prefill(emu, tmp_path, rng, c, splits=3, qsplit=True, min_split_keys=16)
    for r in res:
        err = rel_err(r["out"], ref)
        print(f"qsplit rel.err {err:.2e}")
        assert err <= TOL / 4              # q as hi + lo: only K, V and P are fp16


@pytest.mark.parametrize("variant", [dict(nw=8, wm=1), dict(wm=1), dict(wm=1, splits=3)],
                         ids=["8-warps", "one-m-tile", "one-m-tile-split"])
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_variants(emu, tmp_path, rng, variant, D):
    """The other row tilings: 8 warps of one m-tile (128 rows), 4 warps of one m-tile (64 rows, q
    fragments in registers); the default is 4 warps of two m-tiles (256 dims: one)."""
    if variant.get("nw") == 8 and D != 128:
        pytest.skip("8 warps: 128 dims only")
    c = prefill_case(rng, [(10, 100), (0, 40)], 2, 1, D, 16, 0)
    res, ref = _prefill(emu, tmp_path, rng, c, **variant)
    for r in res:
        assert rel_err(r["out"], ref) <= TOL


def _decode(exe, tmp_path, rng, c, fuse, splits, single_max, split_keys=64, qsplit=True, o16=False, oq=False,
            sinks=None, head_norms=None):
    from realizar_backend.backends.cuda.flash import plan_decode
    plan = plan_decode(c.n, c.H, c.KVH, c.D, splits=splits, qsplit=qsplit)
    arrays = dict(q=c.q, kpool=c.pool.k, vpool=c.pool.v, bt=c.pool.bt, slots=c.slots, positions=c.positions)
    scalars = {}
    if sinks is not None:
        arrays["sinks"] = sinks
    if fuse:
        arrays.update(kin=c.k, vin=c.v, rt=rope_table_host(int(c.positions.max()) + 1, c.rope_dim, c.theta))
    if head_norms is not None:
        arrays.update(q_norm=head_norms.q, k_norm=head_norms.k)
        scalars["eps"] = repr(float(head_norms.eps))
    res = _run(exe, tmp_path, plan, arrays,
               dict(n=c.n, H=c.H, KVH=c.KVH, D=c.D, scale=repr(c.scale), window=c.window,
                    max_blocks=c.pool.max_blocks, bs_log2=c.pool.bs_log2, rope_dim=c.rope_dim if fuse else c.D,
                    style=int(c.neox), fuse=int(fuse), single_max=single_max, split_keys=split_keys,
                    use_o16=int(o16), use_oq=int(oq), **scalars), rng)
    ref, pool = decode_expected(c, fuse, sinks, head_norms)
    for r in res:
        assert not np.any(r["counters"]), "split counters must be left at zero"
        assert same_bits(r["kpool"].reshape(pool.k.shape), pool.k), "K pool: wrong rows written"
        assert same_bits(r["vpool"].reshape(pool.v.shape), pool.v), "V pool: wrong rows written"
    return res, ref


# (lengths, H, KVH, D, block size, window, max splits, single_max)
DECODE = [
    ([1, 17, 100, 33], 6, 1, 128, 16, 0, 1, 1 << 30),     # one pass (qwen15 group of 6), a first token
    ([300, 65, 2], 4, 2, 64, 8, 0, 4, 32),                 # split rows beside single-pass rows
    ([700], 14, 2, 64, 16, 0, 16, 64),                     # qwen05's 7 heads per KV head; 2 combine levels
    ([90, 40], 4, 1, 256, 16, 48, 3, 16),                  # gemma: 256 dims, window, split
]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-rope", "roped"])
@pytest.mark.parametrize("case", DECODE, ids=lambda c: f"D{c[3]}-H{c[1]}/{c[2]}-S{c[6]}")
def test_decode_matches_oracle(emu, tmp_path, rng, case, fuse):
    lengths, H, KVH, D, bs, window, splits, single_max = case
    c = decode_case(rng, lengths, H, KVH, D, bs, window, fuse=fuse, neox=bool(rng.integers(2)))
    res, ref = _decode(emu, tmp_path, rng, c, fuse, splits, single_max, o16=True)
    for r in res:
        err = rel_err(r["out"], ref)
        print(f"decode {case} fuse={fuse}: rel.err {err:.2e}, cos {row_cosine_min(r['out'], ref):.6f}")
        assert err <= TOL / 4              # q as hi + lo
        assert rel_err(r["o16"], ref) <= TOL


def test_decode_partial_rope_plain_q_and_8bit(emu, tmp_path, rng):
    """rope_dim < head_dim (dims past it pass through), fp16 q (no hi/lo split), 8-bit outputs."""
    c = decode_case(rng, [130, 7], 8, 2, 128, 16, 0, fuse=True, rope_dim=64, neox=False)
    res, ref = _decode(emu, tmp_path, rng, c, True, 2, 64, qsplit=False, oq=True)
    for r in res:
        assert rel_err(r["out"], ref) <= TOL
        qv = r["oq"].astype(np.float32).reshape(c.n, c.H, c.D // 32, 32)
        deq = qv.astype(np.float64) * r["od"][..., :1]
        assert rel_err(deq.reshape(ref.shape), ref) <= 1.5e-2      # 8-bit blocks: half a step of 1/127
        assert np.array_equal(r["od"][..., 1], r["od"][..., 0] * qv.sum(-1))


# (lengths, H, KVH, D, max splits, single_max, rope_dim): Qwen3-30B-A3B's group of 8 on 128-dim
# heads in one pass and split (the new key's block is then not the first); a partial rotation;
# gemma3's 256-dim heads
DECODE_HEAD_NORMS = [
    ([1, 40, 9], 8, 1, 128, 1, 1 << 30, 128),
    ([300, 65], 8, 2, 128, 4, 32, 128),
    ([90, 3], 4, 2, 64, 3, 16, 32),
    ([70, 20], 4, 1, 256, 2, 32, 256),
]


@pytest.mark.parametrize("case", DECODE_HEAD_NORMS, ids=lambda c: f"D{c[3]}-H{c[1]}/{c[2]}-S{c[4]}-rope{c[6]}")
def test_decode_head_norms(emu, tmp_path, rng, case):
    """The per-head q/k norms folded into the fused decode: the new k in the pool bit for bit as the
    separate rms_norm launch, then RoPE, would leave it (head_norm_f32; checked in _decode), the
    output against the oracle over the normed q; without the norms the output would be far off."""
    lengths, H, KVH, D, splits, single_max, rope_dim = case
    c = decode_case(rng, lengths, H, KVH, D, 16, 0, fuse=True, rope_dim=rope_dim, neox=bool(rng.integers(2)))
    c.q *= rng.uniform(0.2, 5.0, (c.n, H, 1)).astype(np.float32)     # heads of their own scales
    c.k *= rng.uniform(0.2, 5.0, (c.n, KVH, 1)).astype(np.float32)
    hn = head_norm_weights(rng, D)
    res, ref = _decode(emu, tmp_path, rng, c, True, splits, single_max, o16=True, head_norms=hn)
    assert rel_err(decode_expected(c, True)[0], ref) > 20 * TOL
    for r in res:
        assert rel_err(r["out"], ref) <= TOL / 4
        assert rel_err(r["o16"], ref) <= TOL


def _sinks(rng, H: int) -> np.ndarray:
    """gpt-oss-like sink logits: around the scores' range (a real share of each row's softmax), one
    far above every score (its rows' outputs near 0) and one far below (no effect)."""
    s = rng.uniform(-1.0, 3.0, H).astype(np.float32)
    s[0], s[-1] = 40.0, -40.0
    return s


def _sinks_matter(c, sinks, ref, decode_fuse=None) -> None:
    """The case would catch a kernel that ignores its sinks: without them the output is far off."""
    plain = decode_expected(c, decode_fuse)[0] if decode_fuse is not None else \
        oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window)
    assert rel_err(plain, ref) > 20 * TOL


# gpt-oss's attention (64-dim heads, 8 q heads per KV head, a 128-key window on alternate layers)
@pytest.mark.parametrize("splits,window", [(1, 0), (3, 0), (2, 24)], ids=["one-pass", "split", "split-window"])
def test_prefill_sinks(emu, tmp_path, rng, splits, window):
    """A sink logit per head joins each row's softmax denominator, in one pass and where split
    partials combine (the partials themselves stay sink-free)."""
    c = prefill_case(rng, [(60, 40), (0, 9)], 8, 1, 64, 16, window)
    sinks = _sinks(rng, c.H)
    res, ref = _prefill(emu, tmp_path, rng, c, splits=splits, min_split_keys=16, sinks=sinks)
    _sinks_matter(c, sinks, ref)
    for r in res:
        assert rel_err(r["out"], ref) <= TOL
        assert rel_err(r["o16"], ref) <= TOL
        assert np.max(np.abs(r["out"][:, 0])) < 1e-6       # the dominant sink takes all of head 0


# (lengths, max splits, single_max, window): one pass; two split levels; split with a window
DECODE_SINKS = [([1, 40, 9], 1, 1 << 30, 0), ([700, 3], 16, 64, 0), ([300, 50], 4, 32, 128)]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-rope", "roped"])
@pytest.mark.parametrize("case", DECODE_SINKS, ids=["one-pass", "two-levels", "split-window"])
def test_decode_sinks(emu, tmp_path, rng, case, fuse):
    lengths, splits, single_max, window = case
    c = decode_case(rng, lengths, 8, 1, 64, 16, window, fuse=fuse, neox=True)
    sinks = _sinks(rng, c.H)
    res, ref = _decode(emu, tmp_path, rng, c, fuse, splits, single_max, o16=True, sinks=sinks)
    _sinks_matter(c, sinks, ref, fuse)
    for r in res:
        assert rel_err(r["out"], ref) <= TOL / 4
        assert rel_err(r["o16"], ref) <= TOL
        assert np.max(np.abs(r["out"][:, 0])) < 1e-6
