"""The math the model's operations mean, in NumPy: RMSNorm, RoPE (with every scaling a supported
model uses), the activations, a mixture of experts' routing and reference attention. The NumPy backend computes with these; the
GPU's self-check and tests use them as the reference its kernels are checked against."""

from __future__ import annotations

import numpy as np

from .config import RopeScaling


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)).astype(np.float32) * w


def rope_frequencies(rope_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """(angle per position of each rotary pair, float64 [rope_dim / 2]; the factor on cos and sin),
    with the model's RoPE scaling applied as transformers' rope init functions and llama.cpp's
    ggml_rope_ext define it."""
    inv = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if scaling is None:
        return inv, 1.0
    sc = scaling
    if sc.freq_factors is not None:           # GGUF rope_freqs: llama.cpp divides each pair's angle
        inv = inv / np.asarray(sc.freq_factors, np.float64)
    if sc.kind == "linear":
        inv = inv / sc.factor
    elif sc.kind == "yarn":
        # pairs below `low` keep their frequency (extrapolation), pairs past `high` are divided by
        # the factor (interpolation), a linear ramp in between; the corners are the pairs that turn
        # beta_fast and beta_slow times over the original context
        def corner(rotations: float) -> float:
            return rope_dim * np.log(sc.original_context / (rotations * 2 * np.pi)) / (2 * np.log(theta))
        low, high = corner(sc.beta_fast), corner(sc.beta_slow)
        if sc.truncate:
            low, high = np.floor(low), np.ceil(high)
        low, high = max(low, 0.0), min(high, rope_dim - 1.0)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / max(high - low, 0.001), 0.0, 1.0)
        extra = (1.0 - ramp) * sc.ext_factor
        inv = inv / sc.factor * (1.0 - extra) + inv * extra
    elif sc.kind == "llama3":
        wavelen = 2 * np.pi / inv
        low_wl, high_wl = sc.original_context / sc.low_freq_factor, sc.original_context / sc.high_freq_factor
        smooth = (sc.original_context / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        scaled = np.where(wavelen > low_wl, inv / sc.factor, inv)
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, (1 - smooth) * scaled / sc.factor + smooth * scaled, scaled)
    return inv, sc.mscale


def rope_angles(positions: np.ndarray, rope_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angle per rotary pair, float32 [len(positions), rope_dim / 2]
    (YaRN: both times its mscale, which scales the scores by mscale squared)."""
    inv, mscale = rope_frequencies(rope_dim, theta, scaling)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return (np.cos(ang) * mscale).astype(np.float32), (np.sin(ang) * mscale).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x: [T, heads, head_dim]; cos/sin: [T, rope_dim/2]. "normal" rotates adjacent pairs
    (GGUF llama after llama.cpp's q/k permutation), "neox" rotates the two halves."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if style == "normal":
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = a * s + b * c
    return out


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):   # exp(-x) -> inf for very negative x gives the right 0
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: gate clamped from above and up both ways at SWIGLU_LIMIT, then
    gate * sigmoid(SWIGLU_ALPHA * gate) * (up + 1)."""
    g = np.minimum(gate, SWIGLU_LIMIT)
    u = np.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-SWIGLU_ALPHA * g)) * (u + 1.0)


SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """A mixture of experts' router on rows of logits [T, E]: each row's softmax (float64), its
    top_k experts (the most probable first, ties to the lower index) and their probabilities,
    rescaled to sum to one over the top_k where renormalize: (ids int64 [T, top_k], weights
    float32 [T, top_k])."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w /= w.sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float,
              window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """q: [T, H, D] at absolute positions q_pos; k, v: [S, KVH, D] for positions 0..S-1.
    Causal (and sliding-window when window > 0) softmax attention with grouped KV heads (the
    products as batched matrix products: BLAS, so long prompts stay affordable). sinks [H]: one more
    logit per head in each row's softmax, whose probability goes nowhere (gpt-oss)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    group = H // kvh
    qg = q.reshape(T, kvh, group, D).transpose(1, 2, 0, 3)                 # [KVH, G, T, D]
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None]) * scale          # [KVH, G, T, S]
    kpos = np.arange(k.shape[0])
    mask = kpos[None, :] > q_pos[:, None]
    if window:
        mask |= kpos[None, :] <= q_pos[:, None] - window
    scores += np.where(mask, np.float32(-np.inf), np.float32(0.0))      # [T, S], broadcast
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float32).reshape(kvh, group, 1, 1)
        top = np.maximum(top, sink)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sink - top)
    scores /= total
    out = np.matmul(scores, v.transpose(1, 0, 2)[:, None])                  # [KVH, G, T, D]
    return out.transpose(2, 0, 1, 3).reshape(T, H * D).astype(np.float32)
