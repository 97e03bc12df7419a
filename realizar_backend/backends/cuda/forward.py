"""The transformer forward pass as a sequence of kernel launches over the workspace.

Everything a step reads that changes per step (token ids, positions, slots) is already in
device buffers, so a decode step is a fixed launch sequence per batch bucket that a CUDA graph
can capture and replay.

Decode (and prefill of a few tokens): projections are integer-dot GEMVs (mmvq.cu) on 8-bit
activation blocks produced by the kernel before them: RMSNorm quantizes its output, attention
quantizes its output, the fused gate/up/activation quantizes its output. Q, K and V are one
launch; the residual adds happen inside the output and down projections. Per layer: norm,
QKV, RoPE + KV write, attention, output projection, norm, gate/up, down (8 launches).
Matrices whose type has no integer-dot kernel (float types) use the fp32-activation GEMVs.

With fp32 activations (Settings.decode_activations "fp32", the default) the same launch shape is
kept with mmvf.cu's kernels: RMSNorm writes fp32, Q/K/V are one launch with biases, gate+up+act is
one launch writing fp32, the output and down projections add into the residual in their epilogue,
and the LM head is one mmvf launch. Matrices of float types (F32, F16, BF16: no 32-weight blocks)
run on the one-warp-per-row gemv.cu kernels.

The KV cache is paged (kv_cache.py): attention and the KV writes address it through the slots'
block tables.

Prefill of many tokens (more than GEMM_MIN_TOKENS) runs its projections as GEMMs: prefill.py.
"""

from __future__ import annotations

import cupy

from ...settings import Settings
from . import ops
from .kv_cache import KVCache
from .modules import Kernels
from .prefill import PrefillGemm
from .weights import DeviceWeights, LayerIndex, WeightRef
from .workspace import Workspace

# prefill steps with more tokens than this use dequantize + tensor-core GEMM; fewer use the GEMVs
GEMM_MIN_TOKENS = 16


class _LayerPlan:
    """Which projections of a layer take the 8-bit path (decided once, at load)."""

    def __init__(self, lw: LayerIndex, c, int8: bool, int8_down: bool):
        norm_ok = c.hidden % 32 == 0 and c.hidden <= ops.NQ_MAXK * 1024
        self.qkv = int8 and all(ops.blocks_ok(w) for w in (lw.wq, lw.wk, lw.wv)) and norm_ok
        self.wo = int8 and ops.blocks_ok(lw.wo) and c.q_dim % 32 == 0
        self.ffn = int8 and lw.fused_ffn and ops.blocks_ok(lw.w_gate) and norm_ok and c.ffn_dim % 32 == 0
        self.down = self.ffn and ops.blocks_ok(lw.w_down) and int8_down
        # projections that stay on fp32 activations: the fast mmvf.cu kernels where the type has one
        self.f_qkv = all(ops.blocks_ok(w) for w in (lw.wq, lw.wk, lw.wv))
        self.f_wo = ops.blocks_ok(lw.wo)
        self.f_ffn = lw.fused_ffn and ops.blocks_ok(lw.w_gate)
        self.f_gu = not lw.fused_ffn and ops.blocks_ok(lw.w_gate) and ops.blocks_ok(lw.w_up)
        self.f_down = ops.blocks_ok(lw.w_down)


