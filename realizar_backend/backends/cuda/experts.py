"""A mixture of experts' routed experts on the GPU (model/ops.py norm_moe_residual), one class per
kernel family of the dispatcher's `experts` rule (dispatch.py): PairExperts (moe.cu's per-pair
GEMVs) and GroupedExperts (the pairs bucketed per expert, mmq.cu's tensor-core tiles per expert).

Each step: h = RMSNorm(x) into ws.h; the router's logits (its GEMV, the dispatcher's choice) into
ws.moe_logits; moe_topk writes each row's experts and weights (ws.moe_ids, ws.moe_w); the experts'
gated MLPs over the (row, expert) pairs into ws.moe_a, their down projections into ws.moe_y; and
moe_combine adds each row's weighted sum into x (kernels/moe.cu; on mmv8.cu's one-row pairs the down
projection adds it in its own launch, ws.moe_y unused); a shared expert (qwen35moe) adds its gated
MLP of h (moe_shared_add) on the step's dense families. The expert ids never leave the device and
every buffer is the workspace's (sized at the high-water mark), so the launches of a step are fixed
by its row count and a CUDA graph captures them like a dense layer's."""

from __future__ import annotations

from typing import Callable

import cupy

from . import mmq as mmq_ops
from . import ops
from .dispatch import MOE_GROUPED_BN, Choice, ExpertsChoice, Kernel, moe8_combine_ok, moe_grouped_plan
from .linear import ACT, Context, Family, GemvLinear
from .mmq import MmqPrep
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


def expert_pairs8(k, gate: WeightRef, up: WeightRef, down: WeightRef, ids: int, top: int, T: int, h: int, hs: int,
                  a: int, y: int, ys: int, act: int, biases: tuple[int, int, int] = (0, 0, 0),
                  combine: tuple[int, int, int] | None = None, pdl: bool = False) -> None:
    """What expert_pairs computes (gate and up of one type and shape), on mmv8.cu's GEMVs (dispatch.py
    MOE_PAIRS8: 8-bit activations, as the dense one-row steps'): gate and up of each pair from its
    token's row, then the down projection from the pair's own row of a. combine = (x, xs, w): then
    x[t] += sum_j w[t, j] * y[t * top + j] over down.rows columns (moe_combine; x row stride xs, w float
    [T, top]): in the down projection's own launch where dispatch.moe8_combine_ok (y is not written),
    else moe_combine after it. pdl: as programmatic dependent launches (every kernel here waits for
    the one before in pdl_wait)."""
    pairs, F = T * top, gate.rows
    bg, bu, bd = biases
    ops.moe8(k, gate, up, ids, pairs, h, hs, top, a, F, act, bg, bu, pdl=pdl)
    if combine is not None and moe8_combine_ok(down, top, ops.device_smem(k)):
        x, xs, w = combine
        ops.moe8_down_combine(k, down, ids, top, T, a, F, x, xs, w, bd, pdl=pdl)
        return
    ops.moe8(k, down, None, ids, pairs, a, F, 1, y, ys, bg=bd, pdl=pdl)
    if combine is not None:
        x, xs, w = combine
        ops.moe_combine(k, x, xs, y, ys, w, top, T, down.rows)


