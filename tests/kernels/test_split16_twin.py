"""The split16 prefill GEMM's NumPy twin (tests/support/split16_twin.py: kernels/prefill.cu,
backends/cuda/split16.py) and the proof of its error bound against float64: its splits and calls,
and errors compared with fp32 SGEMM's and with the single-fp16 path ("fp16" prefill) on the same
data. The GPU tests (tests/gpu/test_prefill_split.py) import the twin from support too."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.formats.quants import dequantize
from support.split16_twin import (F16, F32, F64, LO_SHIFT, MAIN_K_PER_CALL, fma_gemm, fp16_matmul, outlier_rows, rel,
                                  split16_error_bound, split16_matmul, split_calls, split_rows, split_weight, tc_gemm)


def errors(X: np.ndarray, W: np.ndarray) -> dict[str, float]:
    """Relative (Frobenius) error against float64 of fp32 SGEMM, the fp16 path and split16 under
    the fp32 and the two tensor-core accumulation models."""
    ref = X.astype(F64) @ W.astype(F64).T
    return {"sgemm": rel(fma_gemm(X, W), ref),
            "fp16": rel(fp16_matmul(X, W), ref),
            "split16": rel(split16_matmul(X, W), ref),
            "split16_tc0": rel(split16_matmul(X, W, lambda a, b: tc_gemm(a, b, 16, 0)), ref),
            "split16_tc3": rel(split16_matmul(X, W, lambda a, b: tc_gemm(a, b, 16, 3)), ref)}


def check_errors(name: str, e: dict[str, float], K: int) -> None:
    print(f"{name}: " + "  ".join(f"{k} {v:.2e}" for k, v in e.items()))
    # the split arithmetic itself adds nothing measurable to fp32 accumulation
    assert e["split16"] <= 1.5 * e["sgemm"] + 1e-8
    # truncating tensor-core accumulation: within a few times SGEMM and the GPU test's bound, far
    # below single fp16 (which fails that bound)
    tc = max(e["split16_tc0"], e["split16_tc3"])
    assert tc <= 6 * e["sgemm"] and tc <= split16_error_bound(K) and tc <= e["fp16"] / 20
    assert e["fp16"] > split16_error_bound(K)


# ------------------------------------------------------------------ synthetic data
_SCALE_OFFSETS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}
_BLOCK = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q8_0: (32, 34), Q.Q4_K: (256, 144), Q.Q6_K: (256, 210)}


def random_quant(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Dequantized random GGUF blocks (random bits, small positive fp16 scales as in real files)."""
    blk, nbytes = _BLOCK[qtype]
    n = rows * cols // blk
    b = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for o in _SCALE_OFFSETS[qtype]:
        b[:, o:o + 2] = (rng.random(n) * 0.02 + 0.0005).astype(F16).view(np.uint8).reshape(-1, 2)
    return dequantize(b.reshape(rows, -1), qtype, (rows, cols)).astype(F32)


def split_error(W: np.ndarray) -> np.ndarray:
    """|Wh + Wl * 2^-12 - W| in units of the bound 2^-22 |W| + 2^-36: the low half keeps 11 bits
    below the high half's rounding error; weights under fp16's normal range (2^-14) have a
    subnormal high half and an absolute floor of ~2^-25 * 2^-11."""
    hi, lo = split_weight(W)
    err = np.abs(hi.astype(F64) + lo.astype(F64) * 2.0 ** -LO_SHIFT - W.astype(F64))
    return err / (2.0 ** -22 * np.abs(W.astype(F64)) + 2.0 ** -36)


@pytest.mark.parametrize("qtype", list(_BLOCK), ids=lambda q: q.name)
def test_weight_split_of_block_types(qtype):
    """Types without a min (q * d) have few enough significant bits that Wh + Wl * 2^-12 is W
    exactly; with a min (Q4_1, Q4_K) the fp32 value can need 24 bits: within the bound."""
    W = random_quant(qtype, 8, 1024, np.random.default_rng(1))
    if qtype in (Q.Q4_1, Q.Q4_K):
        assert split_error(W).max() <= 1.0
    else:
        hi, lo = split_weight(W)
        assert np.array_equal(hi.astype(F64) + lo.astype(F64) * 2.0 ** -LO_SHIFT, W.astype(F64))


def test_weight_split_of_float_weights():
    W = np.random.default_rng(2).standard_normal((16, 512)).astype(F32) * F32(0.02)
    W[0, :8] = [1e-7, -3e-6, 2e-5, 70.0, -1000.0, 0.0, 6e-5, 1e-30]
    assert split_error(W).max() <= 1.0


def test_activation_split():
    rng = np.random.default_rng(3)
    X = outlier_rows(6, 896, rng)
    x16, inv = split_rows(X)
    K = X.shape[1]
    xh2, xh, xl = x16[:, :K], x16[:, K:2 * K], x16[:, 2 * K:]
    assert np.all(np.log2(inv) == np.round(np.log2(inv)))
    mx = np.max(np.abs(xh.astype(F32)), axis=1)
    assert np.all((mx >= 2 ** 14) & (mx <= 2 ** 15))
    assert np.array_equal(xh2, (xh.astype(F32) * F32(2.0 ** -LO_SHIFT)).astype(F16))
    sx = X.astype(F64) / inv[:, None]
    # xh + xl = s x to fp16-of-the-residual precision (subnormal residuals: absolute 2^-25)
    err = np.abs(xh.astype(F64) + xl.astype(F64) - sx)
    assert np.all(err <= 2.0 ** -22 * np.abs(sx) + 2.0 ** -25)