class Forward:
    def __init__(self, k: Kernels, w: DeviceWeights, ws: Workspace, settings: Settings, max_context: int):
        """settings.decode_activations: "fp32" (every projection on fp32 activations: the reference
        the others approximate, on mmvf.cu), "int8" (8-bit activation blocks everywhere they apply),
        "int8-fp32-down" (all but the FFN down projection, whose input has the widest range).
        settings.prefill_precision / prefill_weight_cache: the prefill GEMMs (prefill.py). The KV
        cache (`kv`) is set by the backend once it has sized the pool from what is left."""
        int8 = settings.decode_activations != "fp32"
        self.prefill = settings.prefill_precision
        self.k, self.w, self.ws = k, w, ws
        self.kv: KVCache | None = None
        self.c = w.config
        self.act = 1 if self.c.activation == "gelu_tanh" else 0
        self.int8 = int8
        self.plans = [_LayerPlan(lw, self.c, int8, settings.decode_activations == "int8") for lw in w.layers]
        self.norm16 = self.c.hidden % 32 == 0 and self.c.hidden <= ops.NQ_MAXK * 1024
        self.head_q8 = ops.blocks_ok(w.output) and self.norm16 and int8
        self.head_f32 = ops.blocks_ok(w.output)
        # packed (value, row) keys of the LM head's fused argmax; argmax_unpack re-zeroes them
        self.am_key = cupy.zeros(ws.max_rows, cupy.uint64)
        # RoPE cos/sin per position (rope.cu, attention.cu), one table per distinct layer theta
        self.rope_tables = {th: ops.rope_table(max_context, self.c.rope_dim, th) for th in {lw.theta for lw in w.layers}}
        self.gemm_layers = PrefillGemm(self, settings.prefill_weight_cache)
        # launch the kernels that wait for their predecessor in pdl_wait() as programmatic dependent
        # launches (pdl.py); the backend sets it while it captures a decode step
        self.pdl = False
        # (device pointer, length) of the host's token ring (token_ring.py); (0, 0): none
        self.token_ring = (0, 0)

    # ------------------------------------------------------------ building blocks
    def _gemv(self, w: WeightRef, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
              accumulate: bool = False) -> None:
        ops.gemv(self.k, w, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], T, bias, accumulate)

    def _proj(self, w: WeightRef, fast: bool, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
              accumulate: bool = False) -> None:
        """y[:T] (+)= x[:T] @ w.T (+ bias) on fp32 activations: mmvf.cu when `fast` (block types),
        else gemv.cu (float types)."""
        if fast:
            ops.mmvf(self.k, [(w, bias, y.data.ptr, y.shape[1])], w.cols, x.data.ptr, x.shape[1], T, accumulate,
                     pdl=self.pdl)
        else:
            self._gemv(w, x, T, y, bias, accumulate)

    def _norm(self, x: cupy.ndarray, w: int, out: cupy.ndarray, T: int, add: bool = False) -> None:
        ops.rms_norm(self.k, x.data.ptr, x.shape[1], w, out.data.ptr, out.shape[1], T, x.shape[1],
                     self.c.rms_eps, add)

    def _normed(self, x: cupy.ndarray, w: int, T: int):
        """The input of an mmvf/ffnf launch that starts with RMSNorm(x[:T]) by weight w: x itself
        and the norm to fold into the launch, or (when the rows do not fit in shared memory) the
        norm written to ws.h by its own launch."""
        if ops.mmvf_stage_ok(self.c.hidden, T):
            return x, (w, self.c.rms_eps)
        self._norm(x, w, self.ws.h, T)
        return self.ws.h, None

    def _norm_q8(self, x: cupy.ndarray, w: int, T: int, out32: cupy.ndarray | None,
                 q: cupy.ndarray | None = None, d: cupy.ndarray | None = None, out16: cupy.ndarray | None = None) -> None:
        ops.rms_norm_q8(self.k, x.data.ptr, x.shape[1], w, 0 if out32 is None else out32.data.ptr,
                        0 if out16 is None else out16.data.ptr, 0 if q is None else q.data.ptr,
                        0 if d is None else d.data.ptr, T, self.c.hidden, self.c.rms_eps)

    def _qk_norm_rope(self, li: int, lw: LayerIndex, T: int, pos: int, slots: int, rope: bool = True) -> None:
        c, k, ws = self.c, self.k, self.ws
        if lw.q_norm:
            D = c.head_dim
            ops.rms_norm(k, ws.q.data.ptr, D, lw.q_norm, ws.q.data.ptr, D, T * c.n_heads, D, c.rms_eps)
            ops.rms_norm(k, ws.k.data.ptr, D, lw.k_norm, ws.k.data.ptr, D, T * c.n_kv_heads, D, c.rms_eps)
        if rope:
            ops.rope_kv(k, ws.q.data.ptr, ws.k.data.ptr, ws.v.data.ptr, pos, slots, self.kv.layer(li),
                        c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim, self.rope_tables[lw.theta].data.ptr,
                        c.rope_style == "neox", T)

    def _attention(self, li: int, lw: LayerIndex, T: int, pos: int, slots: int, oq: int = 0, od: int = 0,
                   o16: int = 0, fuse_rope: bool = False) -> None:
        c, ws = self.c, self.ws
        rope = ((ws.k.data.ptr, ws.v.data.ptr, c.rope_dim, c.rope_style == "neox",
                 self.rope_tables[lw.theta].data.ptr) if fuse_rope else None)
        ops.attention(self.k, ws.q.data.ptr, ws.attn.data.ptr, self.kv.layer(li), slots, pos,
                      c.n_heads, c.n_kv_heads, c.head_dim, c.scale, lw.window, T, oq, od, o16, rope,
                      pdl=self.pdl)

    # ------------------------------------------------------------ one layer, two ways
    def _layer_gemv(self, li: int, lw: LayerIndex, p: _LayerPlan, T: int, pos: int, slots: int,
                    decode: bool = False) -> None:
        """decode: one row per sequence (a decode step), so attention can do RoPE and the KV write
        itself; a short prompt's rows read each other's cache rows and need rope_kv first."""
        c, k, ws = self.c, self.k, self.ws
        if p.qkv:
            self._norm_q8(ws.x, lw.attn_norm, T, ws.h, ws.hq, ws.hd)
            ops.mmv_q8(k, [(lw.wq, lw.bq, ws.q.data.ptr, c.q_dim), (lw.wk, lw.bk, ws.k.data.ptr, c.kv_dim),
                           (lw.wv, lw.bv, ws.v.data.ptr, c.kv_dim)], c.hidden, ws.hq.data.ptr, ws.hd.data.ptr, T)
        elif p.f_qkv:
            x, norm = self._normed(ws.x, lw.attn_norm, T)
            ops.mmvf(k, [(lw.wq, lw.bq, ws.q.data.ptr, c.q_dim), (lw.wk, lw.bk, ws.k.data.ptr, c.kv_dim),
                         (lw.wv, lw.bv, ws.v.data.ptr, c.kv_dim)], c.hidden, x.data.ptr, x.shape[1], T, norm=norm,
                     pdl=self.pdl)
        else:
            self._norm(ws.x, lw.attn_norm, ws.h, T)
            self._gemv(lw.wq, ws.h, T, ws.q, lw.bq)
            self._gemv(lw.wk, ws.h, T, ws.k, lw.bk)
            self._gemv(lw.wv, ws.h, T, ws.v, lw.bv)
        fuse = decode and c.head_dim <= ops.ATT_MAXD
        self._qk_norm_rope(li, lw, T, pos, slots, rope=not fuse)
        if p.wo:
            self._attention(li, lw, T, pos, slots, ws.aq.data.ptr, ws.ad.data.ptr, fuse_rope=fuse)
            dst = ws.tmp if lw.post_attn_norm else ws.x
            ops.mmv_q8(k, [(lw.wo, 0, dst.data.ptr, c.hidden)], c.q_dim, ws.aq.data.ptr, ws.ad.data.ptr, T,
                       accumulate=not lw.post_attn_norm)
        else:
            self._attention(li, lw, T, pos, slots, fuse_rope=fuse)
            self._proj(lw.wo, p.f_wo, ws.attn, T, ws.tmp if lw.post_attn_norm else ws.x,
                       accumulate=not lw.post_attn_norm)
        if lw.post_attn_norm:
            self._norm(ws.tmp, lw.post_attn_norm, ws.x, T, add=True)
        if p.ffn:
            self._norm_q8(ws.x, lw.ffn_norm, T, None, ws.hq, ws.hd)
            ops.ffn_q8(k, lw.w_gate, lw.w_up, ws.hq.data.ptr, ws.hd.data.ptr, T, self.act, ws.fq.data.ptr,
                       ws.fd.data.ptr, 0 if p.down else ws.a.data.ptr)
        elif p.f_ffn:
            x, norm = self._normed(ws.x, lw.ffn_norm, T)
            ops.ffn_f(k, lw.w_gate, lw.w_up, x.data.ptr, x.shape[1], ws.a.data.ptr, c.ffn_dim, T, self.act, norm=norm,
                      pdl=self.pdl)
        else:
            self._norm(ws.x, lw.ffn_norm, ws.h, T)
            if lw.fused_ffn:
                ops.ffn_gate_up(k, lw.w_gate, lw.w_up, ws.h.data.ptr, c.hidden, ws.a.data.ptr, c.ffn_dim, T, self.act)
            elif p.f_gu:
                ops.mmvf(k, [(lw.w_gate, 0, ws.g.data.ptr, c.ffn_dim), (lw.w_up, 0, ws.u.data.ptr, c.ffn_dim)],
                         c.hidden, ws.h.data.ptr, ws.h.shape[1], T, pdl=self.pdl)
                ops.act_mul(k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * c.ffn_dim, self.act)
            else:
                self._gemv(lw.w_gate, ws.h, T, ws.g)
                self._gemv(lw.w_up, ws.h, T, ws.u)
                ops.act_mul(k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * c.ffn_dim, self.act)
        dst = ws.tmp if lw.post_ffn_norm else ws.x
        if p.down:
            ops.mmv_q8(k, [(lw.w_down, 0, dst.data.ptr, c.hidden)], c.ffn_dim, ws.fq.data.ptr, ws.fd.data.ptr, T,
                       accumulate=not lw.post_ffn_norm)
        else:
            self._proj(lw.w_down, p.f_down, ws.a, T, dst, accumulate=not lw.post_ffn_norm)
        if lw.post_ffn_norm:
            self._norm(ws.tmp, lw.post_ffn_norm, ws.x, T, add=True)

    # ------------------------------------------------------------ the layers
    def layers(self, T: int, gemm: bool, tok: int, pos: int, slots: int, decode: bool = False) -> None:
        """Embed token ids (device pointer tok) and run every layer; the residual stream ends in ws.x[:T].
        decode: the T rows are one new token per sequence."""
        c, ws = self.c, self.ws
        ops.embed(self.k, self.w.tok_embd, tok, T, c.embed_scale, ws.x.data.ptr, c.hidden)
        for li, lw in enumerate(self.w.layers):
            if gemm:
                self.gemm_layers.layer(li, lw, T, pos, slots)
            else:
                self._layer_gemv(li, lw, self.plans[li], T, pos, slots, decode)

    def head(self, rows: cupy.ndarray, n: int, io: cupy.ndarray | None = None) -> None:
        """Final norm + LM head (GEMV) + greedy argmax for rows[:n] -> ws.logits, ws.argmax; io: the
        decode inputs (ws.dec_io), which also receive the argmax tokens and advanced positions."""
        c, ws = self.c, self.ws
        feed = (io.data.ptr, io.shape[1], *self.token_ring) if io is not None else (0, 0, 0, 0)
        if self.head_q8:
            self._norm_q8(rows, self.w.output_norm, n, None, ws.head_q, ws.head_d)
            ops.mmv_q8(self.k, [(self.w.output, 0, ws.logits.data.ptr, c.vocab_size)], c.hidden,
                       ws.head_q.data.ptr, ws.head_d.data.ptr, n)
        elif self.head_f32:
            # norm, LM head and argmax in one launch (+ the tiny unpack)
            x, norm = self._normed(rows, self.w.output_norm, n)
            ops.mmvf(self.k, [(self.w.output, 0, ws.logits.data.ptr, c.vocab_size)], c.hidden, x.data.ptr,
                     x.shape[1], n, norm=norm, amax=self.am_key.data.ptr, pdl=self.pdl)
            ops.argmax_unpack(self.k, self.am_key.data.ptr, ws.argmax.data.ptr, n, *feed, pdl=self.pdl)
            return
        else:
            self._norm(rows, self.w.output_norm, ws.last_norm, n)
            self._gemv(self.w.output, ws.last_norm, n, ws.logits)
        ops.argmax_rows(self.k, ws.logits.data.ptr, c.vocab_size, c.vocab_size, ws.argmax.data.ptr, n, *feed)

    # ------------------------------------------------------------ whole steps
    def decode_step(self, b: int) -> None:
        """One decode step for b rows (a bucket); inputs in ws.dec_io[0/1/2, :b] (tokens/positions/slots).
        The step ends by writing its argmax tokens and the next positions into ws.dec_io[0/1]: the
        next step's inputs when the host feeds none."""
        io = self.ws.dec_io
        self.layers(b, False, io[0].data.ptr, io[1].data.ptr, io[2].data.ptr, decode=True)
        self.head(self.ws.x, b, io)

    def prefill_step(self, T: int, n_items: int) -> None:
        """T prompt tokens of n_items sequences; ws.last_idx[:n_items] holds each item's last row."""
        ws = self.ws
        self.layers(T, T > GEMM_MIN_TOKENS, ws.tokens.data.ptr, ws.positions.data.ptr, ws.slots.data.ptr)
        ops.gather_rows(self.k, ws.x.data.ptr, ws.last_idx.data.ptr, ws.last.data.ptr, n_items, self.c.hidden)
        self.head(ws.last, n_items)
