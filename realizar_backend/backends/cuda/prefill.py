"""Prefill of many tokens: every matrix of a layer is dequantized into the workspace and
multiplied by cuBLAS (fp32 accumulate and output straight into the destination, beta = 1 for the
residual adds). Settings.prefill_precision picks the GEMM inputs: "fp32" (plain SGEMM) or "fp16"
(tensor cores; the down projection's input is row-scaled by powers of two, since fp16 cannot hold
its range). The norms, RoPE + KV write and attention are the decode path's kernels (Forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import cupy

from . import ops
from .weights import LayerIndex, WeightRef

if TYPE_CHECKING:
    from .forward import Forward


class PrefillGemm:
    def __init__(self, fwd: "Forward"):
        self.f = fwd
        self.k, self.ws, self.c = fwd.k, fwd.ws, fwd.c
        self.prefill = fwd.prefill
        self.act = fwd.act
        self.norm16 = fwd.norm16

    def _gemm(self, w: WeightRef, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
              accumulate: bool = False, dtype: str = "fp16") -> None:
        """y[:T] (+)= x[:T] @ w.T (+ bias): dequantize w into the workspace in the GEMM's input type,
        cuBLAS GEMM, fp32 out."""
        if dtype == "fp32":
            ops.dequant(self.k, w, self.ws.deq.data.ptr, w.cols)
        else:
            ops.dequant16(self.k, w, self.ws.deq.data.ptr, w.cols, dtype == "bf16")
        ops.gemm(self.ws.deq.data.ptr, w.rows, w.cols, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], T,
                 accumulate, cupy.cuda.get_current_stream().ptr, dtype)
        if bias:
            ops.epilogue(self.k, y.data.ptr, y.data.ptr, bias, T, w.rows, False)

    def _norm_to16(self, x: cupy.ndarray, w: int, T: int) -> None:
        ws = self.ws
        if self.norm16:
            self.f._norm_q8(x, w, T, None, out16=ws.h16)
        else:
            self.f._norm(x, w, ws.h, T)
            ops.f32_to_f16(self.k, ws.h.data.ptr, ws.h16.data.ptr, T * self.c.hidden)

    def layer(self, li: int, lw: LayerIndex, T: int, pos: int, slots: int) -> None:
        c, k, ws = self.c, self.k, self.ws
        f32 = self.prefill == "fp32"
        dt = "fp32" if f32 else "fp16"
        if f32:
            self.f._norm(ws.x, lw.attn_norm, ws.h, T)
        else:
            self._norm_to16(ws.x, lw.attn_norm, T)
        h = ws.h if f32 else ws.h16
        self._gemm(lw.wq, h, T, ws.q, lw.bq, dtype=dt)
        self._gemm(lw.wk, h, T, ws.k, lw.bk, dtype=dt)
        self._gemm(lw.wv, h, T, ws.v, lw.bv, dtype=dt)
        self.f._qk_norm_rope(li, lw, T, pos, slots)
        if f32:
            self.f._attention(li, lw, T, pos, slots)
        else:
            self.f._attention(li, lw, T, pos, slots, o16=ws.attn16.data.ptr)
        attn = ws.attn if f32 else ws.attn16
        if lw.post_attn_norm:
            self._gemm(lw.wo, attn, T, ws.tmp, dtype=dt)
            self.f._norm(ws.tmp, lw.post_attn_norm, ws.x, T, add=True)
        else:
            self._gemm(lw.wo, attn, T, ws.x, accumulate=True, dtype=dt)
        if f32:
            self.f._norm(ws.x, lw.ffn_norm, ws.h, T)
        else:
            self._norm_to16(ws.x, lw.ffn_norm, T)
        self._gemm(lw.w_gate, h, T, ws.g, dtype=dt)
        self._gemm(lw.w_up, h, T, ws.u, dtype=dt)
        ops.act_mul(k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * c.ffn_dim, self.act)
        if self.prefill == "fp32":
            if lw.post_ffn_norm:
                self._gemm(lw.w_down, ws.a, T, ws.tmp, dtype="fp32")
                self.f._norm(ws.tmp, lw.post_ffn_norm, ws.x, T, add=True)
            else:
                self._gemm(lw.w_down, ws.a, T, ws.x, accumulate=True, dtype="fp32")
            return
        # act(g) * u has no bound fp16 can hold: each row goes in scaled by a power of two and
        # comes out unscaled (exact both ways), keeping fp16's mantissa where bf16 would lose 3 bits
        H = c.hidden
        ops.row_scale_f16(k, ws.a.data.ptr, c.ffn_dim, ws.a16.data.ptr, c.ffn_dim, ws.row_inv.data.ptr, T, c.ffn_dim)
        self._gemm(lw.w_down, ws.a16, T, ws.tmp)
        if lw.post_ffn_norm:
            ops.unscale_rows(k, ws.tmp.data.ptr, H, ws.tmp.data.ptr, H, ws.row_inv.data.ptr, T, H, False)
            self.f._norm(ws.tmp, lw.post_ffn_norm, ws.x, T, add=True)
        else:
            ops.unscale_rows(k, ws.x.data.ptr, H, ws.tmp.data.ptr, H, ws.row_inv.data.ptr, T, H, True)
