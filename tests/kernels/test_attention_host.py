"""attention.cu run on the CPU (tests/host/attention_emu.cpp over cuda_emu.h: every thread a fiber, the
warp shuffles rendezvous of the real 32 lanes): decode rows with RoPE and the KV write folded in
(attn_decode) and prompt rows in tiles (attn_tile, attn_tile_v2), launched as backends/cuda/ops.py
attention launches them, against the float64 oracle on paged pools whose unread rows are NaN, outputs
poisoned. Here: gpt-oss's attention (64-dim heads, a group of 8 q heads, sinks, a sliding window),
the path its short decode rows take, and the per-head q/k norms of qwen3 and gemma3 folded into the
decode launch. The GPU tests (tests/gpu/test_kernels.py) check the same on the device. Skipped
without g++."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from support import host_emu
from support.flash_cases import (decode_case, decode_expected, head_norm_weights, oracle, prefill_case, rel_err,
                                 rope_table_host, same_bits)
from support.host_emu import GXX, KERNELS
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

TOL = 1e-4          # fp32 scores and sums over fp16 K/V: max |error| over max |ref|
# the launch shape's constants, from the kernel source (backends/cuda/ops.py holds the same)
DEFINES = {m[1]: int(m[2]) for m in re.finditer(r"#define (ATT_\w+) (\d+)\b", (KERNELS / "attention.cu").read_text())}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return host_emu.build("attention_emu.cpp", tmp_path_factory.mktemp("attention_emu") / "attention_emu")


def _run(exe, d: Path, params: dict, arrays: dict, seed: int) -> dict:
    out = (np.float32, (params["n"], params["H"], params["D"]))
    return host_emu.launch(exe, d, params, arrays, {"out": out, "kpool": np.float16, "vpool": np.float16},
                           env={"EMU_SEED": str(seed)}, timeout=900, label=f"EMU_SEED={seed}")


def _sinks(rng, H: int) -> np.ndarray:
    """Sink logits around the scores' range, one far above every score, one far below."""
    s = rng.uniform(-1.0, 3.0, H).astype(np.float32)
    s[0], s[-1] = 40.0, -40.0
    return s


def _common(c) -> dict:
    return dict(n=c.n, H=c.H, KVH=c.KVH, D=c.D, scale=repr(c.scale), window=c.window,
                max_blocks=c.pool.max_blocks, bs_log2=c.pool.bs_log2)


@pytest.mark.parametrize("window", [0, 32])
def test_decode_sinks(emu, tmp_path, rng, window):
    """attn_decode: each row's q and new k roped from the table, the new k and v written to the pool,
    each head's sink logit in its row's softmax."""
    c = decode_case(rng, [1, 40, 300, 7], 8, 1, 64, 16, window, fuse=True, neox=True, theta=150000.0)
    sinks = _sinks(rng, c.H)
    rt = rope_table_host(int(c.positions.max()) + 1, c.rope_dim, c.theta)
    params = dict(kernel="attn_decode", gx=c.n, gy=c.H, threads=32 * DEFINES["ATT_WARPS"], rope_dim=c.rope_dim,
                  style=int(c.neox), **_common(c))
    arrays = dict(q=c.q, kin=c.k, vin=c.v, rt=rt, kpool=c.pool.k, vpool=c.pool.v, bt=c.pool.bt, slots=c.slots,
                  positions=c.positions, sinks=sinks)
    res = _run(emu, tmp_path / "run", params, arrays, int(rng.integers(1 << 31)))
    ref, pool = decode_expected(c, True, sinks)
    assert same_bits(res["kpool"].reshape(pool.k.shape), pool.k) and same_bits(res["vpool"].reshape(pool.v.shape), pool.v)
    assert rel_err(res["out"], ref) <= TOL
    assert np.abs(res["out"][:, 0]).max() < 1e-6                 # the dominant sink takes all of head 0
    assert rel_err(res["out"], decode_expected(c, True)[0]) > 100 * TOL     # the sinks matter here


