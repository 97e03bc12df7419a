"""The flash attention kernels (kernels/flash_prefill.cu, flash_decode.cu through
backends/cuda/flash.py) against the float64 oracle on fresh random paged pools (tests/support/flash_cases.py:
permuted block tables, every row a correct kernel must not read set to NaN), outputs poisoned with
NaN before each launch, the split counters checked back at zero and the pool checked bit for bit
(prefill writes nothing; decode writes exactly the new k and v). Tolerances: max |error| over
max |ref|; fp16 q (prefill default): 2e-3; q as hi + lo fp16 (decode default): 5e-4."""

from __future__ import annotations

import numpy as np
import pytest

from support.flash_cases import (DecodeCase, PrefillCase, decode_case, decode_expected, head_norm_weights, oracle,
                                 prefill_case, rel_err, row_cosine_min, same_bits)

pytestmark = pytest.mark.gpu

TOL, TOL_QS = 2e-3, 5e-4
# (H, KVH, D): smol135, qwen05 (7 q heads per KV head), qwen15 (6), gemma270 (256 dims), MHA
SHAPES = [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256), (8, 8, 128)]


def _sid(s):
    return f"H{s[0]}/{s[1]}-D{s[2]}"


@pytest.fixture(scope="module")
def fk():
    from realizar_backend.backends.cuda.flash import get_flash_kernels
    return get_flash_kernels(0)


class _Dev:
    """A case's arrays on the device (the pool copied, so a test can compare it after)."""

    def __init__(self, c):
        import cupy
        self.k, self.v = cupy.asarray(c.pool.k), cupy.asarray(c.pool.v)
        self.bt = cupy.asarray(c.pool.bt)
        self.slots, self.pos = cupy.asarray(c.slots), cupy.asarray(c.positions)
        self.q = cupy.asarray(c.q)


def _poisoned(shape, dtype):
    import cupy
    return cupy.full(shape, np.nan, dtype)


def run_prefill(fk, c, splits=1, nw=4, wm=None, qsplit=False, min_split_keys=512, sinks=None):
    import cupy

    from realizar_backend.backends.cuda import flash
    dev = _Dev(c)
    sk = cupy.asarray(sinks) if sinks is not None else None
    plan = flash.plan_prefill(c.n, c.H, c.D, splits=splits, nw=nw, wm=wm, qsplit=qsplit)
    scratch = flash.FlashScratch()
    scratch.ensure(plan)
    out, o16 = _poisoned((c.n, c.H, c.D), cupy.float32), _poisoned((c.n, c.H, c.D), cupy.float16)
    flash.prefill(fk, plan, dev.q.data.ptr, out.data.ptr, dev.k.data.ptr, dev.v.data.ptr, dev.bt.data.ptr,
                  c.pool.max_blocks, c.pool.bs_log2, dev.slots.data.ptr, dev.pos.data.ptr, c.n, c.H, c.KVH, c.D,
                  c.scale, c.window, scratch, o16=o16.data.ptr, min_split_keys=min_split_keys,
                  sinks=sk.data.ptr if sk is not None else 0)
    cupy.cuda.Device().synchronize()
    assert not scratch.counters.any(), "split counters must be left at zero"
    assert same_bits(dev.k.get(), c.pool.k) and same_bits(dev.v.get(), c.pool.v), "prefill must not write the pool"
    return out.get(), o16.get()


def _check_prefill(fk, c, tol=TOL, **kw):
    out, o16 = run_prefill(fk, c, **kw)
    ref = oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window, kw.get("sinks"))
    err, cos = rel_err(out, ref), row_cosine_min(out, ref)
    print(f"prefill H{c.H}/{c.KVH} D{c.D} items {c.items} window {c.window} {kw}: rel.err {err:.2e} cos {cos:.7f}")
    assert err <= tol and cos >= 0.99999
    assert rel_err(o16, ref) <= tol + 1e-3          # fp16 output rounding on top
    return out


