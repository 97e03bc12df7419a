"""The GGML storage types this package runs, and dequantization through the `gguf` package
(the llama.cpp team's own reference implementation)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gq

# The storage types of the files people download that gguf-py decodes (the NumPy backend runs them
# all; which ones the GPU runs is its own table, backends/cuda/matrices.py). Not here: the ternary
# TQ types of BitNet models, an architecture this package does not run.
SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
             Q.Q6_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
             Q.MXFP4)


def block_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: Q, n_cols: int) -> int:
    bs, ts = GGML_QUANT_SIZES[qtype]
    return n_cols // bs * ts


def dequantize(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Stored bytes -> float32 array of `shape`. F32/F16 arrive as float arrays; BF16 (from GGUF
    or safetensors alike) and block quants as uint8 (rows, bytes_per_row), decoded by gguf.quants."""
    if qtype == Q.F32:
        return np.asarray(data, dtype=np.float32).reshape(shape)
    if qtype == Q.F16:
        return np.asarray(data).astype(np.float32).reshape(shape)
    return gq.dequantize(np.asarray(data), qtype).astype(np.float32, copy=False).reshape(shape)
