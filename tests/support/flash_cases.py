"""Random paged-attention cases for the flash kernels and their float64 oracle (backends/cpu.py
attention, apply_rope, rope_angles), shared by the CPU emulation test (test_flash_host.py) and the
GPU tests (gpu/test_flash_attention.py).

A pool is laid out as the CUDA backend's (kernels/paged_kv.cuh): K and V fp16
[num_blocks + 1, block_size, KVH, D], the last block scratch; each sequence owns a random,
permuted set of blocks through its block-table row. Every pool row a correct kernel must not
read (free blocks, the scratch block, positions past a sequence's end, unused block-table
entries, which point at the scratch block) holds NaN, so a stray read shows in the output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from realizar_backend.model.math import apply_rope, attention, rope_angles


@dataclass
class Pool:
    k: np.ndarray                # fp16 [num_blocks + 1, bs, KVH, D]
    v: np.ndarray
    bt: np.ndarray               # int32 [slots, max_blocks]
    bs: int
    lengths: list[int]           # keys written per slot

    @property
    def max_blocks(self) -> int:
        return self.bt.shape[1]

    @property
    def bs_log2(self) -> int:
        return self.bs.bit_length() - 1

    def rows(self, slot: int, upto: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions [0, upto) of a slot, [upto, KVH, D]."""
        p = np.arange(upto)
        blk = self.bt[slot, p // self.bs]
        return self.k[blk, p % self.bs], self.v[blk, p % self.bs]

    def set_row(self, slot: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        blk = self.bt[slot, pos // self.bs]
        self.k[blk, pos % self.bs] = k
        self.v[blk, pos % self.bs] = v

    def row_index(self, slot: int, pos: int) -> tuple[int, int]:
        return int(self.bt[slot, pos // self.bs]), pos % self.bs


def make_pool(rng, lengths: list[int], KVH: int, D: int, bs: int, spare_blocks: int = 3,
              spare_table: int = 2) -> Pool:
    """lengths[s]: positions of slot s that hold keys; the blocks come in a random order."""
    need = [-(-L // bs) for L in lengths]
    nblocks = sum(need) + spare_blocks
    max_blocks = max(need) + spare_table
    k = np.full((nblocks + 1, bs, KVH, D), np.nan, np.float16)
    v = np.full((nblocks + 1, bs, KVH, D), np.nan, np.float16)
    bt = np.full((len(lengths), max_blocks), nblocks, np.int32)   # unused entries: the scratch block
    order = rng.permutation(nblocks)
    at = 0
    for s, (L, nb) in enumerate(zip(lengths, need)):
        bt[s, :nb] = order[at:at + nb]
        at += nb
        p = np.arange(L)
        blk = bt[s, p // bs]
        k[blk, p % bs] = rng.standard_normal((L, KVH, D)).astype(np.float16)
        v[blk, p % bs] = rng.standard_normal((L, KVH, D)).astype(np.float16)
    return Pool(k, v, bt, bs, list(lengths))


@dataclass
class PrefillCase:
    H: int
    KVH: int
    D: int
    window: int
    scale: float
    pool: Pool
    q: np.ndarray                # fp32 [n, H, D]
    slots: np.ndarray            # int32 [n]
    positions: np.ndarray        # int32 [n]
    items: list = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.positions)


def prefill_case(rng, items, H: int, KVH: int, D: int, bs: int = 16, window: int = 0,
                 q_scale: float = 1.0) -> PrefillCase:
    """items = [(prefix, rows)]: item i is slot i, whose rows sit at positions prefix..prefix+rows-1
    and whose keys (cached prefix and the rows themselves) are all in the pool; the items' rows lie
    back to back in the launch. q_scale widens the scores (a sharper softmax)."""
    pool = make_pool(rng, [p + r for p, r in items], KVH, D, bs)
    slots = np.concatenate([np.full(r, s, np.int32) for s, (_, r) in enumerate(items)])
    pos = np.concatenate([np.arange(p, p + r, dtype=np.int32) for p, r in items])
    q = (rng.standard_normal((len(pos), H, D)) * q_scale).astype(np.float32)
    return PrefillCase(H, KVH, D, window, D ** -0.5, pool, q, slots, pos, list(items))


def oracle(pool: Pool, q: np.ndarray, slots, positions, scale: float, window: int,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """float64 attention of each row over its slot's keys [0, pos] (the oracle masks the window;
    sinks [H]: each head's sink logit in the softmax)."""
    out = []
    for t in range(len(positions)):
        kk, vv = pool.rows(int(slots[t]), int(positions[t]) + 1)
        out.append(attention(q[t:t + 1].astype(np.float64), kk.astype(np.float64), vv.astype(np.float64),
                             positions[t:t + 1], scale, window, sinks))
    return np.concatenate(out).reshape(q.shape)


@dataclass
class DecodeCase:
    H: int
    KVH: int
    D: int
    window: int
    scale: float
    pool: Pool
    q: np.ndarray                # fp32 [n, H, D]: unrotated (fuse) or roped
    k: np.ndarray | None         # fp32 [n, KVH, D]: the step's new k and v (fuse)
    v: np.ndarray | None
    slots: np.ndarray
    positions: np.ndarray
    rope_dim: int
    neox: bool
    theta: float
    scaling: object = None       # model.config.RopeScaling of the rope table (None: plain RoPE)

    @property
    def n(self) -> int:
        return len(self.positions)


def decode_case(rng, lengths, H: int, KVH: int, D: int, bs: int = 16, window: int = 0, fuse: bool = True,
                rope_dim: int = 0, neox: bool = True, theta: float = 10000.0, pad_rows: int = 0) -> DecodeCase:
    """One row per sequence, row t at position lengths[t] - 1. fuse: the pool holds keys
    [0, pos) and NaN at pos (the kernel writes the step's k and v there); else keys [0, pos].
    pad_rows: extra rows of a bucketed batch, pointing at a one-position slot of their own."""
    lengths = list(lengths) + [1] * pad_rows
    pool = make_pool(rng, lengths, KVH, D, bs)
    n = len(lengths)
    pos = np.array([L - 1 for L in lengths], np.int32)
    slots = np.arange(n, dtype=np.int32)
    perm = rng.permutation(n)                 # rows in another order than slots
    slots, pos = slots[perm], pos[perm]
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    k = v = None
    if fuse:
        k = rng.standard_normal((n, KVH, D)).astype(np.float32)
        v = rng.standard_normal((n, KVH, D)).astype(np.float32)
        for t in range(n):
            pool.set_row(int(slots[t]), int(pos[t]), np.float16(np.nan), np.float16(np.nan))
    return DecodeCase(H, KVH, D, window, D ** -0.5, pool, q, k, v, slots, pos, rope_dim or D, neox, theta)


@dataclass
class HeadNorms:
    """A decode launch's per-head q and k norms (qwen3, gemma3): fp32 [D] weights each, and eps."""
    q: np.ndarray
    k: np.ndarray
    eps: np.float32


def head_norm_weights(rng, D: int, eps: float = 1e-6) -> HeadNorms:
    """Weights spread around 1 (a few small, one negative), as trained q/k norms are."""
    def w():
        x = rng.uniform(0.3, 2.5, D).astype(np.float32)
        x[rng.integers(D)] = -0.7
        return x
    return HeadNorms(w(), w(), np.float32(eps))


def head_norm_f32(x: np.ndarray, w: np.ndarray, eps) -> np.ndarray:
    """norm.cu's rms_norm of each head (the last axis: D values, a multiple of 32, at most 256) as
    ops.rms_norm launches it over the heads (D threads a row), in float32 step by step: each warp's
    32 squares summed by warp_sum's butterfly, then the warps' sums by another; x * inv * w with inv =
    1 / sqrt(sum / D + eps). Bit for bit the launch's output where rsqrtf is 1 / sqrtf (the host
    emulators', tests/host/host_intrinsics.h); on a GPU within rsqrtf's error."""
    f32 = np.float32
    x = np.asarray(x, f32)
    D = x.shape[-1]
    assert D % 32 == 0 and D <= 256, D
    lane = np.arange(32)

    def warp_sum(v):                        # v [..., 32]: every lane's value after the butterfly
        for o in (16, 8, 4, 2, 1):
            v = v + v[..., lane ^ o]
        return v
    sq = (x * x).reshape(x.shape[:-1] + (D // 32, 32))
    partial = warp_sum(sq)[..., 0]                                  # [..., warps]
    t = np.zeros(x.shape[:-1] + (32,), f32)
    t[..., :D // 32] = partial
    total = warp_sum(t)[..., :1]
    inv = f32(1.0) / np.sqrt(total / f32(D) + f32(eps))
    return x * inv * np.asarray(w, f32)


def decode_expected(c: DecodeCase, fuse: bool, sinks: np.ndarray | None = None,
                    head_norms: HeadNorms | None = None) -> tuple[np.ndarray, Pool]:
    """(attention output, the pool as the kernel must leave it; sinks [H]: each head's sink logit;
    head_norms (fuse only): q and the new k through head_norm_f32 before RoPE)."""
    import copy
    pool = copy.deepcopy(c.pool)
    q = c.q
    if fuse:
        cos, sin = rope_angles(c.positions, c.rope_dim, float(np.float32(c.theta)), c.scaling)
        style = "neox" if c.neox else "normal"
        kn = c.k
        if head_norms is not None:
            q, kn = head_norm_f32(c.q, head_norms.q, head_norms.eps), head_norm_f32(c.k, head_norms.k, head_norms.eps)
        q = apply_rope(q, cos, sin, style)
        rk = apply_rope(kn, cos, sin, style).astype(np.float16)
        for t in range(c.n):
            pool.set_row(int(c.slots[t]), int(c.positions[t]), rk[t], c.v[t].astype(np.float16))
    return oracle(pool, q, c.slots, c.positions, c.scale, c.window, sinks), pool


def rope_table_host(ctx: int, rope_dim: int, theta: float, scaling=None) -> np.ndarray:
    """ops.rope_table's contents, float32 [ctx, rope_dim / 2, 2]."""
    cos, sin = rope_angles(np.arange(ctx), rope_dim, float(np.float32(theta)), scaling)
    return np.stack([cos, sin], axis=-1).astype(np.float32)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| over max |ref| (NaN anywhere: inf)."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def row_cosine_min(got: np.ndarray, ref: np.ndarray) -> float:
    """The smallest cosine similarity between matching (row, head) vectors."""
    g = np.asarray(got, np.float64).reshape(-1, got.shape[-1])
    r = np.asarray(ref, np.float64).reshape(-1, ref.shape[-1])
    num = np.sum(g * r, axis=1)
    den = np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1) + 1e-300
    return float(np.min(num / den))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """fp16 arrays equal bit for bit (NaN included)."""
    return np.array_equal(a.view(np.uint16), b.view(np.uint16))