class PairExperts(Family):
    """moe.cu's per-pair GEMVs (dispatch.py MOE_PAIRS): every pair reads its expert's rows through
    its id (expert_pairs); at one-row steps of mmv8.cu's types its 8-bit GEMVs (MOE_PAIRS8,
    expert_pairs8)."""

    def __init__(self, ctx: Context, gemv: GemvLinear, family: Callable[[Kernel], Family]):
        """family: the dense family of a kernel (forward.py Forward.family), for the shared expert."""
        super().__init__(ctx)
        self.gemv = gemv
        self.family = family

    def moe(self, x: cupy.ndarray, norm: int, e, choice: ExpertsChoice, T: int) -> cupy.ndarray:
        """x[:T] += the routed experts of RMSNorm(x[:T]) * norm (e: model/transformer.py Experts)."""
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        h, logits, a, y = ws.h, ws.moe_logits, ws.moe_a, ws.moe_y
        self.norm(x, norm, h, T)
        self.gemv._one(choice.router, e.router, h, T, logits.data.ptr, logits.shape[1], bias=e.router_bias or 0)
        ids, w = ws.moe_ids.data.ptr, ws.moe_w.data.ptr
        ops.moe_topk(k, logits.data.ptr, logits.shape[1], T, e.router.rows, e.top_k, e.renormalize, ids, w,
                     pdl=self.ctx.pdl)
        if choice.experts is Kernel.MOE_PAIRS8:
            # the combine into x in the down projection's launch where it can (expert_pairs8)
            expert_pairs8(k, e.gate, e.up, e.down, ids, e.top_k, T, h.data.ptr, h.shape[1], a.data.ptr,
                          y.data.ptr, y.shape[1], MOE_ACT[e.act], self.biases(e), (x.data.ptr, x.shape[1], w),
                          pdl=self.ctx.pdl)
        else:
            self.experts(e, ids, T, h, a, y, choice)
            ops.moe_combine(k, x.data.ptr, x.shape[1], y.data.ptr, y.shape[1], w, e.top_k, T, c.hidden)
        if e.shared_gate is not None:
            self.shared(x, h, e, choice, T)
        return x

    @staticmethod
    def biases(e) -> tuple[int, int, int]:
        """The experts' gate, up and down bias pointers (0: none)."""
        return e.gate_bias or 0, e.up_bias or 0, e.down_bias or 0

    def experts(self, e, ids: int, T: int, h: cupy.ndarray, a: cupy.ndarray, y: cupy.ndarray,
                choice: ExpertsChoice) -> None:
        """y[p] = the expert ids[p]'s MLP of row h[p // top_k], for the T rows' pairs (expert_pairs;
        MOE_PAIRS8 is moe()'s own: expert_pairs8, the combine with it)."""
        expert_pairs(self.ctx.k, e.gate, e.up, e.down, ids, e.top_k, T, h.data.ptr, h.shape[1], a.data.ptr,
                     y.data.ptr, y.shape[1], MOE_ACT[e.act], choice.fused, self.biases(e))

    def shared(self, x: cupy.ndarray, h: cupy.ndarray, e, choice: ExpertsChoice, T: int) -> None:
        """x[:T] += sigmoid(h @ shared_router.T) * down(act(h @ gate.T) * (h @ up.T)), the shared
        expert of the normed rows h, on the kernels of choice.shared (dispatch.py: the step's dense
        families, its gate and up as one group of two outputs; its gate logit a GEMV); its output
        through ws.tmp. It runs after the routed experts' combine: the split16 scratch shares
        ffn_pool with their rows, and h is still the normed input."""
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        kg, ku, kd, kr = choice.shared
        Fs = e.shared_gate.rows
        segs = [(e.shared_gate, 0, ws.sh_g.data.ptr, Fs), (e.shared_up, 0, ws.sh_u.data.ptr, Fs)]
        self.family(kg).linear(h, segs, Choice((kg, ku)), T)
        ops.act_mul(k, ws.sh_g.data.ptr, ws.sh_u.data.ptr, ws.sh_a.data.ptr, T * Fs, ACT[e.act])
        self.family(kd).linear(ws.sh_a, [(e.shared_down, 0, ws.tmp.data.ptr, ws.tmp.shape[1])], Choice((kd,)), T)
        self.gemv._one(kr, e.shared_router, h, T, ws.sh_s.data.ptr, 1)
        ops.moe_shared_add(k, x.data.ptr, x.shape[1], ws.tmp.data.ptr, ws.tmp.shape[1], ws.sh_s.data.ptr, T, c.hidden)


class GroupedBuffers:
    """The grouped path's device buffers for steps of up to `rows` rows of top_k of E experts (gate
    and up [E, F, H], down [E, H, F]): per-expert counts, the slot list and the token-tile table
    (ops.moe_bucket), the slots' gated rows, and the prep records of the step's rows and of the
    slots, of each kind the launches ask for (records(a8): fp16 or 8-bit; a model whose layers mix
    both kinds holds both, made on a layer's first step). Sized once for the largest plan of up to
    `rows` rows (dispatch.moe_grouped_plan) under each token-tile limit of bn_max: the device's for
    each kind of records its launches may read (mmq.bn_limits(k, (False, True)))."""

    def __init__(self, rows: int, top_k: int, E: int, H: int, F: int, bn_max: tuple[int, ...] = (MOE_GROUPED_BN[-1],)):
        plans = [moe_grouped_plan(r, top_k, E, bn) for r in range(1, rows + 1) for bn in set(bn_max)]
        slots, tiles = max(bn * tb for bn, tb in plans), max(tb for _, tb in plans)
        self.rows, self.top_k, self.E, self.H, self.F = rows, top_k, E, H, F
        self.cnt = cupy.empty(E, cupy.int32)
        self.lst = cupy.empty(slots, cupy.int32)
        self.tiles = cupy.empty((tiles, 3), cupy.int32)
        self.a = cupy.empty((slots, F), cupy.float32)
        self._records: dict[bool, tuple[MmqPrep, MmqPrep]] = {}

    def records(self, a8: bool) -> tuple[MmqPrep, MmqPrep]:
        """The prep buffers (the step's rows, the slots' rows) of fp16 or 8-bit (a8) records."""
        if a8 not in self._records:
            self._records[a8] = (MmqPrep(self.rows, self.H, a8), MmqPrep(self.lst.size, self.F, a8))
        return self._records[a8]

    def fits(self, rows: int, top_k: int, E: int, H: int, F: int) -> bool:
        return rows <= self.rows and (top_k, E, H, F) == (self.top_k, self.E, self.H, self.F)