def test_split_calls_cover_both_terms_once():
    for K, calls in [(1536, 2), (4096, 2), (8960, 4), (896, 2)]:
        c = split_calls(K)
        assert len(c) == calls
        # weight columns [0, 2K) once against the first 2K activation columns, then Wh against xl
        assert [(w, x) for w, x, _, _ in c[:-1]] == [(w, w) for w, _, _, _ in c[:-1]]
        assert sum(k for _, _, k, _ in c[:-1]) == 2 * K and c[-1] == (K, 2 * K, K, 1)
        assert c[0][3] == 0 and all(b == 1 for *_, b in c[1:])
        assert all(w % 8 == 0 for w, *_ in c) and all(k <= MAIN_K_PER_CALL + K for _, _, k, _ in c)


@pytest.mark.parametrize("qtype,K", [(Q.Q4_K, 1536), (Q.Q6_K, 4864), (Q.Q5_0, 640)], ids=lambda v: str(v))
def test_split16_error_synthetic(qtype, K):
    rng = np.random.default_rng(K)
    W = random_quant(qtype, 48, K, rng)
    X = outlier_rows(6, K, rng)
    check_errors(f"{qtype.name} K={K}", errors(X, W), K)


# ------------------------------------------------------------------ real weights and activations
def _projection_inputs(name: str, layer: int, T: int = 16, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Run layers 0..layer of a real model with the oracle's math on T random tokens and return
    (input rows, weight) of every projection of `layer` (q|k|v and gate|up stacked)."""
    from support.real_models import real_model

    from realizar_backend.model.math import apply_rope, attention, gelu_tanh, rms_norm, rope_angles, silu
    from realizar_backend.formats import open_model
    m = open_model(real_model(name))
    c = m.config

    def w(n: str) -> np.ndarray | None:
        t = m.get(n)
        return None if t is None else np.ascontiguousarray(dequantize(t.data, t.qtype, t.shape)).astype(F32)

    ids = np.random.default_rng(seed).integers(0, c.vocab_size, T)
    x = w("token_embd.weight")[ids] * F32(c.embed_scale)
    pos = np.arange(T)
    act = gelu_tanh if c.activation == "gelu_tanh" else silu
    for li in range(layer + 1):
        p = f"blk.{li}."
        wq, wk, wv, wo = (w(p + f"attn_{s}.weight") for s in ("q", "k", "v", "output"))
        wg, wu, wd = (w(p + f"ffn_{s}.weight") for s in ("gate", "up", "down"))
        h = rms_norm(x, w(p + "attn_norm.weight"), c.rms_eps)
        q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
        if m.get(p + "attn_q.bias") is not None:
            q, k, v = q + w(p + "attn_q.bias"), k + w(p + "attn_k.bias"), v + w(p + "attn_v.bias")
        q, k, v = (a.reshape(T, -1, c.head_dim) for a in (q, k, v))
        if m.get(p + "attn_q_norm.weight") is not None:
            q, k = rms_norm(q, w(p + "attn_q_norm.weight"), c.rms_eps), rms_norm(k, w(p + "attn_k_norm.weight"), c.rms_eps)
        cos, sin = rope_angles(pos, c.rope_dim, c.layer_rope_theta(li), c.layer_rope_scaling(li))
        q, k = apply_rope(q, cos, sin, c.rope_style), apply_rope(k, cos, sin, c.rope_style)
        a = attention(q, k, v, pos, c.scale, c.sliding_window if c.is_sliding(li) else 0).reshape(T, -1).astype(F32)
        o = a @ wo.T
        if m.get(p + "post_attention_norm.weight") is not None:
            o = rms_norm(o, w(p + "post_attention_norm.weight"), c.rms_eps)
        x2 = x + o
        h2 = rms_norm(x2, w(p + "ffn_norm.weight"), c.rms_eps)
        g = (act(h2 @ wg.T) * (h2 @ wu.T)).astype(F32)
        if li == layer:
            return {"qkv": (h, np.concatenate([wq, wk, wv])), "o": (a, wo),
                    "gate_up": (h2, np.concatenate([wg, wu])), "down": (g, wd)}
        d = g @ wd.T
        if m.get(p + "post_ffw_norm.weight") is not None:
            d = rms_norm(d, w(p + "post_ffw_norm.weight"), c.rms_eps)
        x = x2 + d
    raise AssertionError("unreachable")


@pytest.mark.slow
@pytest.mark.parametrize("name,layer", [("gemma270", 5), ("qwen15", 3)])
def test_split16_error_real_models(name, layer):
    """Real weights (every quant type of the model) and the activations the oracle computes for
    them: split16 within fp32 SGEMM's error (fp32 accumulation), a few times it under the
    tensor-core model, and the weight split within its bound."""
    rng = np.random.default_rng(7)
    for proj, (X, W) in _projection_inputs(name, layer).items():
        W = W[np.sort(rng.choice(W.shape[0], 96, replace=False))]
        assert split_error(W).max() <= 1.0, proj
        check_errors(f"{name} layer {layer} {proj} ({X.shape[0]}x{X.shape[1]} . {W.shape[0]} rows, "
                     f"max|x|/rms {np.abs(X).max() / np.sqrt(np.mean(X.astype(F64) ** 2)):.0f})", errors(X, W), X.shape[1])
