"""The transformer forward pass as a sequence of kernel launches over the workspace.

Everything a step reads that changes per step (token ids, positions, slots) is already in the
workspace's device buffers, so a decode step is a fixed launch sequence per batch bucket that a
CUDA graph can capture and replay. Decode projections are quantized GEMVs on the raw blocks;
prefill projections over many tokens dequantize one matrix at a time into the workspace and run
cuBLAS (cupy.matmul), then a small epilogue adds bias / residual.
"""

from __future__ import annotations

import cupy

from . import ops
from .kv_cache import KVCache
from .modules import Kernels
from .weights import DeviceWeights, WeightRef
from .workspace import Workspace

# prefill steps with more tokens than this use dequantize + cuBLAS; fewer use the GEMV kernels
GEMM_MIN_TOKENS = 16


class Forward:
    def __init__(self, k: Kernels, w: DeviceWeights, ws: Workspace, kv: KVCache):
        self.k, self.w, self.ws, self.kv = k, w, ws, kv
        self.c = w.config
        self.act = 1 if self.c.activation == "gelu_tanh" else 0

    # ------------------------------------------------------------ building blocks
    def linear(self, w: WeightRef, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
               accumulate: bool = False, gemm: bool = False) -> None:
        """y[:T] (+)= x[:T] @ w.T (+ bias). x, y: 2-D workspace pools with rows of their width."""
        if not gemm:
            ops.gemv(self.k, w, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], T, bias, accumulate)
            return
        n, kdim = w.rows, w.cols
        ops.dequant(self.k, w, self.ws.deq.data.ptr, kdim)
        wf = self.ws.deq[:n * kdim].reshape(n, kdim)
        out = self.ws.gemm[:T * n].reshape(T, n)
        cupy.matmul(x[:T, :kdim], wf.T, out=out)
        ops.epilogue(self.k, y.data.ptr, out.data.ptr, bias, T, n, accumulate)

    def _norm(self, x: cupy.ndarray, w: int, out: cupy.ndarray, T: int, add: bool = False) -> None:
        ops.rms_norm(self.k, x.data.ptr, x.shape[1], w, out.data.ptr, out.shape[1], T, x.shape[1],
                     self.c.rms_eps, add)

    # ------------------------------------------------------------ the layers
    def layers(self, T: int, gemm: bool) -> None:
        """Embed ws.tokens[:T] and run every layer; the residual stream ends in ws.x[:T]."""
        c, k, ws, kv = self.c, self.k, self.ws, self.kv
        ops.embed(k, self.w.tok_embd, ws.tokens.data.ptr, T, c.embed_scale, ws.x.data.ptr, c.hidden)
        for li, lw in enumerate(self.w.layers):
            self._norm(ws.x, lw.attn_norm, ws.h, T)
            self.linear(lw.wq, ws.h, T, ws.q, lw.bq, gemm=gemm)
            self.linear(lw.wk, ws.h, T, ws.k, lw.bk, gemm=gemm)
            self.linear(lw.wv, ws.h, T, ws.v, lw.bv, gemm=gemm)
            if lw.q_norm:
                D = c.head_dim
                ops.rms_norm(k, ws.q.data.ptr, D, lw.q_norm, ws.q.data.ptr, D, T * c.n_heads, D, c.rms_eps)
                ops.rms_norm(k, ws.k.data.ptr, D, lw.k_norm, ws.k.data.ptr, D, T * c.n_kv_heads, D, c.rms_eps)
            ops.rope_kv(k, ws.q.data.ptr, ws.k.data.ptr, ws.v.data.ptr, ws.positions.data.ptr,
                        ws.slots.data.ptr, kv.k_ptrs[li], kv.v_ptrs[li], kv.context, c.n_heads,
                        c.n_kv_heads, c.head_dim, c.rope_dim, lw.theta, c.rope_style == "neox", T)
            ops.attention(k, ws.q.data.ptr, ws.attn.data.ptr, kv.k_ptrs[li], kv.v_ptrs[li],
                          ws.slots.data.ptr, ws.positions.data.ptr, kv.context, c.n_heads, c.n_kv_heads,
                          c.head_dim, c.scale, lw.window, T)
            if lw.post_attn_norm:
                self.linear(lw.wo, ws.attn, T, ws.tmp, gemm=gemm)
                self._norm(ws.tmp, lw.post_attn_norm, ws.x, T, add=True)
            else:
                self.linear(lw.wo, ws.attn, T, ws.x, accumulate=True, gemm=gemm)
            self._norm(ws.x, lw.ffn_norm, ws.h, T)
            if lw.fused_ffn and not gemm:
                ops.ffn_gate_up(k, lw.w_gate, lw.w_up, ws.h.data.ptr, c.hidden, ws.a.data.ptr, c.ffn_dim,
                                T, self.act)
            else:
                self.linear(lw.w_gate, ws.h, T, ws.g, gemm=gemm)
                self.linear(lw.w_up, ws.h, T, ws.u, gemm=gemm)
                ops.act_mul(k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * c.ffn_dim, self.act)
            if lw.post_ffn_norm:
                self.linear(lw.w_down, ws.a, T, ws.tmp, gemm=gemm)
                self._norm(ws.tmp, lw.post_ffn_norm, ws.x, T, add=True)
            else:
                self.linear(lw.w_down, ws.a, T, ws.x, accumulate=True, gemm=gemm)

    def head(self, rows: cupy.ndarray, n: int) -> None:
        """Final norm + LM head (GEMV) + greedy argmax for rows[:n] -> ws.logits, ws.argmax."""
        c, ws = self.c, self.ws
        self._norm(rows, self.w.output_norm, ws.last_norm, n)
        ops.gemv(self.k, self.w.output, ws.last_norm.data.ptr, c.hidden, ws.logits.data.ptr, c.vocab_size, n)
        ops.argmax_rows(self.k, ws.logits.data.ptr, c.vocab_size, c.vocab_size, ws.argmax.data.ptr, n)

    # ------------------------------------------------------------ whole steps
    def decode_step(self, b: int) -> None:
        """One decode step for b rows (a bucket); inputs in ws.tokens/positions/slots[:b]."""
        self.layers(b, gemm=False)
        self.head(self.ws.x, b)

    def prefill_step(self, T: int, n_items: int) -> None:
        """T prompt tokens of n_items sequences; ws.last_idx[:n_items] holds each item's last row."""
        self.layers(T, gemm=T > GEMM_MIN_TOKENS)
        ops.gather_rows(self.k, self.ws.x.data.ptr, self.ws.last_idx.data.ptr, self.ws.last.data.ptr,
                        n_items, self.c.hidden)
        self.head(self.ws.last, n_items)
