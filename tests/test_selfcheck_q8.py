"""The start-up self-check's 8-bit measure (selfcheck_q8.q8_violation) against the kernels' own fp32
quantization (common.cuh quant_q8_lane: d = amax / 127, q = rint(v * (1 / d)), sum d * sum q),
reproduced in float32 NumPy: faithful blocks pass on any random draw, so a server never refuses to
start on rounding; a value one step off, a wrong d or a wrong sum fail."""

from __future__ import annotations

import numpy as np

from realizar_backend.backends.cuda.selfcheck_q8 import q8_violation

F = np.float32


def quantize_like_the_kernel(v: np.ndarray):
    r = v.reshape(v.shape[0], -1, 32)
    d = (np.abs(r).max(-1, keepdims=True) / F(127)).astype(F)
    inv = np.where(d > 0, F(1) / d, F(0)).astype(F)
    q = np.rint((r * inv).astype(F)).astype(np.int32)
    ds = np.stack([d[..., 0], (d[..., 0] * q.sum(-1).astype(F)).astype(F)], -1)
    return q.reshape(v.shape).astype(np.int8), ds


def test_faithful_blocks_pass_on_every_draw(rng):
    worst = 0.0
    for _ in range(1500):
        v = (rng.standard_normal((3, 1536)) * rng.uniform(0.01, 10.0, (3, 1))).astype(F)
        worst = max(worst, q8_violation(*quantize_like_the_kernel(v), v))
    assert worst <= 1.0


def test_wrong_blocks_fail(rng):
    v = rng.standard_normal((2, 64)).astype(F)
    q, ds = quantize_like_the_kernel(v)
    off = q.copy()
    off[1, 5] += 1 if off[1, 5] < 127 else -1
    assert q8_violation(off, ds, v) > 1.0
    bad_d = ds.copy()
    bad_d[0, 1, 0] *= 1.01
    assert q8_violation(q, bad_d, v) > 1.0
    bad_sum = ds.copy()
    bad_sum[1, 0, 1] += 0.5 * ds[1, 0, 0]
    assert q8_violation(q, bad_sum, v) > 1.0
