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
        ws, p = self.ctx.ws, self.plans[li]
        self._into_residual(lw.w_down, lw.post_ffn_norm, p.down, p.f_down, ws.a, ws.fq, ws.fd, T)