ITEMS = [
    [(0, 300)],                                     # one prompt, several row tiles
    [(0, 77), (600, 130), (5, 1), (31, 16)],        # four sequences: chunks after cached prefixes, a lone row
    [(4000, 200)],                                  # a chunk at depth
]


@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
@pytest.mark.parametrize("items", ITEMS, ids=["prompt", "mixed", "deep-chunk"])
@pytest.mark.parametrize("window", [0, 512])
def test_prefill(fk, rng, shape, items, window):
    H, KVH, D = shape
    bs = int(rng.choice([16, 32, 8]))
    _check_prefill(fk, prefill_case(rng, items, H, KVH, D, bs, window))


@pytest.mark.parametrize("shape,window", [((12, 2, 128), 0), ((4, 1, 256), 512), ((14, 2, 64), 0)],
                         ids=["qwen15", "gemma-window", "qwen05"])
def test_prefill_17k_split(fk, rng, shape, window):
    """Rows at 17k positions (a late chunk of a long prompt), split over the keys as the launcher
    would pick for them, and forced to the most splits."""
    from realizar_backend.backends.cuda.flash import plan_prefill, prefill_splits
    H, KVH, D = shape
    c = prefill_case(rng, [(16_950, 70)], H, KVH, D, 16, window)
    auto = prefill_splits(c.n, H, 17_020, fk.sm_count, plan_prefill(c.n, H, D).rows)
    for splits in sorted({1, auto, 8}):
        _check_prefill(fk, c, splits=splits)


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_prefill_forced_splits(fk, rng, splits):
    c = prefill_case(rng, [(3000, 64), (0, 40), (1000, 3)], 12, 2, 128, 16, 0)
    _check_prefill(fk, c, splits=splits, min_split_keys=64)


@pytest.mark.parametrize("variant", [dict(nw=8, wm=1), dict(wm=1), dict(qsplit=True)],
                         ids=["8-warps", "one-m-tile", "q-hi-lo"])
def test_prefill_variants(fk, rng, variant):
    D = 128 if "nw" in variant else int(rng.choice([64, 128] if "wm" in variant else [64, 128, 256]))
    c = prefill_case(rng, [(0, 333), (900, 70)], 12, 2, D, 16, 0, q_scale=2.0)
    _check_prefill(fk, c, tol=TOL_QS if variant.get("qsplit") else TOL, **variant)


def test_prefill_sharp_softmax(fk, rng):
    """Scores spread wide (nearly one-hot rows, as gemma's): fp16 q alone vs q as hi + lo."""
    c = prefill_case(rng, [(100, 200)], 4, 1, 256, 16, 0, q_scale=8.0)
    _check_prefill(fk, c, tol=4e-3)
    _check_prefill(fk, c, tol=TOL_QS, qsplit=True)


def test_chunked_prefill_equals_one_shot(fk, rng):
    """A prompt prefilled in three chunks (each attending to the cached prefix plus itself) gives the
    one-shot rows bit for bit: a row's result depends only on its own keys."""
    c = prefill_case(rng, [(0, 600)], 12, 2, 128, 16, 0)
    whole, _ = run_prefill(fk, c)
    parts = []
    for a, b in ((0, 200), (200, 450), (450, 600)):
        sub = PrefillCase(c.H, c.KVH, c.D, c.window, c.scale, c.pool, c.q[a:b], c.slots[a:b], c.positions[a:b])
        parts.append(run_prefill(fk, sub)[0])
    assert np.array_equal(np.concatenate(parts), whole)


