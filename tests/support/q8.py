"""The NumPy twin of the kernels' 8-bit activations (kernels/mmv8.cu, mmq.cu built with MMQ_A8):
per 32 values d = max|x| / 127 and q = rint(x / d), as common.cuh quant_q8_lane rounds them, and
the folded RMSNorm's input as those kernels round it."""

from __future__ import annotations

import numpy as np


def q8_twin(x: np.ndarray) -> np.ndarray:
    """The kernel's 8-bit activations (mmv8_quant) as float64 values q d, from float32 x [K]."""
    u = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(u).max(axis=1) / np.float32(127.0)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(u * inv[:, None])
    return (q.astype(np.float64) * d[:, None].astype(np.float64)).reshape(-1)


def normed(x: np.ndarray, nw: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * nw in float32 as the kernel rounds it ((x inv) nw)."""
    inv = np.float32(1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps))
    return (x * inv).astype(np.float32) * nw
