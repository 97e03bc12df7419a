"""How a step's projections run. The layer definition (Forward.block) is the same for every step;
what differs between a decode step of a few rows, a batched decode step and a prompt is how the
matrix products of a layer run, so each of those is a Projections object with four calls the
layer makes in order:

    qkv(li, lw, T)    RMSNorm(x) -> q, k, v (with biases)          [then Forward: q/k norm, RoPE, attention]
    out(li, lw, T)    o-projection of the attention output, into the residual x
    ffn(li, lw, T)    RMSNorm(x) -> act(gate) * up -> a
    down(li, lw, T)   down projection of a, into the residual x

and attn_outputs(li), the extra formats attention writes its output in for out() (8-bit blocks,
fp16). Where a layer has post-norms (gemma3), out() and down() normalize their result before
adding it (residual()). Everything reads and writes the workspace (workspace.py); `ctx.pdl` says
whether the launches are being captured as programmatic dependent launches.

This file holds the base and the GEMV projections (decode steps and short prompts): per layer a
plan picks the integer-dot GEMVs (mmvq.cu, 8-bit activations: Settings.decode_activations int8),
the fp32-activation GEMVs (mmvf.cu: the default) or, for matrices of float types, gemv.cu.
prefill.py holds the GEMM projections of prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy

from ...model.config import ModelConfig
from . import ops
from .modules import Kernels
from .weights import DeviceWeights, LayerIndex, WeightRef
from .workspace import Workspace


@dataclass
class StepContext:
    """What every projection of a step needs: kernels, weights, workspace, the model's numbers."""
    k: Kernels
    w: DeviceWeights
    ws: Workspace
    c: ModelConfig
    act: int                 # 0: silu, 1: gelu_tanh (ffn activation)
    pdl: bool = False        # launches are captured as programmatic dependent launches (pdl.py)

    @property
    def norm16(self) -> bool:
        """rms_norm_q8 takes the hidden width (8-bit and fp16 norm outputs)."""
        return self.c.hidden % 32 == 0 and self.c.hidden <= ops.NQ_MAXK * 1024


class Projections:
    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    # ------------------------------------------------------------ shared helpers
    def norm(self, x: cupy.ndarray, w: int, out: cupy.ndarray, T: int, add: bool = False) -> None:
        """out[:T] (+)= RMSNorm(x[:T]) * w."""
        c = self.ctx.c
        ops.rms_norm(self.ctx.k, x.data.ptr, x.shape[1], w, out.data.ptr, out.shape[1], T, x.shape[1], c.rms_eps, add)

    def norm_q8(self, x: cupy.ndarray, w: int, T: int, out32: cupy.ndarray | None, q: cupy.ndarray | None = None,
                d: cupy.ndarray | None = None, out16: cupy.ndarray | None = None) -> None:
        """RMSNorm(x[:T]) * w as any of fp32, 8-bit blocks (q, d) and fp16 (one launch)."""
        c = self.ctx.c
        ops.rms_norm_q8(self.ctx.k, x.data.ptr, x.shape[1], w, 0 if out32 is None else out32.data.ptr,
                        0 if out16 is None else out16.data.ptr, 0 if q is None else q.data.ptr,
                        0 if d is None else d.data.ptr, T, c.hidden, c.rms_eps)

    def dst(self, post_norm: int) -> tuple[cupy.ndarray, bool]:
        """Where an o / down projection writes, and whether it adds: straight into the residual,
        or (post_norm: gemma3) into ws.tmp for residual()."""
        ws = self.ctx.ws
        return (ws.tmp, False) if post_norm else (ws.x, True)

    def residual(self, post_norm: int, T: int) -> None:
        """x += RMSNorm(tmp) * post_norm, after dst() sent a projection to ws.tmp."""
        if post_norm:
            ws = self.ctx.ws
            self.norm(ws.tmp, post_norm, ws.x, T, add=True)

    # ------------------------------------------------------------ the four calls of a layer
    def attn_outputs(self, li: int) -> tuple[int, int, int]:
        """(8-bit values, 8-bit scales, fp16) pointers attention also writes its output to (0: no)."""
        return 0, 0, 0

    def qkv(self, li: int, lw: LayerIndex, T: int) -> None:
        raise NotImplementedError

    def out(self, li: int, lw: LayerIndex, T: int) -> None:
        raise NotImplementedError

    def ffn(self, li: int, lw: LayerIndex, T: int) -> None:
        raise NotImplementedError

    def down(self, li: int, lw: LayerIndex, T: int) -> None:
        raise NotImplementedError


