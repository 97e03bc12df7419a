"""How the CUDA backend stores a GGML matrix on the device, in NumPy (no GPU needed).

Blocks whose size is not a multiple of 4 bytes (Q5_0: 22, Q8_0: 34, Q6_K: 210; MXFP4: 17) leave most
blocks 2 (MXFP4: 1) bytes off a word boundary, so a decoder reads them 4 bytes at a time and
funnel-shifts misaligned words. On the device those types are regrouped so that every 32-weight
unit's quants are 16-byte aligned, with the same bytes per weight; the other types keep their GGUF
bytes. Rows are padded to a multiple of 16 bytes.

    Q8_0: qs[nu][32], then d[nu] (fp16)
    MXFP4: qs[nu][16] (as GGUF), then e[nu] (the E8M0 exponent bytes)
    Q5_0: qs[nu][16] (as GGUF), then qh[nu] (u32: bit i of byte k = fifth bit of column 4i + k,
          bit 4 + i = of column 16 + 4i + k; GGUF's bit j is column j), then d[nu]
    Q6_K: per 256-weight block, 208 bytes:
            lo[8][16]  unit j, byte b: low nibble of column b | low nibble of column b + 16 << 4
            hi[8][8]   unit j, byte 4w + k: the 2-bit high parts of columns 16w + 4s + k at bits 2s
            sc[8][2]   unit j: the int8 scales of its columns 0..15 and 16..31 (GGUF's order)
          then the row's d values (fp16, one per block)

The regrouped high bits let the decoders put each value together with a shift and a mask per word
(common.cuh q5_0_unit, q6k_unit). `to_device` is the NumPy twin of kernels/repack.cu;
`dequantize_device` the twin of the decoders.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from .quants import dequantize, row_bytes

_Q6K_BLOCK = 210
_Q6K_BODY = 208          # lo + hi + sc per block


REGROUPED = (Q.Q5_0, Q.Q8_0, Q.Q6_K, Q.MXFP4)


def device_row_bytes(qtype, cols: int) -> int:
    """Bytes between two rows of a matrix on the device."""
    if qtype in REGROUPED:
        return (row_bytes(qtype, cols) + 15) // 16 * 16
    return row_bytes(qtype, cols)


def _q5_0_qh(qh: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 qh (..., 4) bytes (bit j = column j) -> the device's (..., 4) bytes."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")             # (..., 32): column j
    cols = bits.reshape(qh.shape[:-1] + (2, 4, 4))                   # [half, i, k]: column 16 half + 4i + k
    dev = cols.transpose(tuple(range(qh.ndim - 1)) + (qh.ndim + 1, qh.ndim - 1, qh.ndim))  # [k, half, i]
    return np.packbits(dev.reshape(qh.shape[:-1] + (32,)), axis=-1, bitorder="little")


def _q6k_values(blocks: np.ndarray) -> np.ndarray:
    """(..., 210) raw blocks -> (..., 256) unsigned 6-bit values in column order (llama.cpp's
    dequantize_row_q6_K: column 128h + 32k + l from ql, qh of half h and quarter k)."""
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    q = np.empty(blocks.shape[:-1] + (256,), np.uint8)
    for h in range(2):
        for k in range(4):
            lo = (ql[..., 64 * h + 32 * (k & 1):64 * h + 32 * (k & 1) + 32] >> (4 * (k >> 1))) & 15
            hi = (qh[..., 32 * h:32 * h + 32] >> (2 * k)) & 3
            q[..., 128 * h + 32 * k:128 * h + 32 * k + 32] = lo | (hi << 4)
    return q


def to_device(qtype, raw: np.ndarray, cols: int) -> np.ndarray:
    """A matrix's GGUF bytes (rows, row_bytes) -> its device bytes (rows, device_row_bytes)."""
    raw = np.ascontiguousarray(raw).view(np.uint8)
    rows = raw.shape[0]
    if qtype not in REGROUPED:
        return raw.reshape(rows, -1)
    out = np.zeros((rows, device_row_bytes(qtype, cols)), np.uint8)
    nu = cols // 32
    if qtype == Q.Q8_0:
        blocks = raw.reshape(rows, nu, 34)
        out[:, :32 * nu] = blocks[..., 2:].reshape(rows, -1)
        out[:, 32 * nu:34 * nu] = blocks[..., :2].reshape(rows, -1)
        return out
    if qtype == Q.MXFP4:
        blocks = raw.reshape(rows, nu, 17)
        out[:, :16 * nu] = blocks[..., 1:].reshape(rows, -1)
        out[:, 16 * nu:17 * nu] = blocks[..., 0]
        return out
    if qtype == Q.Q5_0:
        blocks = raw.reshape(rows, nu, 22)
        out[:, :16 * nu] = blocks[..., 6:].reshape(rows, -1)
        out[:, 16 * nu:20 * nu] = _q5_0_qh(blocks[..., 2:6]).reshape(rows, -1)
        out[:, 20 * nu:22 * nu] = blocks[..., :2].reshape(rows, -1)
        return out
    nbk = cols // 256
    blocks = raw.reshape(rows, nbk, _Q6K_BLOCK)
    units = _q6k_values(blocks).reshape(rows, nbk, 8, 32)
    lo = (units[..., :16] & 15) | ((units[..., 16:] & 15) << 4)                 # (rows, nbk, 8, 16)
    h2 = (units >> 4).reshape(rows, nbk, 8, 2, 4, 4).astype(np.uint16)           # [.., w, s, k]
    hi = (h2 << (2 * np.arange(4, dtype=np.uint16))[:, None]).sum(axis=-2, dtype=np.uint16)
    body = np.concatenate([lo.reshape(rows, nbk, 128), hi.astype(np.uint8).reshape(rows, nbk, 64),
                           blocks[..., 192:208]], axis=-1)
    out[:, :nbk * _Q6K_BODY] = body.reshape(rows, -1)
    out[:, nbk * _Q6K_BODY:nbk * _Q6K_BLOCK] = blocks[..., 208:210].reshape(rows, -1)
    return out