# (H, KVH, D, rope_dim, neox): qwen3's group of 8 on 128-dim heads; a partial rotation (the dims
# past it normed, not rotated); gemma3's 256-dim heads
HEAD_NORMS = [(8, 1, 128, 128, True), (4, 2, 64, 32, False), (4, 2, 256, 256, True)]


@pytest.mark.parametrize("case", HEAD_NORMS, ids=lambda c: f"D{c[2]}-H{c[0]}/{c[1]}-rope{c[3]}")
def test_decode_head_norms(emu, tmp_path, rng, case):
    """attn_decode with the per-head q/k norms folded in: the new k in the pool bit for bit as the
    separate rms_norm launch, then RoPE, would leave it (head_norm_f32), the output against the
    oracle over the normed, roped q and pool; without the norms the output would be far off."""
    H, KVH, D, rope_dim, neox = case
    c = decode_case(rng, [1, 40, 130], H, KVH, D, 16, 0, fuse=True, rope_dim=rope_dim, neox=neox)
    c.q *= rng.uniform(0.2, 5.0, (c.n, H, 1)).astype(np.float32)     # heads of their own scales
    c.k *= rng.uniform(0.2, 5.0, (c.n, KVH, 1)).astype(np.float32)
    hn = head_norm_weights(rng, D)
    rt = rope_table_host(int(c.positions.max()) + 1, c.rope_dim, c.theta)
    params = dict(kernel="attn_decode", gx=c.n, gy=c.H, threads=32 * DEFINES["ATT_WARPS"], rope_dim=c.rope_dim,
                  style=int(c.neox), eps=repr(float(hn.eps)), **_common(c))
    arrays = dict(q=c.q, kin=c.k, vin=c.v, rt=rt, kpool=c.pool.k, vpool=c.pool.v, bt=c.pool.bt, slots=c.slots,
                  positions=c.positions, q_norm=hn.q, k_norm=hn.k)
    res = _run(emu, tmp_path / "run", params, arrays, int(rng.integers(1 << 31)))
    ref, pool = decode_expected(c, True, head_norms=hn)
    assert same_bits(res["kpool"].reshape(pool.k.shape), pool.k) and same_bits(res["vpool"].reshape(pool.v.shape), pool.v)
    assert rel_err(res["out"], ref) <= TOL
    assert rel_err(res["out"], decode_expected(c, True)[0]) > 100 * TOL


@pytest.mark.parametrize("window", [0, 32])
@pytest.mark.parametrize("D", [64, 128], ids=["tile_v2-d64", "tile-d128"])
def test_prompt_tiles_sinks(emu, tmp_path, rng, window, D):
    """attn_tile (4 dims a lane: D % 128 == 0) and attn_tile_v2: rows of two sequences, one a chunk
    after its cached prefix, each head's sink logit in each row's softmax."""
    c = prefill_case(rng, [(0, 37), (50, 20)], 8, 1, D, 16, window)
    sinks = _sinks(rng, c.H)
    TQ, KT = DEFINES["ATT_TQ"], DEFINES["ATT_KT"]
    params = dict(kernel="attn_tile" if D % 128 == 0 else "attn_tile_v2", gx=-(-c.n // TQ), gy=c.H, threads=TQ * 32,
                  smem=4 * (TQ * D + 2 * KT * (D + 4)), **_common(c))
    arrays = dict(q=c.q, kpool=c.pool.k, vpool=c.pool.v, bt=c.pool.bt, slots=c.slots, positions=c.positions,
                  sinks=sinks)
    res = _run(emu, tmp_path / "run", params, arrays, int(rng.integers(1 << 31)))
    ref = oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window, sinks)
    assert same_bits(res["kpool"].reshape(c.pool.k.shape), c.pool.k), "prompt rows must not write the pool"
    assert rel_err(res["out"], ref) <= TOL
    assert np.abs(res["out"][:, 0]).max() < 1e-6
    assert rel_err(res["out"], oracle(c.pool, c.q, c.slots, c.positions, c.scale, c.window)) > 100 * TOL
