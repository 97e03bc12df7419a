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


# Where each block type keeps its fp16 scales (byte offsets in a block), and MXFP4's E8M0 scale byte:
# what a block of random bits must have set to hold finite, small weights as real files do.
SCALE_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
}
MXFP4_SCALE_BYTES = (118, 122)   # E8M0 exponents 2^-10 .. 2^-7 (|w| <= 12 x 2^-7, about 0.09)


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator,
                  scale: tuple[float, float] = (0.005, 0.025)) -> np.ndarray:
    """n_blocks valid blocks of a quantized type as a file stores them, (n_blocks, type_size) uint8:
    random bits (random codebook indices and signs for the I-quants), with each fp16 scale drawn
    from `scale` (and MXFP4's exponent from MXFP4_SCALE_BYTES), so every weight is finite and small."""
    b = rng.integers(0, 256, size=(n_blocks, type_size(qtype)), dtype=np.uint8)
    if qtype == Q.MXFP4:
        b[:, 0] = rng.integers(*MXFP4_SCALE_BYTES, size=n_blocks, dtype=np.uint8)
        return b
    lo, hi = scale
    for o in SCALE_FIELDS[qtype]:
        b[:, o:o + 2] = (rng.random(n_blocks) * (hi - lo) + lo).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b


def random_matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A random rows x cols matrix as a GGUF file stores it (what Tensor.data holds): float types as
    their arrays (BF16 as bytes), block types as (rows, row_bytes) uint8 of random_blocks."""
    if qtype == Q.F32:
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == Q.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16)
    if qtype == Q.BF16:
        f = rng.standard_normal((rows, cols)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, cols * 2)
    return random_blocks(qtype, rows * cols // block_size(qtype), rng).reshape(rows, row_bytes(qtype, cols))
