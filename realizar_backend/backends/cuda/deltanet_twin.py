"""NumPy twins (float64) of kernels/deltanet.cu, for the self-check (selfcheck.py) and the host
emulator and GPU tests; no CuPy. The causal conv with its per-slot state, and the gated delta rule
with the gated RMSNorm of its output, over the rows of a step (row t: slot slots[t] at position pos[t]; consecutive rows of one slot at consecutive
positions are one segment, carried through the slot's state in order). The math is the NumPy
backend's (backends/cpu.py CpuOps.delta_rule), split where the kernels split it; a segment at
position 0 starts from zero state, and the scratch slot's rows start from zero and keep no state."""

from __future__ import annotations

import numpy as np

F64 = np.float64


def segments(slots, pos) -> list[tuple[int, int]]:
    """(first row, last row + 1) of each segment."""
    out, n = [], len(slots)
    t = 0
    while t < n:
        e = t + 1
        while e < n and slots[e] == slots[t] and pos[e] == pos[e - 1] + 1:
            e += 1
        out.append((t, e))
        t = e
    return out


def _silu(x):
    return x / (1.0 + np.exp(-x))


def conv(x, w, conv_state, slots, pos, scratch):
    """x [n, C] (the mixed rows), w [C, K], conv_state [slots, K - 1, C]: (silu(conv) [n, C], the new
    conv_state)."""
    x, w, st = np.asarray(x, F64), np.asarray(w, F64), np.array(conv_state, F64)
    K = w.shape[1]
    out = np.empty_like(x)
    for a, b in segments(slots, pos):
        slot = slots[a]
        fresh = slot == scratch or pos[a] == 0
        xs = np.concatenate([np.zeros((K - 1, x.shape[1])) if fresh else st[slot], x[a:b]])
        n = b - a
        out[a:b] = _silu(sum(xs[i:i + n] * w[:, i] for i in range(K)))
        if slot != scratch:
            st[slot] = xs[n:]
    return out, st


def delta(cv, alpha, beta, z, a_coef, dt_bias, out_norm, state, slots, pos, scratch, nk, dk, nv, dv, eps):
    """cv [n, 2 nk dk + nv dv] (the conv output), alpha, beta [n, nv], z [n, nv dv], state
    [slots, nv, dk, dv]: (the gated RMSNorm of each head's output [n, nv dv], the new state)."""
    cv = np.asarray(cv, F64)
    st = np.array(state, F64)
    n = cv.shape[0]
    g = np.exp(np.asarray(a_coef, F64) * np.logaddexp(0.0, np.asarray(alpha, F64) + dt_bias))
    b = 1.0 / (1.0 + np.exp(-np.asarray(beta, F64)))
    q = cv[:, :nk * dk].reshape(n, nk, dk)
    k = cv[:, nk * dk:2 * nk * dk].reshape(n, nk, dk)
    v = cv[:, 2 * nk * dk:].reshape(n, nv, dv)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    heads = np.arange(nv) % nk                      # value head h reads key head h % nk
    o = np.empty((n, nv, dv))
    for a, e in segments(slots, pos):
        slot = slots[a]
        S = np.zeros((nv, dk, dv)) if slot == scratch or pos[a] == 0 else st[slot].copy()
        for t in range(a, e):
            kt, qt = k[t, heads], q[t, heads]
            S *= g[t][:, None, None]
            d = (v[t] - np.einsum("hkv,hk->hv", S, kt)) * b[t][:, None]
            S += kt[:, :, None] * d[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, qt)
        if slot != scratch:
            st[slot] = S
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * np.asarray(out_norm, F64)
    return (y * _silu(np.asarray(z, F64).reshape(n, nv, dv))).reshape(n, nv * dv), st