def expert_groups(k, gate: WeightRef, up: WeightRef, down: WeightRef, ids: int, top: int, T: int, h: int, hs: int,
                  y: int, ys: int, act: int, buf: GroupedBuffers, biases: tuple[int, int, int] = (0, 0, 0),
                  a8: bool = False) -> None:
    """What expert_pairs computes (y[p] = down_e(act(gate_e h[t], up_e h[t])) for p = t * top + j,
    e = ids[p]; y row stride ys), on the grouped path: the pairs bucketed per expert (ops.moe_bucket),
    the step's rows prepped once, each expert's gate and up (one fused launch: same type and shape)
    over its pairs' rows into the slots' rows buf.a, those prepped, and each expert's down
    projection into the pairs' rows of y (mmq.mmq_moe); a8: on 8-bit records (dispatch.moe_grouped_a8).
    Every launch's size is fixed by T."""
    E, F, H = gate.experts, gate.rows, gate.cols
    bn, TB = moe_grouped_plan(T, top, E, ops.device_smem(k).mmq_bn_max(a8))
    if bn * TB > buf.lst.size or TB > buf.tiles.shape[0]:
        raise ValueError(f"expert_groups: the buffers hold {buf.lst.size} slots and {buf.tiles.shape[0]} token tiles; "
                         f"{T} rows take {bn * TB} and {TB} (size GroupedBuffers with the device's bn_max)")
    bg, bu, bd = biases
    ops.moe_bucket(k, ids, T * top, E, bn, buf.cnt.data.ptr, buf.lst.data.ptr, buf.tiles.data.ptr, TB)
    tiles, lst = buf.tiles.data.ptr, buf.lst.data.ptr
    ph, pa = buf.records(a8)
    mmq_ops.prep(k, h, hs, T, H, ph)
    mmq_ops.mmq_moe(k, gate, up, bn, TB, tiles, lst, top, ph, buf.a.data.ptr, F, 1, act, bg, bu)
    # every slot a tile covers (padding too: rows never read) into prep records
    mmq_ops.prep(k, buf.a.data.ptr, F, TB * bn, F, pa)
    mmq_ops.mmq_moe(k, down, None, bn, TB, tiles, lst, top, pa, y, ys, 0, 0, bd)


class GroupedExperts(PairExperts):
    """The grouped path (dispatch.py MOE_GROUPED): the router, top-k, combine and shared expert as
    PairExperts, the experts on expert_groups. Its buffers follow the workspace's capacity (they are
    made again when the workspace grows, as its own pools are, never inside a captured step)."""

    def __init__(self, ctx: Context, gemv: GemvLinear, family: Callable[[Kernel], Family]):
        super().__init__(ctx, gemv, family)
        self.buf: GroupedBuffers | None = None

    def experts(self, e, ids: int, T: int, h: cupy.ndarray, a: cupy.ndarray, y: cupy.ndarray,
                choice: ExpertsChoice) -> None:
        shape = (max(T, self.ctx.ws.capacity), e.top_k, e.gate.experts, e.gate.cols, e.gate.rows)
        if self.buf is None or not self.buf.fits(*shape):
            self.buf = GroupedBuffers(*shape, bn_max=mmq_ops.bn_limits(self.ctx.k, (False, True)))
        expert_groups(self.ctx.k, e.gate, e.up, e.down, ids, e.top_k, T, h.data.ptr, h.shape[1], y.data.ptr,
                      y.shape[1], MOE_ACT[e.act], self.buf, self.biases(e), choice.a8)
