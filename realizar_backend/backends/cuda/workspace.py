"""Grow-only buffer pools for the forward pass. Everything a step touches is allocated here, at
the high-water mark (tokens per step, decode batch), so the forward pass allocates nothing and
buffer addresses stay fixed for captured graphs. `ensure` is the one place that grows the pools,
and the one place that invalidates whatever holds old addresses (listeners, i.e. the graphs)."""

from __future__ import annotations

import logging
from typing import Callable

import cupy

from ...model.config import ModelConfig

log = logging.getLogger(__name__)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Workspace:
    def __init__(self, cfg: ModelConfig, max_rows: int, tokens: int, dequant_elems: int):
        self.cfg = cfg
        self.max_rows = max_rows            # decode batch (bucketed) and prefill items per call
        self.capacity = 0                   # tokens per forward step the pools hold
        self.generation = 0
        self.listeners: list[Callable[[], None]] = []
        c = cfg
        f32 = cupy.float32
        # fixed-size pools: logits and the final rows are bounded by max_rows, the dequantize
        # buffer by the largest layer matrix
        self.logits = cupy.empty((max_rows, c.vocab_size), f32)
        self.argmax = cupy.empty(max_rows, cupy.int32)
        self.last = cupy.empty((max_rows, c.hidden), f32)
        self.last_norm = cupy.empty((max_rows, c.hidden), f32)
        self.last_idx = cupy.empty(max_rows, cupy.int32)
        # one matrix for the prefill GEMM, in fp32 for TF32 GEMMs (fp16/bf16 use its first half)
        self.deq = cupy.empty(dequant_elems, cupy.float32)
        # decode inputs (token ids, positions, slots) in one fixed buffer: one host copy per step,
        # and addresses that no pool growth moves (the captured graphs read them)
        self.dec_io = cupy.zeros((3, max_rows), cupy.int32)
        self.head_q = cupy.empty((max_rows, c.hidden), cupy.int8)      # final norm as 8-bit blocks
        self.head_d = cupy.empty((max_rows, c.hidden // 32 * 2), f32)
        self._fixed = [self.logits, self.argmax, self.last, self.last_norm, self.last_idx, self.deq,
                       self.dec_io, self.head_q, self.head_d]
        self.ensure(max(tokens, max_rows))

    def ensure(self, tokens: int) -> None:
        """Make room for `tokens` rows per step; growing drops every graph (listeners)."""
        if tokens <= self.capacity:
            return
        cap = next_pow2(tokens)
        c, f32 = self.cfg, cupy.float32
        self.x = cupy.empty((cap, c.hidden), f32)        # residual stream
        self.h = cupy.empty((cap, c.hidden), f32)        # normed input of a projection
        self.tmp = cupy.empty((cap, c.hidden), f32)      # projection output before a post-norm
        self.q = cupy.empty((cap, c.q_dim), f32)
        self.k = cupy.empty((cap, c.kv_dim), f32)
        self.v = cupy.empty((cap, c.kv_dim), f32)
        self.attn = cupy.empty((cap, c.q_dim), f32)
        self.g = cupy.empty((cap, c.ffn_dim), f32)
        self.u = cupy.empty((cap, c.ffn_dim), f32)
        self.a = cupy.empty((cap, c.ffn_dim), f32)
        # 8-bit activation blocks (int8 values + float2 (d, d*sum) per 32) of the three GEMV inputs
        i8 = cupy.int8
        self.hq, self.hd = cupy.empty((cap, c.hidden), i8), cupy.empty((cap, c.hidden // 32 * 2), f32)
        self.aq, self.ad = cupy.empty((cap, c.q_dim), i8), cupy.empty((cap, c.q_dim // 32 * 2), f32)
        self.fq, self.fd = cupy.empty((cap, c.ffn_dim), i8), cupy.empty((cap, c.ffn_dim // 32 * 2), f32)
        # fp16 GEMM inputs for prefill: normed hidden, attention output, FFN activation
        f16 = cupy.float16
        self.h16 = cupy.empty((cap, c.hidden), f16)
        self.attn16 = cupy.empty((cap, c.q_dim), f16)
        self.a16 = cupy.empty((cap, c.ffn_dim), f16)
        self.row_inv = cupy.empty(cap, f32)              # per-row scales of a16 (row_scale_f16)
        self.tokens = cupy.empty(cap, cupy.int32)
        self.positions = cupy.empty(cap, cupy.int32)
        self.slots = cupy.empty(cap, cupy.int32)
        grown = self.capacity > 0
        self.capacity = cap
        self.generation += 1
        if grown:
            log.info("cuda workspace grew to %d tokens per step (%.1f MB); dropping captured graphs",
                     cap, self.nbytes / 1e6)
            for cb in self.listeners:
                cb()

    @property
    def nbytes(self) -> int:
        grow = (self.x, self.h, self.tmp, self.q, self.k, self.v, self.attn, self.g, self.u, self.a,
                self.hq, self.hd, self.aq, self.ad, self.fq, self.fd, self.h16, self.attn16, self.a16, self.row_inv,
                self.tokens, self.positions, self.slots)
        return sum(a.nbytes for a in grow) + sum(a.nbytes for a in self._fixed)