def dequantize_device(qtype, dev: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Device bytes -> float32 (rows, cols): the twin of the kernels' decoders."""
    if qtype not in REGROUPED:
        return dequantize(dev.reshape(rows, -1), qtype, (rows, cols))
    dev = np.ascontiguousarray(dev).view(np.uint8).reshape(rows, -1)
    nu = cols // 32
    if qtype == Q.MXFP4:      # back to GGUF's blocks: the format's own decoder is the twin
        blocks = np.concatenate([dev[:, 16 * nu:17 * nu, None], dev[:, :16 * nu].reshape(rows, nu, 16)], axis=-1)
        return dequantize(blocks.reshape(rows, -1), qtype, (rows, cols))
    if qtype in (Q.Q8_0, Q.Q5_0):
        qb = 32 if qtype == Q.Q8_0 else 20
        d = dev[:, qb * nu:(qb + 2) * nu].copy().view(np.float16).astype(np.float32)[..., None]
        if qtype == Q.Q8_0:
            q = dev[:, :32 * nu].view(np.int8).reshape(rows, nu, 32).astype(np.float32)
        else:
            qs = dev[:, :16 * nu].reshape(rows, nu, 16)
            qh = np.unpackbits(dev[:, 16 * nu:20 * nu].reshape(rows, nu, 4), axis=-1, bitorder="little")
            fifth = qh.reshape(rows, nu, 4, 2, 4).transpose(0, 1, 3, 4, 2).reshape(rows, nu, 32)  # [half, i, k]
            low = np.concatenate([qs & 15, qs >> 4], axis=-1)
            q = ((low | (fifth << 4)).astype(np.int8) - 16).astype(np.float32)
        return (d * q).reshape(rows, cols)
    nbk = cols // 256
    body = dev[:, :nbk * _Q6K_BODY].reshape(rows, nbk, _Q6K_BODY)
    lo = body[..., :128].reshape(rows, nbk, 8, 16)
    hi = body[..., 128:192].reshape(rows, nbk, 8, 8)
    sc = body[..., 192:208].reshape(rows, nbk, 8, 2).view(np.int8)
    d = dev[:, nbk * _Q6K_BODY:nbk * _Q6K_BLOCK].copy().view(np.float16).astype(np.float32)
    q = np.empty((rows, nbk, 8, 32), np.int32)
    q[..., :16] = lo & 15
    q[..., 16:] = lo >> 4
    hi4 = hi.reshape(rows, nbk, 8, 2, 1, 4)                                    # [.., w, -, k]
    h = (hi4 >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3                # [.., w, s, k]
    q |= h.reshape(rows, nbk, 8, 32).astype(np.int32) << 4
    scale = d[:, :, None, None] * np.repeat(sc.astype(np.float32), 16, axis=-1)   # gguf's (d * sc) * q
    w = scale * (q - 32).astype(np.float32)
    return w.reshape(rows, cols)
