"""NumPy twins of every kernel, and checks that run a kernel on fresh random inputs (outputs
poisoned with NaN first) and return its relative error against the twin in float64.

Used three ways: the start-up self-check (settings.self_check; refuse to start on any
disagreement), the GPU tests (many shapes, odd ones included), and by hand on the device.
"""

from __future__ import annotations

import dataclasses
import logging

import cupy
import numpy as np
from gguf import GGMLQuantizationType as Q

from ...errors import BackendError
from ...formats.gpu_layout import to_device
from ...formats.quants import dequantize, random_matrix
from ...model.config import ModelConfig
from ...model.arch import ARCHITECTURES
from ...model.math import apply_rope, attention, gelu_tanh, rms_norm, rope_angles, route, silu, swiglu_oai
from . import deltanet_twin, dispatch, ops
from .dispatch import moe_grouped_plan, same_shape
from .modules import QTYPES, Kernels
from .ops import WeightRef
from .support import dn_chunk_kernel

log = logging.getLogger(__name__)

TOL = 1e-3


def dot_err(got: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> float:
    """Error of dot products relative to their natural scale sum |w x| (inf if got is not finite)."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(scale), 1e-30))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


# ------------------------------------------------------------------ random inputs
# A random matrix as a GGUF file stores it (what Tensor.data holds): valid blocks, small scales.
random_weight = random_matrix


def upload_weight(qtype, host: np.ndarray, name: str = "w") -> tuple[WeightRef, cupy.ndarray]:
    """A matrix in GGUF bytes (random_weight) onto the device, in the device layout."""
    rows = host.shape[0]
    cols = host.shape[1] if qtype in (Q.F32, Q.F16) else host.shape[1] // QTYPES[qtype].block_bytes * QTYPES[qtype].block
    dev = cupy.asarray(to_device(qtype, host, cols).reshape(-1))
    return WeightRef(name, qtype, dev.data.ptr, rows, cols, ops.row_bytes(qtype, cols)), dev


def _poison(shape, dtype=np.float32, byte: int = 0xFF) -> cupy.ndarray:
    """An output buffer every byte of which is `byte` (0xFF: NaN in every float width, -1 in the
    integer ones). A memset, not cupy.full: CuPy's own elementwise kernels compile on first use,
    seconds on a cold start with an empty kernel cache."""
    a = cupy.empty(shape, dtype)
    cupy.cuda.runtime.memsetAsync(a.data.ptr, byte, a.nbytes, cupy.cuda.get_current_stream().ptr)
    return a


def _nan(shape, dtype=np.float32) -> cupy.ndarray:
    return _poison(shape, dtype)


def _dev(a: np.ndarray) -> cupy.ndarray:
    return cupy.asarray(np.ascontiguousarray(a))


def _ptr(a: cupy.ndarray | None) -> int:
    return 0 if a is None else a.data.ptr


# ------------------------------------------------------------------ checks (return rel. error)
def check_gemv(k: Kernels, qtype, N: int, K: int, nb: int, rng, bias: bool = False, accumulate: bool = False) -> float:
    host = random_weight(qtype, N, K, rng)
    w, keep = upload_weight(qtype, host)
    x = rng.standard_normal((nb, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    y0 = rng.standard_normal((nb, N)).astype(np.float32)
    y = _dev(y0) if accumulate else _nan((nb, N))
    bd, xd = (_dev(b) if bias else None), _dev(x)
    ops.gemv(k, w, xd.data.ptr, K, y.data.ptr, N, nb, _ptr(bd), accumulate)
    ref = x.astype(np.float64) @ dequantize(host, qtype, (N, K)).astype(np.float64).T
    if bias:
        ref += b
    if accumulate:
        ref += y0
    return rel_err(y.get(), ref)


def check_ffn(k: Kernels, qtype, N: int, K: int, nb: int, act: int, rng) -> float:
    hg, hu = random_weight(qtype, N, K, rng), random_weight(qtype, N, K, rng)
    ups = [upload_weight(qtype, h) for h in (hg, hu)]   # holds both device buffers until the check returns
    (wg, _), (wu, _) = ups
    x = rng.standard_normal((nb, K)).astype(np.float32)
    xd, a = _dev(x), _nan((nb, N))
    ops.ffn_gate_up(k, wg, wu, xd.data.ptr, K, a.data.ptr, N, nb, act)
    x64 = x.astype(np.float64)
    g = x64 @ dequantize(hg, qtype, (N, K)).astype(np.float64).T
    u = x64 @ dequantize(hu, qtype, (N, K)).astype(np.float64).T
    return rel_err(a.get(), (gelu_tanh(g) if act else silu(g)) * u)


def _rms_norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * w.astype(np.float64)


def q8_rows(x: np.ndarray) -> np.ndarray:
    """mmv8.cu's 8-bit activations (mmv8_quant) of float32 rows x [nb, K] as float64 values q d: per
    32 values d = max|x| / 127 and q = rint(x / d), rounded in float32 as the kernel does."""
    u = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(u).max(axis=2) / np.float32(127.0)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    q = np.rint(u * inv[..., None])
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(x.shape[0], -1)


def _q8_input(x: np.ndarray, nw, eps: float) -> np.ndarray:
    """The activations an mmv8.cu launch multiplies, from float32 rows x [nb, K] (nw: with the folded
    RMSNorm, rounded as the kernel rounds it: (x inv) nw in float32)."""
    if nw is not None:
        inv = (1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + eps)).astype(np.float32)
        x = (x * inv).astype(np.float32) * nw
    return q8_rows(x)


def _norm_input(rng, K: int, norm: bool):
    """A norm weight on the device and (ptr, eps) for a folded-norm launch, or Nones."""
    if not norm:
        return None, None, None
    w = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    wd = _dev(w)
    return w, wd, (wd.data.ptr, 1e-6)


def check_mmvf(k: Kernels, segs, K: int, nb: int, rng, bias: bool = False, accumulate: bool = False,
               x_pad: int = 4, norm: bool = False, head: bool = False, q8: bool = False) -> float:
    """mmvf.cu: segs = [(qtype, rows)], up to three matrices sharing one fp32 input (row stride
    K + x_pad), outputs with a row stride wider than the rows (the tail must stay untouched);
    norm: the input is RMSNorm(x) folded into the launch; head: launched as the LM head; q8: mmv8.cu's
    launch, against the input as its 8-bit twin (q8_rows)."""
    x = (rng.standard_normal((nb, K + x_pad)) * rng.uniform(0.1, 30.0, (nb, 1))).astype(np.float32)
    xd = _dev(x)
    nw, nwd, nrm = _norm_input(rng, K, norm)
    if q8:
        x64 = _q8_input(x[:, :K], nw, 1e-6)
    else:
        x64 = _rms_norm64(x[:, :K], nw, 1e-6) if norm else x[:, :K].astype(np.float64)
    keep, launch, checks = [], [], []
    for qt, N in segs:
        host = random_weight(qt, N, K, rng)
        w, dev = upload_weight(qt, host)
        b = rng.standard_normal(N).astype(np.float32) if bias else None
        ys = N + 3
        y0 = rng.standard_normal((nb, ys)).astype(np.float32)
        y = _dev(y0) if accumulate else _nan((nb, ys))
        bd = _dev(b) if bias else None
        keep += [dev, bd, y]
        launch.append((w, _ptr(bd), y.data.ptr, ys))
        w64 = dequantize(host, qt, (N, K)).astype(np.float64)
        ref = x64 @ w64.T
        # the error scale of an fp32 dot product is sum |w x|, not |w . x|: a single output with
        # heavy cancellation would otherwise fail an exact kernel
        scale = np.abs(x64) @ np.abs(w64).T
        if bias:
            ref += b
            scale += np.abs(b)
        if accumulate:
            ref += y0[:, :N]
            scale += np.abs(y0[:, :N])
        checks.append((y, ref, y0, N, scale))
    ops.mmvf(k, launch, K, xd.data.ptr, K + x_pad, nb, accumulate, norm=nrm, head=head, q8=q8)
    errs = []
    for y, ref, y0, N, scale in checks:
        got = y.get()
        tail_ok = np.array_equal(got[:, N:], y0[:, N:]) if accumulate else bool(np.all(np.isnan(got[:, N:])))
        errs.append(dot_err(got[:, :N], ref, scale) if tail_ok else float("inf"))
    return max(errs)


def check_ffn_f(k: Kernels, qtype, N: int, K: int, nb: int, act: int, rng, norm: bool = False,
                q8: bool = False) -> float:
    """mmvf.cu's fused gate/up/activation on fp32 activations, into an output of row stride N + 5
    (norm: with RMSNorm of the input folded in; q8: mmv8.cu's ffn8 against the 8-bit twin)."""
    hg, hu = random_weight(qtype, N, K, rng), random_weight(qtype, N, K, rng)
    ups = [upload_weight(qtype, h) for h in (hg, hu)]   # holds both device buffers until the check returns
    (wg, _), (wu, _) = ups
    x = rng.standard_normal((nb, K)).astype(np.float32)
    xd, a = _dev(x), _nan((nb, N + 5))
    nw, nwd, nrm = _norm_input(rng, K, norm)
    ops.ffn_f(k, wg, wu, xd.data.ptr, K, a.data.ptr, N + 5, nb, act, norm=nrm, q8=q8)
    if q8:
        x64 = _q8_input(x, nw, 1e-6)
    else:
        x64 = _rms_norm64(x, nw, 1e-6) if norm else x.astype(np.float64)
    wg64, wu64 = (dequantize(h, qtype, (N, K)).astype(np.float64) for h in (hg, hu))
    g, u = x64 @ wg64.T, x64 @ wu64.T
    got = a.get()
    if not np.all(np.isnan(got[:, N:])):
        return float("inf")
    act_g = gelu_tanh(g) if act else silu(g)
    # the error scale of act(g) * u from fp32 dot products: sum |w x| of each, carried through the
    # product (the activations' slopes stay below 1.2); a gate with heavy cancellation would
    # otherwise fail an exact kernel
    scale = 1.2 * (np.abs(x64) @ np.abs(wg64).T) * np.abs(u) + np.abs(act_g) * (np.abs(x64) @ np.abs(wu64).T)
    return dot_err(got[:, :N], act_g * u, scale)


def check_dequant(k: Kernels, qtype, N: int, K: int, rng) -> float:
    host = random_weight(qtype, N, K, rng)
    w, keep = upload_weight(qtype, host)
    out = _nan((N, K))
    ops.dequant(k, w, out.data.ptr, K)
    return rel_err(out.get(), dequantize(host, qtype, (N, K)))


def check_embed(k: Kernels, qtype, V: int, K: int, n: int, scale: float, rng) -> float:
    host = random_weight(qtype, V, K, rng)
    w, keep = upload_weight(qtype, host)
    tok = rng.integers(0, V, n).astype(np.int32)
    td, out = _dev(tok), _nan((n, K))
    ops.embed(k, w, td.data.ptr, n, scale, out.data.ptr, K)
    return rel_err(out.get(), dequantize(host, qtype, (V, K))[tok].astype(np.float64) * scale)


def check_rms_norm(k: Kernels, rows: int, width: int, add: bool, rng, eps: float = 1e-6) -> float:
    x = rng.standard_normal((rows, width)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    y0 = rng.standard_normal((rows, width)).astype(np.float32)
    xd, wd = _dev(x), _dev(w)
    out = _dev(y0) if add else _nan((rows, width))
    ops.rms_norm(k, xd.data.ptr, width, wd.data.ptr, out.data.ptr, width, rows, width, eps, add)
    ref = rms_norm(x, w, eps).astype(np.float64) + (y0 if add else 0)
    return rel_err(out.get(), ref)


# ------------------------------------------------------------------ Gated DeltaNet (kernels/deltanet.cu)
def check_deltanet(k: Kernels, cfg: ModelConfig, rng) -> tuple[float, float]:
    """dn_conv, then dn_delta on its output, against deltanet_twin.py over one step of a continued
    prompt chunk, a sequence's first rows, a decode row and a padding row on the scratch slot, each
    from a random state; (conv rel.err, delta rel.err), the states' included."""
    nk, dk, nv, dv, K = cfg.ssm_k_heads, cfg.ssm_k_dim, cfg.ssm_v_heads, cfg.ssm_v_dim, cfg.ssm_conv_kernel
    C, slots_n = 2 * nk * dk + nv * dv, 3
    slots = np.array([0] * 5 + [1] * 2 + [2, slots_n], np.int32)
    pos = np.array([3, 4, 5, 6, 7, 0, 1, 7, 0], np.int32)
    n = slots.size
    slots_d, pos_d = _dev(slots), _dev(pos)
    rows = ops.StepRows(slots_d.data.ptr, pos_d.data.ptr, slots_n, n)
    x = rng.standard_normal((n, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) / np.sqrt(K)).astype(np.float32)
    cst = rng.standard_normal((slots_n, K - 1, C)).astype(np.float32)
    xd, wd, cstd, cv = _dev(x), _dev(w), _dev(cst), _nan((n, C))
    ops.dn_conv(k, xd.data.ptr, C, wd.data.ptr, K - 1, cstd.data.ptr, rows, C, cv.data.ptr, C)
    ref_cv, ref_cst = deltanet_twin.conv(x, w, cst, slots, pos, slots_n)
    e_conv = max(rel_err(cv.get(), ref_cv), rel_err(cstd.get(), ref_cst))
    return e_conv, _check_delta(k, cfg, rng, cv, slots, pos, slots_n, rows)


def _check_delta(k: Kernels, cfg: ModelConfig, rng, cv, slots, pos, slots_n: int, rows, chunk_min=None) -> float:
    """dn_delta over the step's rows (cv: their conv outputs on the device) from random gates, norms
    and states, against deltanet_twin.py under the same chunk rule: the rel.err of outputs and states."""
    nk, dk, nv, dv = cfg.ssm_k_heads, cfg.ssm_k_dim, cfg.ssm_v_heads, cfg.ssm_v_dim
    C, n = 2 * nk * dk + nv * dv, slots.size
    ab = rng.standard_normal((2, n, nv)).astype(np.float32)
    z = rng.standard_normal((n, nv * dv)).astype(np.float32)
    a_coef = (-np.exp(rng.uniform(-2, 1, nv))).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, nv).astype(np.float32)
    out_norm = rng.uniform(0.5, 1.5, dv).astype(np.float32)
    st = (0.3 * rng.standard_normal((slots_n, nv, dk, dv))).astype(np.float32)
    d = [_dev(a) for a in (ab[0], ab[1], z, a_coef, dt_bias, out_norm, st)]
    out = _nan((n, nv * dv))
    ops.dn_delta(k, cv.data.ptr, C, d[0].data.ptr, d[1].data.ptr, nv, d[2].data.ptr, nv * dv, d[3].data.ptr,
                 d[4].data.ptr, d[5].data.ptr, d[6].data.ptr, rows, nk, dk, nv, dv, cfg.rms_eps, out.data.ptr, nv * dv,
                 chunk_min=chunk_min)
    ref, ref_st = deltanet_twin.delta(cv.get(), ab[0], ab[1], z, a_coef, dt_bias, out_norm, st, slots, pos, slots_n,
                                      nk, dk, nv, dv, cfg.rms_eps, chunk_min=chunk_min)
    return max(rel_err(out.get(), ref), rel_err(d[6].get(), ref_st))


def check_deltanet_chunked(k: Kernels, cfg: ModelConfig, rng, chunk_min: int) -> float:
    """dn_delta under the chunked rule (dn_chunk_k<dk> over whole chunks, then dn_delta_k<dk>) against
    deltanet_twin.py under the same rule, over a step of a prompt segment of chunk_min + 7 rows
    continuing a random state (whole chunks and a tail) beside a decode row of another slot; the
    rel.err of the outputs and the states. Run where dispatch.DN_CHUNK_MIN_TOKENS is set."""
    nk, dk, nv, dv = cfg.ssm_k_heads, cfg.ssm_k_dim, cfg.ssm_v_heads, cfg.ssm_v_dim
    C, slots_n, T = 2 * nk * dk + nv * dv, 2, chunk_min + 7
    slots = np.array([0] * T + [1], np.int32)
    pos = np.concatenate([np.arange(5, 5 + T), [9]]).astype(np.int32)
    n = slots.size
    slots_d, pos_d = _dev(slots), _dev(pos)
    rows = ops.StepRows(slots_d.data.ptr, pos_d.data.ptr, slots_n, n)
    cv = _dev((0.7 * rng.standard_normal((n, C))).astype(np.float32))
    return _check_delta(k, cfg, rng, cv, slots, pos, slots_n, rows, chunk_min)


# ------------------------------------------------------------------ paged KV (kernels/paged_kv.cuh)
BLOCK = 16   # block size of the checks' paged caches


class Paged:
    """Slot-layout K and V caches [slots, ctx, KVH, D] (the twins' view) laid out as the kernels see
    them: pools of blocks in random order (plus the scratch block, random) and one block table per
    slot; `view` reads a pool back in the slot layout."""

    def __init__(self, kc: np.ndarray, vc: np.ndarray, rng, bs: int = BLOCK):
        n_slots, ctx = kc.shape[:2]
        self.ctx, self.bs, self.mb = ctx, bs, -(-ctx // bs)
        self.tables = rng.permutation(n_slots * self.mb).astype(np.int32).reshape(n_slots, self.mb)
        self.k, self.v = _dev(self._pool(kc, rng)), _dev(self._pool(vc, rng))
        self.tables_d = _dev(self.tables)
        self.kv = ops.PagedKV(self.k.data.ptr, self.v.data.ptr, self.tables_d.data.ptr, self.mb,
                              bs.bit_length() - 1)

    def _pool(self, cache: np.ndarray, rng) -> np.ndarray:
        n_slots, rest = cache.shape[0], cache.shape[2:]
        padded = np.zeros((n_slots, self.mb * self.bs) + rest, cache.dtype)
        padded[:, :self.ctx] = cache
        pool = rng.standard_normal((self.tables.size + 1, self.bs) + rest).astype(cache.dtype)
        pool[self.tables.reshape(-1)] = padded.reshape((self.tables.size, self.bs) + rest)
        return pool

    def view(self, pool: cupy.ndarray) -> np.ndarray:
        p = pool.get()
        return p[self.tables].reshape((self.tables.shape[0], self.mb * self.bs) + p.shape[2:])[:, :self.ctx]


def check_rope_kv(k: Kernels, n: int, H: int, KVH: int, D: int, neox: bool, theta: float, rng,
                  ctx: int = 64, n_slots: int = 3) -> float:
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    kk = rng.standard_normal((n, KVH, D)).astype(np.float32)
    v = rng.standard_normal((n, KVH, D)).astype(np.float32)
    # distinct (slot, position) per row so no two rows write one cache row
    cells = rng.choice(n_slots * ctx, size=n, replace=False)
    slots, pos = (cells // ctx).astype(np.int32), (cells % ctx).astype(np.int32)
    qd, kd, vd = _dev(q), _dev(kk), _dev(v)
    kc0 = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    vc0 = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    pg = Paged(kc0, vc0, rng)
    pd, sd = _dev(pos), _dev(slots)
    rt = ops.rope_table(ctx, D, theta)
    ops.rope_kv(k, qd.data.ptr, kd.data.ptr, vd.data.ptr, pd.data.ptr, sd.data.ptr, pg.kv, H, KVH, D, D,
                rt.data.ptr, neox, n)
    cos, sin = rope_angles(pos, D, theta)
    style = "neox" if neox else "normal"
    rq, rk = apply_rope(q, cos, sin, style), apply_rope(kk, cos, sin, style)
    kc_h, vc_h = pg.view(pg.k), pg.view(pg.v)
    untouched = np.ones(kc0.shape[:2], bool)
    untouched[slots, pos] = False
    if not (np.array_equal(kc_h[untouched], kc0[untouched]) and np.array_equal(vc_h[untouched], vc0[untouched])):
        return float("inf")
    errs = [rel_err(qd.get(), rq), rel_err(kd.get(), rk),
            rel_err(kc_h[slots, pos], rk.astype(np.float16)), rel_err(vc_h[slots, pos], v.astype(np.float16))]
    return max(errs)


def _attention_twin(q, kc, vc, slots, pos, scale, window, sinks=None) -> np.ndarray:
    return np.concatenate([
        attention(q[t:t + 1].astype(np.float64), kc[slots[t], :pos[t] + 1].astype(np.float64),
                  vc[slots[t], :pos[t] + 1].astype(np.float64), pos[t:t + 1], scale, window, sinks)
        for t in range(len(pos))])


def _sinks(H: int, on: bool, rng) -> tuple[np.ndarray | None, cupy.ndarray | None, int]:
    """Sink logits for H heads (gpt-oss's attention) where on: around the scores' range, so each
    takes a real share of its rows' softmax; (host, device, pointer), or (None, None, 0)."""
    if not on:
        return None, None, 0
    s = rng.uniform(-1.0, 3.0, H).astype(np.float32)
    d = _dev(s)
    return s, d, d.data.ptr


def check_attention(k: Kernels, n: int, H: int, KVH: int, D: int, ctx: int, window: int, rng,
                    n_slots: int = 3, sinks: bool = False) -> float:
    kc = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    vc = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    slots = rng.integers(0, n_slots, n).astype(np.int32)
    pos = rng.integers(0, ctx, n).astype(np.int32)
    pos[0] = ctx - 1                       # the longest row always present
    scale = D ** -0.5
    pg = Paged(kc, vc, rng)
    qd, sd, pd = _dev(q), _dev(slots), _dev(pos)
    sk, _skd, skp = _sinks(H, sinks, rng)
    out = _nan((n, H * D))
    ops.attention(k, qd.data.ptr, out.data.ptr, pg.kv, sd.data.ptr, pd.data.ptr, H, KVH, D, scale, window, n,
                  sinks=skp)
    return rel_err(out.get(), _attention_twin(q, kc, vc, slots, pos, scale, window, sk))


def check_attention_prompt(k: Kernels, items, H: int, KVH: int, D: int, ctx: int, window: int, rng,
                           n_slots: int = 3, sinks: bool = False) -> float:
    """Prompt rows as a prefill lays them out: items = [(slot, first position, rows)], each item's
    rows at consecutive positions, items back to back (so a tile of rows can span two items).
    sinks: each head with a sink logit (gpt-oss)."""
    kc = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    vc = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    slots = np.concatenate([np.full(n, s, np.int32) for s, _, n in items])
    pos = np.concatenate([np.arange(p, p + n, dtype=np.int32) for _, p, n in items])
    n = len(pos)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    scale = D ** -0.5
    pg = Paged(kc, vc, rng)
    qd, sd, pd = _dev(q), _dev(slots), _dev(pos)
    sk, _skd, skp = _sinks(H, sinks, rng)
    out = _nan((n, H * D))
    ops.attention(k, qd.data.ptr, out.data.ptr, pg.kv, sd.data.ptr, pd.data.ptr, H, KVH, D, scale, window, n,
                  sinks=skp)
    return rel_err(out.get(), _attention_twin(q, kc, vc, slots, pos, scale, window, sk))


def check_attention_rope(k: Kernels, n: int, H: int, KVH: int, D: int, ctx: int, window: int, neox: bool,
                         theta: float, rng, n_slots: int = 3, rope_dim: int = 0, sinks: bool = False,
                         head_norms: bool = False) -> float:
    """Decode attention with RoPE and the KV write folded in (one row per sequence, distinct slots):
    output against the float64 twin over the cache with the new (roped, fp16) row, and the cache
    rows it wrote against the rope twin; rows it must not touch stay as they were. The angles come
    from ops.rope_table, as the model runs it. rope_dim: dims rotated (default all D).
    head_norms: the per-head q/k norms folded in too (qwen3, gemma3; random weights, heads of their
    own scales), and the launch's output and cache rows bit for bit those of rms_norm launches over
    q and k followed by the launch without them (inf where not)."""
    rope_dim = rope_dim or D
    kc0 = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    vc0 = rng.standard_normal((n_slots, ctx, KVH, D)).astype(np.float16)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    kk = rng.standard_normal((n, KVH, D)).astype(np.float32)
    v = rng.standard_normal((n, KVH, D)).astype(np.float32)
    slots = rng.permutation(n_slots)[:n].astype(np.int32)
    pos = rng.integers(0, ctx, n).astype(np.int32)
    pos[0] = ctx - 1
    if n > 1:
        pos[1] = 0                         # a first token: the new key is the only one
    scale = D ** -0.5
    eps = 1e-6
    if head_norms:
        q *= rng.uniform(0.2, 5.0, (n, H, 1)).astype(np.float32)
        kk *= rng.uniform(0.2, 5.0, (n, KVH, 1)).astype(np.float32)
        qw, kw = (rng.uniform(0.3, 2.5, D).astype(np.float32) for _ in range(2))
        qwd, kwd = _dev(qw), _dev(kw)
    qd, kd, vd, sd, pd = _dev(q), _dev(kk), _dev(v), _dev(slots), _dev(pos)
    seed = int(rng.integers(1 << 31))
    pg = Paged(kc0, vc0, np.random.default_rng(seed))
    sk, _skd, skp = _sinks(H, sinks, rng)
    out = _nan((n, H * D))
    rt = ops.rope_table(ctx, rope_dim, theta)
    ops.attention(k, qd.data.ptr, out.data.ptr, pg.kv, sd.data.ptr, pd.data.ptr, H, KVH, D, scale, window, n,
                  rope=(kd.data.ptr, vd.data.ptr, rope_dim, neox, rt.data.ptr), sinks=skp,
                  head_norms=(qwd.data.ptr, kwd.data.ptr, eps) if head_norms else None)
    if head_norms:
        # the same step as the separate launches run it: rms_norm over the heads in place, then attention
        apart, pg2 = _nan((n, H * D)), Paged(kc0, vc0, np.random.default_rng(seed))
        for y, w, heads in ((qd, qwd, H), (kd, kwd, KVH)):
            ops.rms_norm(k, y.data.ptr, D, w.data.ptr, y.data.ptr, D, n * heads, D, eps)
        ops.attention(k, qd.data.ptr, apart.data.ptr, pg2.kv, sd.data.ptr, pd.data.ptr, H, KVH, D, scale, window,
                      n, rope=(kd.data.ptr, vd.data.ptr, rope_dim, neox, rt.data.ptr), sinks=skp)
        same = [cupy.array_equal(a.view(cupy.uint32 if a.dtype == cupy.float32 else cupy.uint16),
                                 b.view(cupy.uint32 if b.dtype == cupy.float32 else cupy.uint16))
                for a, b in ((out, apart), (pg.k, pg2.k), (pg.v, pg2.v))]
        if not all(same):
            return float("inf")
        q, kk = rms_norm(q, qw, eps), rms_norm(kk, kw, eps)
    cos, sin = rope_angles(pos, rope_dim, theta)
    style = "neox" if neox else "normal"
    rq, rk = apply_rope(q, cos, sin, style), apply_rope(kk, cos, sin, style)
    kc_ref, vc_ref = kc0.copy(), vc0.copy()
    kc_ref[slots, pos] = rk.astype(np.float16)
    vc_ref[slots, pos] = v.astype(np.float16)
    kc_h, vc_h = pg.view(pg.k), pg.view(pg.v)
    untouched = np.ones(kc0.shape[:2], bool)
    untouched[slots, pos] = False
    if not (np.array_equal(kc_h[untouched], kc0[untouched]) and np.array_equal(vc_h[untouched], vc0[untouched])):
        return float("inf")
    ref = _attention_twin(rq, kc_ref, vc_ref, slots, pos, scale, window, sk)
    return max(rel_err(out.get(), ref), rel_err(kc_h[slots, pos], rk.astype(np.float16)),
               rel_err(vc_h[slots, pos], v.astype(np.float16)))


def _gated(g: np.ndarray, u: np.ndarray, act: int) -> np.ndarray:
    """The experts' activation codes (common.cuh gated_f) in NumPy: act(g) * u, or the clamped SwiGLU."""
    return swiglu_oai(g, u) if act == 2 else (gelu_tanh(g) if act else silu(g)) * u


def check_argmax(k: Kernels, rows: int, cols: int, rng) -> float:
    """Fraction of rows whose GPU argmax differs from np.argmax (ties included: first wins)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :] = 1.0                          # a row of ties: index 0 must win
    if cols > 7:
        x[-1, [3, cols - 1]] = 50.0        # a tie at the top between two far-apart indices
    xd, out = _dev(x), _poison(rows, cupy.int32)
    ops.argmax_rows(k, xd.data.ptr, cols, cols, out.data.ptr, rows)
    return float(np.mean(out.get() != np.argmax(x, axis=1)))


def check_glue(k: Kernels, rows: int, cols: int, rng) -> float:
    """act_mul (the three activations), gather_rows, split_pair and sigmoid_mul (a gated attention's)."""
    # spread wide enough that the clamped SwiGLU's limits cut some of gate and up
    t = (4.0 * rng.standard_normal((rows, cols))).astype(np.float32)
    u = (4.0 * rng.standard_normal((rows, cols))).astype(np.float32)
    td, ud = _dev(t), _dev(u)
    errs = []
    for act in (0, 1, 2):
        a = _nan((rows, cols))
        ops.act_mul(k, td.data.ptr, ud.data.ptr, a.data.ptr, rows * cols, act)
        errs.append(rel_err(a.get(), _gated(t.astype(np.float64), u.astype(np.float64), act)))
    idx = rng.integers(0, rows, max(1, rows // 2)).astype(np.int32)
    dst, idd = _nan((idx.size, cols)), _dev(idx)
    ops.gather_rows(k, td.data.ptr, idd.data.ptr, dst.data.ptr, idx.size, cols)
    errs.append(rel_err(dst.get(), t[idx]))
    heads, D = 3, 32                           # [query | gate] per head -> queries, gates
    qg = rng.standard_normal((rows, heads * 2 * D)).astype(np.float32)
    qgd, q, gate = _dev(qg), _nan((rows, heads * D)), _nan((rows, heads * D))
    ops.split_pair(k, qgd.data.ptr, q.data.ptr, gate.data.ptr, rows, heads, D)
    parts = qg.reshape(rows, heads, 2, D)
    errs.append(max(rel_err(q.get(), parts[:, :, 0].reshape(rows, -1)),
                    rel_err(gate.get(), parts[:, :, 1].reshape(rows, -1))))
    y = _dev(t)
    ops.sigmoid_mul(k, y.data.ptr, ud.data.ptr, rows * cols)
    errs.append(rel_err(y.get(), t / (1.0 + np.exp(-u.astype(np.float64)))))
    return max(errs)


# ------------------------------------------------------------------ routed experts (moe.cu)
def check_moe_topk(k: Kernels, T: int, E: int, top: int, renorm: bool, rng) -> float:
    """moe_topk against model/math.py route: logits with a tie in every row (the lower index first;
    in row 1 at the top), read through a row stride past E whose padding (+inf) would win if read.
    inf where any expert id differs, else the weights' relative error."""
    z = (3.0 * rng.standard_normal((T, E))).astype(np.float32)
    z[:, E - 1] = z[:, 0]
    if T > 1:
        z[1, [0, E - 1]] = z[1].max() + 1.0
    ls = E + 3
    padded = np.full((T, ls), np.inf, np.float32)
    padded[:, :E] = z
    logits, ids, w = _dev(padded), _poison((T, top), cupy.int32), _nan((T, top))
    ops.moe_topk(k, logits.data.ptr, ls, T, E, top, renorm, ids.data.ptr, w.data.ptr)
    ref_ids, ref_w = route(z, top, renorm)
    if not np.array_equal(ids.get(), ref_ids):
        return float("inf")
    return rel_err(w.get(), ref_w)


def check_moe_shared_add(k: Kernels, T: int, H: int, rng) -> float:
    """x += sigmoid(s) * y per row (a shared expert's output into the residual)."""
    x, y = rng.standard_normal((2, T, H)).astype(np.float32)
    s = (3.0 * rng.standard_normal(T)).astype(np.float32)
    xd, yd, sd = _dev(x), _dev(y), _dev(s)
    ops.moe_shared_add(k, xd.data.ptr, H, yd.data.ptr, H, sd.data.ptr, T, H)
    return rel_err(xd.get(), x + y / (1.0 + np.exp(-s.astype(np.float64)))[:, None])


def check_moe_experts(k: Kernels, types, E: int, F: int, H: int, T: int, top: int, act: int, rng,
                      biases: bool = False, grouped: bool = False, ids: np.ndarray | None = None,
                      pairs8: bool = False, a8: bool = False) -> float:
    """The experts of a routing (experts.py expert_pairs: moe_gate_up, or moe_gemv twice and act_mul
    where gate and up differ; grouped: expert_groups, the bucketing and mmq.cu's grouped tiles, with
    a8 on its 8-bit records; pairs8: expert_pairs8, mmv8.cu's GEMVs, its down projection and combine
    in one launch where they fit, as the model runs it; both 8-bit forms against the 8-bit activations
    they multiply) and moe_combine into residual rows, against float64: each of T rows takes top
    distinct experts of E (some shared between rows; ids: this routing instead) at random weights.
    types: (gate, up, down) storage types of stacks [E, F, H], [E, F, H], [E, H, F]; act: the
    activation code (2: gpt-oss's clamped SwiGLU); biases: each expert's gate, up and down biases
    (gpt-oss). Relative error of the rows after."""
    from .experts import GroupedBuffers, expert_groups, expert_pairs, expert_pairs8
    from .mmq import bn_limits
    shapes = ((F, H), (F, H), (H, F))
    hosts = [random_weight(qt, E * r, c, rng) for qt, (r, c) in zip(types, shapes)]
    mats, keep = [], []
    for qt, host, (r, c) in zip(types, hosts, shapes):
        w, dev = upload_weight(qt, host)
        mats.append(dataclasses.replace(w, rows=r, experts=E))
        keep.append(dev)
    wg, wu, wd = (dequantize(host, qt, (E, r, c)).astype(np.float64) for qt, host, (r, c) in zip(types, hosts, shapes))
    # act 2: inputs wide enough that the SwiGLU's clamps cut some of gate and up
    h = (rng.standard_normal((T, H)) * (8.0 if act == 2 else 1.0)).astype(np.float32)
    bs = [rng.normal(0.0, 2.0, (E, r)).astype(np.float32) if biases else np.zeros((E, r), np.float32)
          for r in (F, F, H)]
    bds = [_dev(b) for b in bs] if biases else []
    if ids is None:
        ids = np.stack([rng.permutation(E)[:top] for _ in range(T)]).astype(np.int32)
    ids = np.ascontiguousarray(ids, np.int32)
    wts = rng.random((T, top)).astype(np.float32)
    x0 = rng.standard_normal((T, H)).astype(np.float32)
    pairs = T * top
    hd, idd, wtd, xd = _dev(h), _dev(ids), _dev(wts), _dev(x0)
    a, y = _nan((pairs, F)), _nan((pairs, max(H, 2 * F)))
    bias_ptrs = tuple(b.data.ptr for b in bds) if biases else (0, 0, 0)
    if grouped:
        buf = GroupedBuffers(T, top, E, H, F, bn_limits(k, (a8,)))      # held until the result is read below
        expert_groups(k, *mats, idd.data.ptr, top, T, hd.data.ptr, H, y.data.ptr, y.shape[1], act, buf, bias_ptrs,
                      a8)
        if a8:             # the gated rows in pair order: slot s of a tile (e, s0, end) holds pair lst[s]
            lst, rows, bn = buf.lst.get(), buf.a.get(), moe_grouped_plan(T, top, E, bn_limits(k, (a8,))[0])[0]
            got = np.full((pairs, F), np.nan, np.float32)
            for e, s0, end in buf.tiles.get():
                if e >= 0:
                    got[lst[s0:min(s0 + bn, end)]] = rows[s0:min(s0 + bn, end)]
            a = cupy.asarray(got)
    elif pairs8:           # the combine in expert_pairs8 (in the down projection's launch where it fits)
        expert_pairs8(k, *mats, idd.data.ptr, top, T, hd.data.ptr, H, a.data.ptr, y.data.ptr, y.shape[1], act,
                      bias_ptrs, (xd.data.ptr, H, wtd.data.ptr))
    else:
        expert_pairs(k, *mats, idd.data.ptr, top, T, hd.data.ptr, H, a.data.ptr, y.data.ptr, y.shape[1], act,
                     same_shape(mats[0], mats[1]), bias_ptrs)
    if not pairs8:
        ops.moe_combine(k, xd.data.ptr, H, y.data.ptr, y.shape[1], wtd.data.ptr, top, T, H)
    ref = x0.astype(np.float64)
    q8 = pairs8 or (grouped and a8)
    a_gpu, a_ref = (a.get(), np.zeros((pairs, F))) if q8 else (None, None)
    for t in range(T):
        h64 = q8_rows(h[t:t + 1])[0] if q8 else h[t].astype(np.float64)
        for j, e in enumerate(ids[t]):
            a_ = _gated(wg[e] @ h64 + bs[0][e], wu[e] @ h64 + bs[1][e], act)
            if q8:         # gate and up checked apart; the down projection multiplies the 8-bit form of
                p = t * top + j        # the kernel's own row (its rounding boundaries are the kernel's)
                a_ref[p], a_ = a_, q8_rows(a_gpu[p:p + 1])[0]
            ref[t] += float(wts[t, j]) * (wd[e] @ a_ + bs[2][e])
    err = rel_err(xd.get(), ref)
    return max(err, rel_err(a_gpu, a_ref)) if q8 else err


# ------------------------------------------------------------------ start-up self-check
def run_self_check(k: Kernels, qtypes, cfg: ModelConfig, seed: int | None = None, rows: int = 1) -> dict[str, float]:
    """Every kernel the model uses once on small random data; BackendError on any disagreement.
    The GEMVs of quantized types are checked at `rows` activation rows (a start waits only for the
    modules of a one-row step; the GPU test suite covers every width)."""
    rng = np.random.default_rng(seed)
    errs: dict[str, float] = {}
    act = 1 if cfg.activation == "gelu_tanh" else 0      # the dense kernels' code (gpt-oss's experts: below)
    tensors = ARCHITECTURES[cfg.arch].block_required
    sinks = "attn_sinks.weight" in tensors
    for qt in sorted(qtypes, key=int):
        if qt not in QTYPES:
            continue  # DeviceWeights names the unsupported tensor
        K = 2 * max(QTYPES[qt].block, 32) + (3 if QTYPES[qt].block == 1 else 0)
        if QTYPES[qt].blocks:
            errs[f"mmvf_{qt.name}"] = check_mmvf(k, [(qt, 37), (qt, 5)], K, rows, rng, bias=True)
            errs[f"mmvf_acc_{qt.name}"] = check_mmvf(k, [(qt, 9)], K, min(rows, 2), rng, accumulate=True)
            errs[f"mmvf_norm_{qt.name}"] = check_mmvf(k, [(qt, 9)], K, min(rows, 2), rng, norm=True)
            errs[f"ffnf_{qt.name}"] = check_ffn_f(k, qt, 37, K, rows, act, rng)
            if rows == 1 and qt in dispatch.MMV8_TYPES:    # the dispatcher's one-row GEMVs of this type
                errs[f"mmv8_{qt.name}"] = check_mmvf(k, [(qt, 37), (qt, 5)], K, 1, rng, bias=True, q8=True)
                errs[f"ffn8_{qt.name}"] = check_ffn_f(k, qt, 37, K, 1, act, rng, q8=True)
        else:                              # float matrices: the one-warp-per-row GEMVs (gemv.cu)
            errs[f"gemv_{qt.name}"] = check_gemv(k, qt, 37, K, 3, rng, bias=True)
            errs[f"ffn_gate_up_{qt.name}"] = check_ffn(k, qt, 37, K, 3, act, rng)
        errs[f"dequant_{qt.name}"] = check_dequant(k, qt, 5, K, rng)
        errs[f"embed_{qt.name}"] = check_embed(k, qt, 11, K, 4, 1.5, rng)
    D = cfg.head_dim
    errs["rms_norm"] = check_rms_norm(k, 3, cfg.hidden, False, rng)
    errs["rms_norm_add"] = check_rms_norm(k, 3, D, True, rng)
    errs["rope_kv"] = check_rope_kv(k, 3, cfg.n_heads, cfg.n_kv_heads, D, cfg.rope_style == "neox",
                                    cfg.rope_theta, rng)
    errs["attention"] = check_attention(k, 3, cfg.n_heads, cfg.n_kv_heads, D, 40, 0, rng, sinks=sinks)
    errs["attention_prompt"] = check_attention_prompt(k, [(0, 0, 21), (1, 4, 13)], cfg.n_heads, cfg.n_kv_heads,
                                                      D, 40, 0, rng, sinks=sinks)
    if cfg.n_experts:                      # the routed experts' kernels, each stored type through them
        from .experts import MOE_ACT
        E, top = cfg.n_experts, min(cfg.n_experts_used, cfg.n_experts)
        errs["moe_topk"] = check_moe_topk(k, 5, E, top, cfg.expert_renormalize, rng)
        for qt in sorted((q for q in qtypes if q in QTYPES), key=int):
            K = 2 * max(QTYPES[qt].block, 32) + (3 if QTYPES[qt].block == 1 else 0)
            errs[f"moe_{qt.name}"] = check_moe_experts(k, (qt, qt, qt), 3, K, K, 2, 2, MOE_ACT[cfg.activation], rng,
                                                       biases="ffn_gate_exps.bias" in tensors)
            if rows == 1 and dispatch.MOE_PAIRS8 and qt in dispatch.MMV8_TYPES:    # its one-row experts
                errs[f"moe8_{qt.name}"] = check_moe_experts(k, (qt, qt, qt), 3, K, K, 1, 2, MOE_ACT[cfg.activation],
                                                            rng, biases="ffn_gate_exps.bias" in tensors, pairs8=True)
        if cfg.shared_expert_ffn_dim:
            errs["moe_shared_add"] = check_moe_shared_add(k, 3, cfg.hidden, rng)
    if cfg.has_recurrent_state:            # a hybrid's Gated DeltaNet at the model's own head sizes
        errs["dn_conv"], errs["dn_delta"] = check_deltanet(k, cfg, rng)
        chunk = dispatch.DN_CHUNK_MIN_TOKENS
        if chunk is not None and dn_chunk_kernel(cfg.ssm_k_dim, cfg.ssm_v_dim) is not None:
            errs["dn_chunk"] = check_deltanet_chunked(k, cfg, rng, chunk)
    errs["argmax"] = check_argmax(k, 3, 1000, rng)
    errs["glue"] = check_glue(k, 4, 70, rng)
    cupy.cuda.Device().synchronize()
    bad = {n: e for n, e in errs.items() if not e <= TOL}
    if bad:
        raise BackendError("cuda self-check failed, refusing to start: " +
                           ", ".join(f"{n} rel.err {e:.3g}" for n, e in bad.items()))
    log.info("cuda self-check passed: %d kernels, worst rel.err %.2e", len(errs), max(errs.values()))
    return errs
