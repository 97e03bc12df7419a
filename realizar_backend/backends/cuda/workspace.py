"""Grow-only buffer pools for the forward pass. Everything a step touches is allocated here, at
the high-water mark (tokens per step, decode batch), so the forward pass allocates nothing and
buffer addresses stay fixed for captured graphs. `ensure` is the one place that grows the pools,
and the one place that invalidates whatever holds old addresses (listeners, i.e. the graphs)."""

from __future__ import annotations

import logging
from typing import Callable

import cupy
import numpy as np

from ...model.config import ModelConfig

log = logging.getLogger(__name__)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _carve(rows: int, *layouts: list[tuple[type, int]]) -> tuple[cupy.ndarray, list[list[cupy.ndarray]]]:
    """One allocation shared by several layouts of [rows, width] arrays (dtype, width): each
    layout's arrays lie back to back from offset 0 (256-byte aligned), so arrays of different
    layouts overlap. For buffers that are never live in the same step."""
    def size(dt, w):
        return (rows * w * np.dtype(dt).itemsize + 255) // 256 * 256
    pool = cupy.empty(max(sum(size(dt, w) for dt, w in lay) for lay in layouts), cupy.uint8)
    views = []
    for lay in layouts:
        off, vs = 0, []
        for dt, w in lay:
            n = rows * w * np.dtype(dt).itemsize
            vs.append(pool[off:off + n].view(dt).reshape(rows, w))
            off += size(dt, w)
        views.append(vs)
    return pool, views


