"""NumPy twins (float64) of kernels/deltanet.cu, for the self-check (selfcheck.py) and the host
emulator and GPU tests; no CuPy. The causal conv with its per-slot state, and the gated delta rule
with the gated RMSNorm of its output, over the rows of a step (row t: slot slots[t] at position pos[t]; consecutive rows of one slot at consecutive
positions are one segment, carried through the slot's state in order). The math is the NumPy
backend's (backends/cpu.py CpuOps.delta_rule), split where the kernels split it; a segment at
position 0 starts from zero state, and the scratch slot's rows start from zero and keep no state."""

from __future__ import annotations

import numpy as np

from .support import DN_CHUNK

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


def delta(cv, alpha, beta, z, a_coef, dt_bias, out_norm, state, slots, pos, scratch, nk, dk, nv, dv, eps,
          chunk_min: int | None = None, chunk: int = DN_CHUNK):
    """cv [n, 2 nk dk + nv dv] (the conv output), alpha, beta [n, nv], z [n, nv dv], state
    [slots, nv, dk, dv]: (the gated RMSNorm of each head's output [n, nv dv], the new state).
    chunk_min: as deltanet.cu's chunked rule (dn_chunk, then dn_delta's tail): a segment of a live
    slot of at least chunk_min rows runs its whole chunks of `chunk` rows in the chunked form
    (chunk_step), the rows after them token by token; None: every row token by token."""
    if chunk_min is not None and chunk_min < chunk:
        raise ValueError(f"chunk_min {chunk_min}: a chunked segment holds a whole chunk ({chunk} rows)")
    cv = np.asarray(cv, F64)
    st = np.array(state, F64)
    n = cv.shape[0]
    lg = np.asarray(a_coef, F64) * np.logaddexp(0.0, np.asarray(alpha, F64) + dt_bias)    # log of the decay
    g = np.exp(lg)
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
        tail = a
        if chunk_min is not None and slot != scratch and e - a >= chunk_min:
            tail = a + (e - a) // chunk * chunk
            for c in range(a, tail, chunk):
                r = slice(c, c + chunk)
                o[r], S = chunk_step(S, q[r][:, heads], k[r][:, heads], v[r], lg[r], b[r])
        for t in range(tail, e):
            kt, qt = k[t, heads], q[t, heads]
            S *= g[t][:, None, None]
            d = (v[t] - np.einsum("hkv,hk->hv", S, kt)) * b[t][:, None]
            S += kt[:, :, None] * d[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, qt)
        if slot != scratch:
            st[slot] = S
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * np.asarray(out_norm, F64)
    return (y * _silu(np.asarray(z, F64).reshape(n, nv, dv))).reshape(n, nv * dv), st


def _decays(G, diagonal: bool):
    """exp(G_r - G_m) over the chunk's rows r, m [heads, L, L] where m < r (m <= r with the
    diagonal), else 0: differences of cumulative log-decays, never ratios of products (a product
    over 64 strong decays underflows); the entries above are never exponentiated (they could
    overflow)."""
    L = G.shape[1]
    keep = np.tril(np.ones((L, L), bool), 0 if diagonal else -1)
    diff = np.where(keep, G[:, :, None] - G[:, None, :], 0.0)
    return np.where(keep, np.exp(diff), 0.0)


def chunk_step(S, q, k, v, lg, b):
    """The delta rule over one chunk of L rows at once, as deltanet.cu's dn_chunk computes it. S
    [heads, dk, dv] the state before the chunk; q, k [L, heads, dk] (normalised, each value head's
    key head); v [L, heads, dv]; lg, b [L, heads] the log-decays and betas. Returns (o [L, heads,
    dv], the state after the chunk).

    With G_r the cumulative log-decay of rows 1..r of the chunk, the rule token by token
    (S_r = g_r S_{r-1} + k_r u_r^T, u_r = b_r (v_r - (g_r S_{r-1})^T k_r), o_r = S_r^T q_r) unrolls to
      S_r = e^{G_r} S + sum_{m<=r} e^{G_r - G_m} k_m u_m^T, so that
      u_r + b_r sum_{m<r} e^{G_r - G_m} (k_r . k_m) u_m = b_r (v_r - e^{G_r} S^T k_r):
    a unit lower-triangular system in the u of the chunk, solved by forward substitution over the
    rows (each value column on its own); then
      o_r = e^{G_r} S^T q_r + sum_{m<=r} e^{G_r - G_m} (q_r . k_m) u_m,
      S_L = e^{G_L} S + sum_m e^{G_L - G_m} k_m u_m^T."""
    G = np.cumsum(np.asarray(lg, F64), 0).T                 # [heads, L]
    # (contiguous per head: NumPy's stacked matmul takes BLAS on contiguous operands only)
    K, Q, V = (np.ascontiguousarray(np.asarray(x, F64).transpose(1, 0, 2)) for x in (k, q, v))
    B = np.asarray(b, F64).T
    L = K.shape[1]
    Kt = np.ascontiguousarray(K.transpose(0, 2, 1))
    M = _decays(G, False) * (K @ Kt)
    U = V - np.exp(G)[:, :, None] * (K @ S)                  # v - e^{G_r} S^T k_r, then the u
    for r in range(L):
        U[:, r] = B[:, r, None] * (U[:, r] - np.einsum("hm,hmv->hv", M[:, r, :r], U[:, :r]))
    O = np.exp(G)[:, :, None] * (Q @ S) + (_decays(G, True) * (Q @ Kt)) @ U
    S = np.exp(G[:, -1])[:, None, None] * S + (Kt * np.exp(G[:, -1:] - G)[:, None, :]) @ U
    return O.transpose(1, 0, 2), S