class _LayerPlan:
    """Which GEMV family each projection of a layer takes (decided once, at load)."""

    def __init__(self, lw: LayerIndex, c: ModelConfig, norm16: bool, int8: bool, int8_down: bool):
        self.qkv = int8 and all(ops.blocks_ok(w) for w in (lw.wq, lw.wk, lw.wv)) and norm16
        self.wo = int8 and ops.blocks_ok(lw.wo) and c.q_dim % 32 == 0
        self.ffn = int8 and lw.fused_ffn and ops.blocks_ok(lw.w_gate) and norm16 and c.ffn_dim % 32 == 0
        self.down = self.ffn and ops.blocks_ok(lw.w_down) and int8_down
        # projections that stay on fp32 activations: the fast mmvf.cu kernels where the type has one
        self.f_qkv = all(ops.blocks_ok(w) for w in (lw.wq, lw.wk, lw.wv))
        self.f_wo = ops.blocks_ok(lw.wo)
        self.f_ffn = lw.fused_ffn and ops.blocks_ok(lw.w_gate)
        self.f_gu = not lw.fused_ffn and ops.blocks_ok(lw.w_gate) and ops.blocks_ok(lw.w_up)
        self.f_down = ops.blocks_ok(lw.w_down)


class GemvProjections(Projections):
    """GEMVs, several activation rows per launch: decode steps and prompts of a few tokens."""

    def __init__(self, ctx: StepContext, decode_activations: str):
        super().__init__(ctx)
        int8 = decode_activations != "fp32"
        self.plans = [_LayerPlan(lw, ctx.c, ctx.norm16, int8, decode_activations == "int8") for lw in ctx.w.layers]

    def gemv(self, w: WeightRef, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
              accumulate: bool = False) -> None:
        ops.gemv(self.ctx.k, w, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], T, bias, accumulate)

    def _proj(self, w: WeightRef, fast: bool, x: cupy.ndarray, T: int, y: cupy.ndarray, bias: int = 0,
              accumulate: bool = False) -> None:
        """y[:T] (+)= x[:T] @ w.T (+ bias) on fp32 activations: mmvf.cu when `fast` (block types),
        else gemv.cu (float types)."""
        if fast:
            ops.mmvf(self.ctx.k, [(w, bias, y.data.ptr, y.shape[1])], w.cols, x.data.ptr, x.shape[1], T, accumulate,
                     pdl=self.ctx.pdl)
        else:
            self.gemv(w, x, T, y, bias, accumulate)

    def normed(self, x: cupy.ndarray, w: int, T: int):
        """The input of an mmvf/ffnf launch that starts with RMSNorm(x[:T]) by weight w: x itself
        and the norm to fold into the launch, or (when the rows do not fit in shared memory) the
        norm written to ws.h by its own launch."""
        c = self.ctx.c
        if ops.mmvf_stage_ok(c.hidden, T):
            return x, (w, c.rms_eps)
        self.norm(x, w, self.ctx.ws.h, T)
        return self.ctx.ws.h, None

    def attn_outputs(self, li: int) -> tuple[int, int, int]:
        ws = self.ctx.ws
        return (ws.aq.data.ptr, ws.ad.data.ptr, 0) if self.plans[li].wo else (0, 0, 0)

    def qkv(self, li: int, lw: LayerIndex, T: int) -> None:
        k, ws, c, p = self.ctx.k, self.ctx.ws, self.ctx.c, self.plans[li]
        segs = [(lw.wq, lw.bq, ws.q.data.ptr, c.q_dim), (lw.wk, lw.bk, ws.k.data.ptr, c.kv_dim),
                (lw.wv, lw.bv, ws.v.data.ptr, c.kv_dim)]
        if p.qkv:
            self.norm_q8(ws.x, lw.attn_norm, T, ws.h, ws.hq, ws.hd)
            ops.mmv_q8(k, segs, c.hidden, ws.hq.data.ptr, ws.hd.data.ptr, T)
        elif p.f_qkv:
            x, norm = self.normed(ws.x, lw.attn_norm, T)
            ops.mmvf(k, segs, c.hidden, x.data.ptr, x.shape[1], T, norm=norm, pdl=self.ctx.pdl)
        else:
            self.norm(ws.x, lw.attn_norm, ws.h, T)
            self.gemv(lw.wq, ws.h, T, ws.q, lw.bq)
            self.gemv(lw.wk, ws.h, T, ws.k, lw.bk)
            self.gemv(lw.wv, ws.h, T, ws.v, lw.bv)

    def _into_residual(self, w: WeightRef, post_norm: int, int8: bool, fast: bool, x32: cupy.ndarray,
                       xq: cupy.ndarray, xd: cupy.ndarray, T: int) -> None:
        """x += w @ input (or its post-norm): from 8-bit blocks (xq, xd) when int8, else from x32."""
        dst, acc = self.dst(post_norm)
        if int8:
            ops.mmv_q8(self.ctx.k, [(w, 0, dst.data.ptr, self.ctx.c.hidden)], w.cols, xq.data.ptr, xd.data.ptr, T,
                       accumulate=acc)
        else:
            self._proj(w, fast, x32, T, dst, accumulate=acc)
        self.residual(post_norm, T)

    def out(self, li: int, lw: LayerIndex, T: int) -> None:
        ws, p = self.ctx.ws, self.plans[li]
        self._into_residual(lw.wo, lw.post_attn_norm, p.wo, p.f_wo, ws.attn, ws.aq, ws.ad, T)

    def ffn(self, li: int, lw: LayerIndex, T: int) -> None:
        k, ws, c, p, act = self.ctx.k, self.ctx.ws, self.ctx.c, self.plans[li], self.ctx.act
        if p.ffn:
            self.norm_q8(ws.x, lw.ffn_norm, T, None, ws.hq, ws.hd)
            ops.ffn_q8(k, lw.w_gate, lw.w_up, ws.hq.data.ptr, ws.hd.data.ptr, T, act, ws.fq.data.ptr,
                       ws.fd.data.ptr, 0 if p.down else ws.a.data.ptr)
        elif p.f_ffn:
            x, norm = self.normed(ws.x, lw.ffn_norm, T)
            ops.ffn_f(k, lw.w_gate, lw.w_up, x.data.ptr, x.shape[1], ws.a.data.ptr, c.ffn_dim, T, act, norm=norm,
                      pdl=self.ctx.pdl)
        else:
            self.norm(ws.x, lw.ffn_norm, ws.h, T)
            if lw.fused_ffn:
                ops.ffn_gate_up(k, lw.w_gate, lw.w_up, ws.h.data.ptr, c.hidden, ws.a.data.ptr, c.ffn_dim, T, act)
                return
            if p.f_gu:
                ops.mmvf(k, [(lw.w_gate, 0, ws.g.data.ptr, c.ffn_dim), (lw.w_up, 0, ws.u.data.ptr, c.ffn_dim)],
                         c.hidden, ws.h.data.ptr, ws.h.shape[1], T, pdl=self.ctx.pdl)
            else:
                self.gemv(lw.w_gate, ws.h, T, ws.g)
                self.gemv(lw.w_up, ws.h, T, ws.u)
            ops.act_mul(k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * c.ffn_dim, act)

    def down(self, li: int, lw: LayerIndex, T: int) -> None:
        ws, p = self.ctx.ws, self.plans[li]
        self._into_residual(lw.w_down, lw.post_ffn_norm, p.down, p.f_down, ws.a, ws.fq, ws.fd, T)


