"""A mixture of experts' routed experts on the GPU (model/ops.py norm_moe_residual), one class per
kernel family of the dispatcher's `experts` rule (dispatch.py).

Each step: h = RMSNorm(x) into ws.h; the router's logits (its GEMV, the dispatcher's choice) into
ws.moe_logits; moe_topk writes each row's experts and weights (ws.moe_ids, ws.moe_w); the experts'
gated MLPs over the (row, expert) pairs into ws.moe_a, their down projections into ws.moe_y; and
moe_combine adds each row's weighted sum into x (kernels/moe.cu); a shared expert (qwen35moe) adds
its gated MLP of h on the GEMVs (moe_shared_add). The expert ids never leave the
device and every buffer is the workspace's (sized at the high-water mark), so the launches of a step
are fixed by its row count and a CUDA graph captures them like a dense layer's."""

from __future__ import annotations

import cupy

from . import ops
from .dispatch import ExpertsChoice
from .linear import ACT, Context, Family, GemvLinear
from .ops import WeightRef

# the experts' activation codes: the dense ones, and gpt-oss's clamped SwiGLU of gate and up, which
# only the experts' kernels take (moe.cu and act_mul through common.cuh gated_f)
MOE_ACT = {**ACT, "swiglu_oai": 2}


def expert_pairs(k, gate: WeightRef, up: WeightRef, down: WeightRef, ids: int, top: int, T: int, h: int, hs: int,
                 a: int, y: int, ys: int, act: int, fused: bool, biases: tuple[int, int, int] = (0, 0, 0)) -> None:
    """The experts of T rows' (row, expert) pairs, p = t * top + j with expert ids[p] (int32 [T, top]):
    a[p] = act(gate_e @ h[t] + bg_e, up_e @ h[t] + bu_e) (a: [T * top, gate.rows] floats, rows back to
    back), then y[p] = down_e @ a[p] + bd_e (row stride ys >= 2 * gate.rows); biases (bg, bu, bd):
    float [experts, rows] device pointers, 0: none. fused (gate and up of one type and shape): gate
    and up in one launch; otherwise each its own, into the rows of y (free until the down projection
    writes it), and act_mul joins them."""
    pairs, F = T * top, gate.rows
    bg, bu, bd = biases
    if fused:
        ops.moe_gate_up(k, gate, up, ids, top, pairs, h, hs, a, F, act, bg, bu)
    else:
        g, u = y, y + 4 * pairs * F          # [pairs, F] each, back to back in y's pairs * ys floats
        ops.moe_gemv(k, gate, ids, pairs, h, hs, top, g, F, bg)
        ops.moe_gemv(k, up, ids, pairs, h, hs, top, u, F, bu)
        ops.act_mul(k, g, u, a, pairs * F, act)
    ops.moe_gemv(k, down, ids, pairs, a, F, 1, y, ys, bd)


class PairExperts(Family):
    """moe.cu's per-pair GEMVs (dispatch.py MOE_PAIRS): every pair reads its expert's rows through
    its id (expert_pairs)."""

    def __init__(self, ctx: Context, gemv: GemvLinear):
        super().__init__(ctx)
        self.gemv = gemv

    def moe(self, x: cupy.ndarray, norm: int, e, choice: ExpertsChoice, T: int) -> cupy.ndarray:
        """x[:T] += the routed experts of RMSNorm(x[:T]) * norm (e: model/transformer.py Experts)."""
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        h, logits, a, y = ws.h, ws.moe_logits, ws.moe_a, ws.moe_y
        self.norm(x, norm, h, T)
        self.gemv._one(choice.router, e.router, h, T, logits.data.ptr, logits.shape[1], bias=e.router_bias or 0)
        ids, w = ws.moe_ids.data.ptr, ws.moe_w.data.ptr
        ops.moe_topk(k, logits.data.ptr, logits.shape[1], T, e.router.rows, e.top_k, e.renormalize, ids, w)
        expert_pairs(k, e.gate, e.up, e.down, ids, e.top_k, T, h.data.ptr, h.shape[1], a.data.ptr, y.data.ptr,
                     y.shape[1], MOE_ACT[e.act], choice.fused, (e.gate_bias or 0, e.up_bias or 0, e.down_bias or 0))
        ops.moe_combine(k, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], w, e.top_k, T, c.hidden)
        if e.shared_gate is not None:
            self.shared(x, h, e, choice, T)
        return x

    def shared(self, x: cupy.ndarray, h: cupy.ndarray, e, choice: ExpertsChoice, T: int) -> None:
        """x[:T] += sigmoid(h @ shared_router.T) * down(act(h @ gate.T) * (h @ up.T)), the shared
        expert of the normed rows h, on the GEMVs (dispatch.py); its output through ws.tmp."""
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        kg, ku, kd, kr = choice.shared
        Fs = e.shared_gate.rows
        self.gemv._one(kg, e.shared_gate, h, T, ws.sh_g.data.ptr, Fs)
        self.gemv._one(ku, e.shared_up, h, T, ws.sh_u.data.ptr, Fs)
        ops.act_mul(k, ws.sh_g.data.ptr, ws.sh_u.data.ptr, ws.sh_a.data.ptr, T * Fs, ACT[e.act])
        self.gemv._one(kd, e.shared_down, ws.sh_a, T, ws.tmp.data.ptr, ws.tmp.shape[1])
        self.gemv._one(kr, e.shared_router, h, T, ws.sh_s.data.ptr, 1)
        ops.moe_shared_add(k, x.data.ptr, x.shape[1], ws.tmp.data.ptr, ws.tmp.shape[1], ws.sh_s.data.ptr, T, c.hidden)