def run_decode(fk, c, fuse, splits=None, single_max=256, split_keys=64, qsplit=True, o16=False, oq=False,
               pdl=False, cluster=1, sinks=None, head_norms=None, norm_first=None):
    """head_norms (flash_cases.HeadNorms, fuse only): the per-head q/k norms folded into the launch or,
    with norm_first (the Kernels to launch them on), run first as rms_norm launches over q's and the
    new k's heads, as the prompt path runs them. The pool comes back in res["kpool"], res["vpool"]: the
    twin's 1 / sqrt is not rsqrtf, so only the rows it must not write are checked here."""
    import cupy

    from realizar_backend.backends.cuda import flash
    from realizar_backend.backends.cuda.ops import rms_norm, rope_table
    dev = _Dev(c)
    sk = cupy.asarray(sinks) if sinks is not None else None
    splits = splits or flash.decode_splits(c.n, c.KVH, fk.sm_count, clusters=cluster > 1)
    if cluster > 1:
        splits = splits // cluster * cluster
    plan = flash.plan_decode(c.n, c.H, c.KVH, c.D, splits=splits, qsplit=qsplit, cluster=cluster)
    scratch = flash.FlashScratch()
    scratch.ensure(plan)
    out = _poisoned((c.n, c.H, c.D), cupy.float32)
    out16 = _poisoned((c.n, c.H, c.D), cupy.float16) if o16 else None
    q8 = cupy.zeros((c.n, c.H, c.D), cupy.int8) if oq else None
    d8 = _poisoned((c.n, c.H * c.D // 32, 2), cupy.float32) if oq else None
    rope = None
    if fuse:
        kin, vin = cupy.asarray(c.k), cupy.asarray(c.v)
        table = rope_table(int(c.positions.max()) + 1, c.rope_dim, c.theta, c.scaling)
        rope = (kin.data.ptr, vin.data.ptr, c.rope_dim, c.neox, table.data.ptr)
    norms = None
    if head_norms is not None:
        qw, kw = cupy.asarray(head_norms.q), cupy.asarray(head_norms.k)
        if norm_first is not None:
            for y, w, heads in ((dev.q, qw, c.H), (kin, kw, c.KVH)):
                rms_norm(norm_first, y.data.ptr, c.D, w.data.ptr, y.data.ptr, c.D, c.n * heads, c.D,
                         float(head_norms.eps))
        else:
            norms = (qw.data.ptr, kw.data.ptr, float(head_norms.eps))
    flash.decode(fk, plan, dev.q.data.ptr, out.data.ptr, dev.k.data.ptr, dev.v.data.ptr, dev.bt.data.ptr,
                 c.pool.max_blocks, c.pool.bs_log2, dev.slots.data.ptr, dev.pos.data.ptr, c.n, c.H, c.KVH, c.D,
                 c.scale, c.window, scratch, rope=rope, o16=out16.data.ptr if o16 else 0,
                 oq=q8.data.ptr if oq else 0, od=d8.data.ptr if oq else 0, single_max=single_max,
                 split_keys=split_keys, pdl=pdl, sinks=sk.data.ptr if sk is not None else 0, head_norms=norms)
    cupy.cuda.Device().synchronize()
    ref, pool = decode_expected(c, fuse, sinks, head_norms)
    assert not scratch.counters.any(), "split counters must be left at zero"
    res = {"out": out.get()}
    if head_norms is not None:
        res["kpool"], res["vpool"] = dev.k.get(), dev.v.get()
        written = np.zeros(pool.k.shape[:2], bool)
        for t in range(c.n):
            written[pool.row_index(int(c.slots[t]), int(c.positions[t]))] = True
        assert same_bits(res["kpool"][~written], pool.k[~written]), "K pool: a row other than the new keys' written"
        assert same_bits(res["vpool"], pool.v), "V pool: the new v must be written at each row's position, nothing else"
        assert rel_err(res["kpool"][written], pool.k[written].astype(np.float64)) <= 2e-3
    else:
        assert same_bits(dev.k.get(), pool.k), "K pool: the new k must be written at each row's position, nothing else"
        assert same_bits(dev.v.get(), pool.v), "V pool: the new v must be written at each row's position, nothing else"
    if o16:
        res["o16"] = out16.get()
    if oq:
        res["oq"], res["od"] = q8.get(), d8.get()
    return res, ref


def _check_decode(fk, c, fuse, tol=TOL_QS, **kw):
    res, ref = run_decode(fk, c, fuse, **kw)
    err, cos = rel_err(res["out"], ref), row_cosine_min(res["out"], ref)
    print(f"decode H{c.H}/{c.KVH} D{c.D} n {c.n} max len {int(c.positions.max()) + 1} window {c.window} "
          f"fuse {fuse} {kw}: rel.err {err:.2e} cos {cos:.7f}")
    assert err <= tol and cos >= 0.99999
    return res, ref


@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-rope", "roped"])
@pytest.mark.parametrize("window", [0, 512])
def test_decode_batch(fk, rng, shape, fuse, window):
    """A batch of rows of very different lengths (1, around a block, around the single-pass limit,
    a few thousand), including padded rows of a bucket."""
    H, KVH, D = shape
    lengths = [1, 15, 17, 255, 257, 1000, 2049, int(rng.integers(2, 4000))]
    c = decode_case(rng, lengths, H, KVH, D, int(rng.choice([16, 32])), window, fuse=fuse,
                    neox=bool(rng.integers(2)), theta=1e6, pad_rows=2)
    _check_decode(fk, c, fuse)


@pytest.mark.parametrize("shape", [(12, 2, 128), (14, 2, 64), (4, 1, 256)], ids=_sid)
@pytest.mark.parametrize("length", [4096, 16384, 17_001])
def test_decode_long_single_row(fk, rng, shape, length):
    """Batch 1 at depth: the row split as far as the launcher allows (two combine levels)."""
    H, KVH, D = shape
    c = decode_case(rng, [length], H, KVH, D, 16, 0, fuse=True, theta=1e6)
    _check_decode(fk, c, True)


@pytest.mark.parametrize("n", [16, 64])
def test_decode_wide_batch_at_depth(fk, rng, n):
    lengths = rng.integers(1, 2500, n).tolist()
    lengths[0] = 4096
    c = decode_case(rng, lengths, 12, 2, 128, 16, 0, fuse=True, theta=1e6)
    _check_decode(fk, c, True)


@pytest.mark.parametrize("knobs", [dict(single_max=0, split_keys=64, splits=64), dict(single_max=1 << 30),
                                   dict(single_max=128, split_keys=256, splits=5), dict(qsplit=False)],
                         ids=["always-split", "never-split", "coarse", "fp16-q"])
def test_decode_knobs(fk, rng, knobs):
    """The launch knobs the benchmark sweeps give the same results."""
    c = decode_case(rng, [1, 100, 700, 3000], 12, 2, 128, 16, 0, fuse=True)
    _check_decode(fk, c, True, tol=TOL if knobs.get("qsplit") is False else TOL_QS, **knobs)


def _need_clusters():
    import cupy

    from realizar_backend.backends.cuda import pdl
    if int(cupy.cuda.Device().compute_capability) < 90 or pdl.launcher() is None:
        pytest.skip("thread-block clusters need compute capability 9.0 and cuLaunchKernelEx")


@pytest.mark.parametrize("shape", [(12, 2, 128), (14, 2, 64), (4, 1, 256), (8, 8, 128)], ids=_sid)
@pytest.mark.parametrize("cluster", [2, 4, 8])
def test_decode_in_clusters(fk, rng, shape, cluster):
    """Splits combined through distributed shared memory, then (more splits than a cluster) across
    clusters: rows of one pass, of fewer splits than a cluster (empty blocks in it), of one cluster,
    of several, and padded rows."""
    _need_clusters()
    H, KVH, D = shape
    lengths = [1, 300, 257 + 64 * (cluster - 1), 1000, 4096, int(rng.integers(2, 9000))]
    c = decode_case(rng, lengths, H, KVH, D, 16, 0, fuse=True, neox=bool(rng.integers(2)), theta=1e6, pad_rows=1)
    _check_decode(fk, c, True, splits=64, cluster=cluster)


# (H, KVH, D): Qwen3-30B-A3B (a group of 8), Qwen3-8B (32/8), gemma3 (256 dims), qwen3-0.6B-like 16/8
HEAD_NORM_SHAPES = [(32, 4, 128), (32, 8, 128), (8, 4, 256), (16, 8, 128)]


@pytest.mark.parametrize("shape", HEAD_NORM_SHAPES, ids=_sid)
@pytest.mark.parametrize("cluster", [1, 8])
def test_decode_head_norms(fk, kernels, rng, shape, cluster):
    """The per-head q/k norms (qwen3, gemma3) folded into the fused decode: output and pool bit for
    bit those of the rms_norm launches over q and the new k followed by the same launch without them
    (what the prompt path runs, and every step ran before the fusion), and near the float64 twin;
    rows of one pass, split, split in clusters, and a padded row."""
    if cluster > 1:
        _need_clusters()
    H, KVH, D = shape
    c = decode_case(rng, [1, 17, 300, 2049, int(rng.integers(2, 5000))], H, KVH, D, 16, 0, fuse=True,
                    neox=bool(rng.integers(2)), theta=1e6, pad_rows=1)
    c.q *= rng.uniform(0.2, 5.0, (c.n, H, 1)).astype(np.float32)     # heads of their own scales
    c.k *= rng.uniform(0.2, 5.0, (c.n, KVH, 1)).astype(np.float32)
    hn = head_norm_weights(rng, D)
    splits = 64 if cluster > 1 else None         # (the planner's split count for these few rows is under a cluster)
    fused, ref = run_decode(fk, c, True, splits=splits, cluster=cluster, head_norms=hn)
    apart, _ = run_decode(fk, c, True, splits=splits, cluster=cluster, head_norms=hn, norm_first=kernels)
    assert same_bits(fused["kpool"], apart["kpool"]) and same_bits(fused["vpool"], apart["vpool"])
    assert np.array_equal(fused["out"], apart["out"])
    err = rel_err(fused["out"], ref)
    print(f"decode with head norms H{H}/{KVH} D{D} cluster {cluster}: rel.err {err:.2e}")
    assert err <= TOL_QS and row_cosine_min(fused["out"], ref) >= 0.99999


@pytest.mark.parametrize("length", [4096, 16384, 17_001])
def test_decode_long_single_row_in_clusters(fk, rng, length):
    """Batch 1 at depth as the decode graphs launch it on sm_90: 128 splits in clusters of 8."""
    _need_clusters()
    c = decode_case(rng, [length], 12, 2, 128, 16, 0, fuse=True, theta=1e6)
    _check_decode(fk, c, True, cluster=8)


@pytest.mark.parametrize("lengths", [[4096], [16384], [300, 5000, 9000]], ids=["4096", "16384", "three"])
def test_decode_cluster_last_level_waits_or_votes_alike(fk, rng, lengths):
    """The cross-cluster combine run by cluster 0 waiting for the others' flagged partials (what the
    one-row plan of the decode graphs does), and by the last cluster to arrive at a counter (what
    launches too big to wait use): the same bits, and both leave the counters and the flagged
    words at zero."""
    _need_clusters()
    from realizar_backend.backends.cuda import flash
    c = decode_case(rng, lengths, 12, 2, 128, 16, 0, fuse=True, theta=1e6)
    splits = flash.decode_cluster(flash.decode_splits(c.n, c.KVH, fk.sm_count, clusters=True), True)[0]
    plan = flash.plan_decode(c.n, c.H, c.KVH, c.D, splits=splits, cluster=8)
    if c.n == 1:
        assert fk.spins(plan)
    sm, res = fk.sm_count, {}
    try:
        for path, count in (("waits", 1 << 20), ("votes", 1)):   # as if every launch fits / none does
            fk.sm_count = count
            assert fk.spins(plan) == (path == "waits")
            res[path], ref = run_decode(fk, c, True, splits=splits, cluster=8)
    finally:
        fk.sm_count = sm
    assert same_bits(res["waits"]["out"], res["votes"]["out"])
    assert rel_err(res["votes"]["out"], ref) <= TOL_QS


def test_decode_clusters_outputs_window_and_pdl(fk, rng):
    """fp16 and 8-bit outputs (per 32-dim slice, as the cluster's blocks own them), a sliding
    window, q roped before (no fuse), and a programmatic dependent launch, all in clusters."""
    _need_clusters()
    c = decode_case(rng, [3, 700, 5000], 8, 2, 128, 16, 512, fuse=False, theta=1e6)
    res, ref = _check_decode(fk, c, False, o16=True, oq=True, pdl=True, cluster=4, splits=32)
    assert rel_err(res["o16"], ref) <= 1.5e-3
    q = res["oq"].astype(np.float64).reshape(c.n, c.H, c.D // 32, 32)
    d = res["od"].reshape(c.n, c.H, c.D // 32, 2)
    assert rel_err((q * d[..., :1]).reshape(ref.shape), ref) <= 1.5e-2


def test_decode_partial_rope_and_outputs(fk, rng):
    """rope_dim < head_dim, normal (GGUF llama) pairs, fp16 and 8-bit outputs."""
    c = decode_case(rng, [3, 300, 1500], 8, 2, 128, 16, 0, fuse=True, rope_dim=64, neox=False)
    res, ref = _check_decode(fk, c, True, o16=True, oq=True)
    assert rel_err(res["o16"], ref) <= 1.5e-3
    q = res["oq"].astype(np.float64).reshape(c.n, c.H, c.D // 32, 32)
    d = res["od"].reshape(c.n, c.H, c.D // 32, 2)
    assert rel_err((q * d[..., :1]).reshape(ref.shape), ref) <= 1.5e-2      # half a step of 1/127
    assert np.allclose(d[..., 1], d[..., 0] * q.sum(-1), rtol=1e-6)


def test_decode_yarn_table(fk, rng):
    """A YaRN-scaled model (Qwen2.5's long-context setting): the kernel reads the scaled cos/sin
    (mscale included) from ops.rope_table, the oracle computes the same scaling."""
    from realizar_backend.model.config import RopeScaling
    c = decode_case(rng, [40, 20_000, 33_000], 12, 2, 128, 16, 0, fuse=True, theta=1e6)
    c.scaling = RopeScaling("yarn", factor=4.0, original_context=32768, mscale=1 + 0.1 * np.log(4.0))
    _check_decode(fk, c, True)


def test_decode_programmatic_launch(fk, rng):
    import cupy
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    c = decode_case(rng, [50, 5000], 12, 2, 128, 16, 0, fuse=True)
    _check_decode(fk, c, True, pdl=True)


def test_decode_graph_replays_at_every_length(fk, rng):
    """One capture per batch bucket: the graph, captured at short lengths, replays step after step
    as the rows grow past the single-pass limit and into several splits (positions, the new k/v
    and q change in place between replays), each step equal to the oracle, the pool growing by
    exactly one key per row per step."""
    import cupy

    from realizar_backend.backends.cuda import flash
    from realizar_backend.backends.cuda.ops import rope_table
    H, KVH, D, n = 12, 2, 128, 3
    start = [250, 5, 1000]
    steps = 12
    c = decode_case(rng, [s + steps for s in start], H, KVH, D, 16, 0, fuse=True, theta=1e6)
    pos0 = c.positions - steps                      # the pool holds keys [0, pos0) now; later rows NaN
    for t in range(n):
        for p in range(int(pos0[t]), int(c.positions[t]) + 1):
            c.pool.set_row(int(c.slots[t]), p, np.float16(np.nan), np.float16(np.nan))
    dev = _Dev(c)
    # the plan of a decode graph (Forward): in clusters where the device launches them
    clusters = int(cupy.cuda.Device().compute_capability) >= 90
    splits, cl = flash.decode_cluster(flash.decode_splits(n, KVH, fk.sm_count, clusters=clusters), clusters)
    plan = flash.plan_decode(n, H, KVH, D, splits=splits, cluster=cl)
    scratch = flash.FlashScratch()
    scratch.ensure(plan)
    table = rope_table(int(c.positions.max()) + 1, D, c.theta)
    kin, vin = cupy.zeros((n, KVH, D), cupy.float32), cupy.zeros((n, KVH, D), cupy.float32)
    out = _poisoned((n, H, D), cupy.float32)
    pos = cupy.asarray(pos0.astype(np.int32))
    fk.get(plan)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        flash.decode(fk, plan, dev.q.data.ptr, out.data.ptr, dev.k.data.ptr, dev.v.data.ptr, dev.bt.data.ptr,
                     c.pool.max_blocks, c.pool.bs_log2, dev.slots.data.ptr, pos.data.ptr, n, H, KVH, D, c.scale, 0,
                     scratch, rope=(kin.data.ptr, vin.data.ptr, D, c.neox, table.data.ptr), single_max=256)
        graph = stream.end_capture()
    host = c.pool
    for step in range(steps + 1):
        p = pos0 + step
        q = rng.standard_normal((n, H, D)).astype(np.float32)
        k = rng.standard_normal((n, KVH, D)).astype(np.float32)
        v = rng.standard_normal((n, KVH, D)).astype(np.float32)
        dev.q.set(q)
        kin.set(k)
        vin.set(v)
        pos.set(p.astype(np.int32))
        out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        ref, host = decode_expected(DecodeCase(H, KVH, D, 0, c.scale, host, q, k, v, c.slots, p, D, c.neox, c.theta),
                                    True)
        err = rel_err(out.get(), ref)
        assert err <= TOL_QS, f"step {step} (positions {p.tolist()}): rel.err {err:.2e}"
        assert same_bits(dev.k.get(), host.k) and same_bits(dev.v.get(), host.v), f"step {step}: pool"
        assert not scratch.counters.any()


# ------------------------------------------------------------------ attention sinks (gpt-oss)
# gpt-oss's attention: 64-dim heads, 64 q heads over 8 KV heads (the 20B/120B models), windows of 128
GPTOSS = (64, 8, 64)


def _sinks(rng, H: int) -> np.ndarray:
    """Sink logits around the scores' range (a real share of each row's softmax), one far above
    every score (its head's outputs near 0) and one far below (no effect)."""
    s = rng.uniform(-1.0, 3.0, H).astype(np.float32)
    s[0], s[-1] = 40.0, -40.0
    return s


@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "split"])
def test_prefill_sinks(fk, rng, window, splits):
    """Each head's sink logit in its rows' softmax denominators: in one pass, and where the split
    partials combine (the partials themselves sink-free)."""
    H, KVH, D = GPTOSS
    c = prefill_case(rng, [(0, 300), (500, 70), (7, 1)], H, KVH, D, 16, window)
    sinks = _sinks(rng, H)
    out = _check_prefill(fk, c, splits=splits, min_split_keys=64, sinks=sinks)
    assert np.abs(out[:, 0]).max() < 1e-6
    plain = oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window)
    assert rel_err(out, plain) > 50 * TOL              # without the sinks the rows are far off


@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-rope", "roped"])
def test_decode_sinks(fk, rng, window, fuse):
    """Rows of one pass, of one combine level and of two, each head's sink in its row's softmax."""
    H, KVH, D = GPTOSS
    c = decode_case(rng, [1, 100, 700, 5000], H, KVH, D, 16, window, fuse=fuse, neox=True, theta=150000.0,
                    pad_rows=1)
    sinks = _sinks(rng, H)
    res, ref = _check_decode(fk, c, fuse, sinks=sinks)
    assert np.abs(res["out"][:, 0]).max() < 1e-6
    assert rel_err(res["out"], decode_expected(c, fuse)[0]) > 50 * TOL_QS


@pytest.mark.parametrize("cluster", [2, 8])
def test_decode_sinks_in_clusters(fk, rng, cluster):
    """The cluster combine (distributed shared memory, then across clusters) adds the sinks too."""
    _need_clusters()
    H, KVH, D = GPTOSS
    c = decode_case(rng, [1, 300, 1000, 4096, 9000], H, KVH, D, 16, 0, fuse=True, theta=150000.0)
    sinks = _sinks(rng, H)
    res, _ = _check_decode(fk, c, True, splits=64, cluster=cluster, sinks=sinks)
    assert np.abs(res["out"][:, 0]).max() < 1e-6