class MmqProjections(Projections):
    """Decode steps of many rows: each projection is a prep launch (the input rows as row-scaled fp16
    halves, RMSNorm folded in) and a tensor-core matrix multiply that reads every weight block once
    per 64 rows (mmq.py, kernels/mmq.cu), at fp32-class accuracy. A projection whose matrices have
    no such kernel (float types, K not whole blocks) runs on the GEMVs (`fallback`). Steps of
    min_rows or more rows come here: mmq_rows, or small_rows when every matrix of the model has a
    small-batch kernel (mmqs.cu, chosen per launch by mmq.py for up to 16 rows)."""

    def __init__(self, ctx: StepContext, max_rows: int, fallback: GemvProjections, mmq_rows: int = 8,
                 small_rows: int = 2):
        super().__init__(ctx)
        from .mmq import MmqPrep, MmqScratch, mmq_ok, small_ok
        c, w = ctx.c, ctx.w
        self.fallback = fallback
        self.prep_buf = MmqPrep(max_rows, max(c.hidden, c.q_dim, c.ffn_dim))
        shapes = [(c.hidden, (c.q_dim, c.kv_dim, c.kv_dim), False), (c.q_dim, (c.hidden,), False),
                  (c.hidden, (c.ffn_dim,), True), (c.ffn_dim, (c.hidden,), False), (c.hidden, (c.vocab_size,), False)]
        self.scratch = MmqScratch.for_shapes(max_rows, shapes, getattr(ctx.k, "sm_count", 132))
        # per layer: which projections run here (the rest on the GEMVs)
        self.on = []
        for lw in w.layers:
            ffn = lw.fused_ffn and mmq_ok(lw.w_gate) and mmq_ok(lw.w_up)
            # down reads ws.a, which the GEMVs' 8-bit FFN path may leave unwritten: both or neither
            self.on.append(dict(qkv=all(mmq_ok(m) for m in (lw.wq, lw.wk, lw.wv)), out=mmq_ok(lw.wo),
                                ffn=ffn, down=ffn and mmq_ok(lw.w_down)))
        self.head_ok = mmq_ok(w.output)
        self.all_on = all(on for d in self.on for on in d.values())
        mats = [m for lw in w.layers for m in (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)]
        self.small = self.all_on and self.head_ok and all(
            small_ok(m) for m in mats + [w.output])
        self.min_rows = small_rows if self.small else mmq_rows

    @property
    def nbytes(self) -> int:
        return self.prep_buf.nbytes + self.scratch.nbytes

    def _prep(self, x: cupy.ndarray, K: int, T: int, norm: int = 0) -> None:
        from .mmq import prep
        c = self.ctx.c
        prep(self.ctx.k, x.data.ptr, x.shape[1], T, K, self.prep_buf, norm=(norm, c.rms_eps) if norm else None,
             pdl=self.ctx.pdl)

    def _mmq(self, segs, K: int, T: int, accumulate: bool = False, amax: int = 0) -> None:
        from .mmq import mmq
        mmq(self.ctx.k, segs, K, self.prep_buf, T, self.scratch, accumulate=accumulate, amax=amax, pdl=self.ctx.pdl)

    def attn_outputs(self, li: int) -> tuple[int, int, int]:
        return (0, 0, 0) if self.on[li]["out"] else self.fallback.attn_outputs(li)

    def qkv(self, li: int, lw: LayerIndex, T: int) -> None:
        if not self.on[li]["qkv"]:
            return self.fallback.qkv(li, lw, T)
        ws, c = self.ctx.ws, self.ctx.c
        self._prep(ws.x, c.hidden, T, lw.attn_norm)
        self._mmq([(lw.wq, lw.bq, ws.q.data.ptr, ws.q.shape[1]), (lw.wk, lw.bk, ws.k.data.ptr, ws.k.shape[1]),
                   (lw.wv, lw.bv, ws.v.data.ptr, ws.v.shape[1])], c.hidden, T)

    def out(self, li: int, lw: LayerIndex, T: int) -> None:
        if not self.on[li]["out"]:
            return self.fallback.out(li, lw, T)
        ws = self.ctx.ws
        self._prep(ws.attn, lw.wo.cols, T)
        dst, acc = self.dst(lw.post_attn_norm)
        self._mmq([(lw.wo, 0, dst.data.ptr, dst.shape[1])], lw.wo.cols, T, accumulate=acc)
        self.residual(lw.post_attn_norm, T)

    def ffn(self, li: int, lw: LayerIndex, T: int) -> None:
        if not self.on[li]["ffn"]:
            return self.fallback.ffn(li, lw, T)
        from .mmq import mmq_ffn
        ws, c = self.ctx.ws, self.ctx.c
        self._prep(ws.x, c.hidden, T, lw.ffn_norm)
        mmq_ffn(self.ctx.k, lw.w_gate, lw.w_up, self.prep_buf, T, self.ctx.act, ws.a.data.ptr, ws.a.shape[1],
                self.scratch, pdl=self.ctx.pdl)

    def down(self, li: int, lw: LayerIndex, T: int) -> None:
        if not self.on[li]["down"]:
            return self.fallback.down(li, lw, T)
        ws = self.ctx.ws
        self._prep(ws.a, lw.w_down.cols, T)
        dst, acc = self.dst(lw.post_ffn_norm)
        self._mmq([(lw.w_down, 0, dst.data.ptr, dst.shape[1])], lw.w_down.cols, T, accumulate=acc)
        self.residual(lw.post_ffn_norm, T)

    def head(self, rows: cupy.ndarray, n: int, norm: int, logits: cupy.ndarray, amax: int) -> None:
        """RMSNorm(rows[:n]) * norm -> LM head -> logits, with the packed argmax of each row into amax."""
        w = self.ctx.w.output
        self._prep(rows, self.ctx.c.hidden, n, norm)
        self._mmq([(w, 0, logits.data.ptr, logits.shape[1])], self.ctx.c.hidden, n, amax=amax)