class Workspace:
    def __init__(self, cfg: ModelConfig, max_rows: int, tokens: int, dequant_elems: int):
        self.cfg = cfg
        self.max_rows = max_rows            # decode batch (bucketed) and prefill items per call
        self.capacity = 0                   # tokens per forward step the pools hold
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
        # one matrix's split16 halves (two fp16 per weight), grown to a group of matrices split
        # before each GEMM where the split weights are not kept (ensure_dequant)
        self.deq = cupy.empty(dequant_elems, cupy.float32)
        # decode inputs (token ids, positions, slots) in one fixed buffer: one host copy per step,
        # and addresses that no pool growth moves (the captured graphs read them)
        self.dec_io = cupy.zeros((4, max_rows), cupy.int32)   # tokens, positions, slots, ring row
        self._fixed = [self.logits, self.argmax, self.last, self.last_norm, self.last_idx, self.deq, self.dec_io]
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
        # The FFN rows of the GEMV and tensor-core steps (g, u, a) and the split16 steps' scratch
        # are never live in the same step, so they share ffn_pool: y32 holds a GEMM's output rows
        # before 1/s (q|k|v or gate|up side by side), x16 the split activation rows
        # [xh*2^-12 | xh | xl] of the projection being computed (prefill.cu).
        F = c.ffn_dim
        # a linear-attention hybrid's projections (model/transformer.py): the gated attention's
        # [query | gate] heads (2 q_dim), the DeltaNet's mixed q|k|v channels, z, beta and alpha
        hy = c.has_recurrent_state
        C, inner, nv = (2 * c.ssm_k_heads * c.ssm_k_dim + c.ssm_v_heads * c.ssm_v_dim, c.ssm_v_heads * c.ssm_v_dim,
                        c.ssm_v_heads) if hy else (0, 0, 0)
        n_y = max(2 * F, c.q_dim + 2 * c.kv_dim, (2 * c.q_dim + 2 * c.kv_dim) if hy else 0, C + inner + 2 * nv)
        k_max = max(c.hidden, c.q_dim, F, inner)
        # A mixture of experts' routed experts (experts.py) take a third layout of ffn_pool: per (row,
        # expert) pair, top_k a row, the gated activations (moe_a) and the down projection's output
        # (moe_y, wide enough to hold the unfused gate and up rows before it: 2 F a pair). Nothing in
        # ffn_pool outlives the operation that writes it, so the three layouts never meet.
        E, top, Fe = c.n_experts, c.n_experts_used, c.expert_ffn_dim
        y_w = max(c.hidden, 2 * Fe)
        moe = [(f32, top * Fe), (f32, top * y_w)] if E else []
        self.ffn_pool, ((self.g, self.u, self.a), (self.y32, self.x16), moe_rows) = _carve(
            cap, [(f32, F), (f32, F), (f32, F)], [(f32, n_y), (cupy.float16, 3 * k_max)], moe)
        self.moe: list[cupy.ndarray] = []
        if E:
            self.moe_a = moe_rows[0].reshape(cap * top, Fe)
            self.moe_y = moe_rows[1].reshape(cap * top, y_w)
            self.moe_logits = cupy.empty((cap, E), f32)        # the router's output
            self.moe_ids = cupy.empty((cap, top), cupy.int32)  # each row's experts, best first
            self.moe_w = cupy.empty((cap, top), f32)           # and their weights
            self.moe = [self.moe_logits, self.moe_ids, self.moe_w]
            if c.shared_expert_ffn_dim:                # a shared expert's gate, up, act(gate) * up, gate logit
                Fs = c.shared_expert_ffn_dim
                self.sh_g, self.sh_u, self.sh_a = (cupy.empty((cap, Fs), f32) for _ in range(3))
                self.sh_s = cupy.empty((cap, 1), f32)
                self.moe += [self.sh_g, self.sh_u, self.sh_a, self.sh_s]
        # the projections' outputs by the rows of their matrices (outputs())
        self._outputs = {(c.q_dim, c.kv_dim, c.kv_dim): (self.q, self.k, self.v)}
        self.hybrid: list[cupy.ndarray] = []
        if hy:
            self.qg = cupy.empty((cap, 2 * c.q_dim), f32)    # a gated attention's [query | gate] heads
            self.gate = cupy.empty((cap, c.q_dim), f32)      # ... its gates, split off (split_pair)
            self.mixed = cupy.empty((cap, C), f32)           # a DeltaNet's q|k|v channels, z, beta, alpha
            self.z = cupy.empty((cap, inner), f32)
            self.beta = cupy.empty((cap, nv), f32)
            self.alpha = cupy.empty((cap, nv), f32)
            self.conv = cupy.empty((cap, C), f32)            # silu(conv) of the mixed channels
            self.dn_out = cupy.empty((cap, inner), f32)      # the gated RMSNorm of the heads' output
            self.hybrid = [self.qg, self.gate, self.mixed, self.z, self.beta, self.alpha, self.conv, self.dn_out]
            self._outputs[(2 * c.q_dim, c.kv_dim, c.kv_dim)] = (self.qg, self.k, self.v)
            self._outputs[(C, inner, nv, nv)] = (self.mixed, self.z, self.beta, self.alpha)
        self.split_inv = cupy.empty((2, cap), f32)       # 1/s of the split rows (input, FFN down input)
        # ... their addresses, which the split16 steps read per projection (indexing a CuPy array
        # makes a view: microseconds of host time each)
        self.split_inv_ptrs = (self.split_inv[0].data.ptr, self.split_inv[1].data.ptr)
        self.tokens = cupy.empty(cap, cupy.int32)
        self.positions = cupy.empty(cap, cupy.int32)
        self.slots = cupy.empty(cap, cupy.int32)
        grown = self.capacity > 0
        self.capacity = cap
        if grown:
            log.info("cuda workspace grew to %d tokens per step (%.1f MB); dropping captured graphs",
                     cap, self.nbytes / 1e6)
            for cb in self.listeners:
                cb()

    def outputs(self, rows: tuple[int, ...]) -> tuple[cupy.ndarray, ...]:
        """Where a group of projections of one input writes, by its matrices' rows: q, k, v (an
        attention), qg, k, v (a gated attention), mixed, z, beta, alpha (a DeltaNet)."""
        return self._outputs[rows]

    def ensure_dequant(self, elems: int) -> None:
        """Make the dequantize buffer hold `elems` float32 (split16 steps dequantize a group of
        matrices there, q+k+v or gate+up, at one or two fp16 values a weight). Called at
        load; no captured graph reads this buffer, but growing it is treated as any pool growth
        (graphs dropped) so that one rule covers every buffer."""
        if elems <= self.deq.size:
            return
        old = self.deq
        self.deq = cupy.empty(elems, cupy.float32)
        self._fixed = [self.deq if a is old else a for a in self._fixed]
        del old
        log.info("cuda workspace: prefill dequantize buffer grew to %.1f MB", self.deq.nbytes / 1e6)
        for cb in self.listeners:
            cb()

    @property
    def nbytes(self) -> int:
        grow = (self.x, self.h, self.tmp, self.q, self.k, self.v, self.attn, self.ffn_pool,
                self.split_inv, self.tokens, self.positions, self.slots, *self.moe, *self.hybrid)
        return sum(a.nbytes for a in grow) + sum(a.nbytes for a in self._fixed)
