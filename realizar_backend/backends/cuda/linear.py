"""The model's projections on the GPU, one class per kernel family of the dispatcher (dispatch.py):
GEMVs (mmvf.cu, gemv.cu), tensor-core matrix multiplies on the quantized blocks (mmq.py) and the
split16 GEMMs (split16.py). Each implements the operations of model/ops.py that multiply: a group
of projections of one normed input (norm_linear), a projection into the residual stream
(linear_residual, through gemma3's post-norm where the layer has one) and the gated MLP
(gated: act(gate) * up), plus the LM head; the dispatcher's Choice says which kernel each matrix
takes. Everything reads and writes the workspace (workspace.py) and allocates nothing per step,
so a step can be captured in a CUDA graph; `Context.pdl` says whether the launches are being
captured as programmatic dependent launches."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import cupy

from ...errors import BackendError
from ...model.config import ModelConfig
from . import ops, split16
from .dispatch import SPLIT16_KEEP_FREE_SHARE, Choice, Dispatcher, Kernel
from .mmq import MmqPrep, MmqScratch, bn_limits, mmq, mmq_ffn, prep
from .modules import Kernels
from .ops import WeightRef
from .workspace import Workspace

log = logging.getLogger(__name__)

ACT = {"silu": 0, "gelu_tanh": 1}     # the kernels' activation codes


@dataclass
class Context:
    """What every projection of a step needs: kernels, workspace, the model's numbers."""
    k: Kernels
    ws: Workspace
    c: ModelConfig
    pdl: bool = False        # launches are captured as programmatic dependent launches (pdl.py)


@dataclass(frozen=True)
class SplitRows:
    """The gated MLP's output as split16 activation rows (ws.x16, 1/s in `inv`), the input the down
    projection of the same split16 step reads directly."""
    inv: int


Segment = tuple[WeightRef, int, int, int]     # (matrix, bias pointer or 0, output pointer, output row stride)
# outputs one launch writes (mmvf.cu, mmq.cu, mmqs.cu, prefill.cu's unscale_scatter): a group of more
# projections of one input (a DeltaNet's four) takes several
MAX_SEGMENTS = 3


def launches(segs: Sequence) -> list:
    """segs in pieces of up to MAX_SEGMENTS, one a launch."""
    return [list(segs[i:i + MAX_SEGMENTS]) for i in range(0, len(segs), MAX_SEGMENTS)]


class Family:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def norm(self, x: cupy.ndarray, w: int, out: cupy.ndarray, T: int, add: bool = False) -> None:
        """out[:T] (+)= RMSNorm(x[:T]) * w."""
        ops.rms_norm(self.ctx.k, x.data.ptr, x.shape[1], w, out.data.ptr, out.shape[1], T, x.shape[1],
                     self.ctx.c.rms_eps, add, pdl=self.ctx.pdl)

    def dst(self, post_norm: int) -> tuple[cupy.ndarray, bool]:
        """Where a projection into the residual writes, and whether it adds: straight into it, or
        (post_norm: gemma3) into ws.tmp for residual()."""
        ws = self.ctx.ws
        return (ws.tmp, False) if post_norm else (ws.x, True)

    def residual(self, post_norm: int, T: int) -> None:
        """x += RMSNorm(tmp) * post_norm, after dst() sent a projection to ws.tmp."""
        if post_norm:
            ws = self.ctx.ws
            self.norm(ws.tmp, post_norm, ws.x, T, add=True)


class GemvLinear(Family):
    """GEMVs, several activation rows per launch: decode steps and prompts of a few tokens."""

    def _one(self, kern: Kernel, w: WeightRef, x: cupy.ndarray, T: int, y: int, ys: int, bias: int = 0,
             accumulate: bool = False) -> None:
        """y[:T] (+)= x[:T] @ w.T (+ bias) from fp32 rows."""
        if kern in (Kernel.MMVF, Kernel.MMV8):
            ops.mmvf(self.ctx.k, [(w, bias, y, ys)], w.cols, x.data.ptr, x.shape[1], T, accumulate, pdl=self.ctx.pdl,
                     q8=kern is Kernel.MMV8)
        else:
            ops.gemv(self.ctx.k, w, x.data.ptr, x.shape[1], y, ys, T, bias, accumulate, pdl=self.ctx.pdl)

    def normed(self, x: cupy.ndarray, w: int, T: int, kern: Kernel = Kernel.MMVF):
        """The input of an mmvf/ffnf launch that starts with RMSNorm(x[:T]) by weight w: x itself
        and the norm to fold into the launch, or (when the rows do not fit in shared memory) the
        norm written to ws.h by its own launch. MMV8 launches always fold it (dispatch.mmv8_ok)."""
        c = self.ctx.c
        if kern is Kernel.MMV8 or ops.mmvf_stage_ok(x.shape[1], T, ops.device_smem(self.ctx.k).mmvf_rows):
            return x, (w, c.rms_eps)
        self.norm(x, w, self.ctx.ws.h, T)
        return self.ctx.ws.h, None

    def norm_linear(self, x: cupy.ndarray, norm: int, segs: Sequence[Segment], choice: Choice, T: int) -> None:
        if choice.kernel in (Kernel.MMVF, Kernel.MMV8):
            xin, nrm = self.normed(x, norm, T, choice.kernel)
            for part in launches(segs):
                ops.mmvf(self.ctx.k, part, segs[0][0].cols, xin.data.ptr, xin.shape[1], T, norm=nrm, pdl=self.ctx.pdl,
                         q8=choice.kernel is Kernel.MMV8)
            return
        h = self.ctx.ws.h
        self.norm(x, norm, h, T)
        self.linear(h, segs, choice, T)

    def linear(self, x: cupy.ndarray, segs: Sequence[Segment], choice: Choice, T: int) -> None:
        """The segments' projections of the rows x[:T] as they are (no norm)."""
        if choice.kernel in (Kernel.MMVF, Kernel.MMV8):
            for part in launches(segs):
                ops.mmvf(self.ctx.k, part, segs[0][0].cols, x.data.ptr, x.shape[1], T, pdl=self.ctx.pdl,
                         q8=choice.kernel is Kernel.MMV8)
            return
        for (w, bias, y, ys), kern in zip(segs, choice.kernels):
            self._one(kern, w, x, T, y, ys, bias)

    def linear_residual(self, a: cupy.ndarray, w: WeightRef, post_norm: int, kern: Kernel, T: int) -> None:
        dst, acc = self.dst(post_norm)
        self._one(kern, w, a, T, dst.data.ptr, dst.shape[1], accumulate=acc)
        self.residual(post_norm, T)

    def gated(self, x: cupy.ndarray, norm: int, gate: WeightRef, up: WeightRef, choice: Choice, act: int,
              T: int) -> cupy.ndarray:
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        F = gate.rows
        if choice.fused and choice.kernel in (Kernel.MMVF, Kernel.MMV8):
            xin, nrm = self.normed(x, norm, T, choice.kernel)
            ops.ffn_f(k, gate, up, xin.data.ptr, xin.shape[1], ws.a.data.ptr, ws.a.shape[1], T, act, norm=nrm,
                      pdl=self.ctx.pdl, q8=choice.kernel is Kernel.MMV8)
            return ws.a
        self.norm(x, norm, ws.h, T)
        if choice.fused and choice.kernel is Kernel.GEMV:
            ops.ffn_gate_up(k, gate, up, ws.h.data.ptr, c.hidden, ws.a.data.ptr, ws.a.shape[1], T, act)
            return ws.a
        if choice.kernel in (Kernel.MMVF, Kernel.MMV8):
            ops.mmvf(k, [(gate, 0, ws.g.data.ptr, F), (up, 0, ws.u.data.ptr, F)], c.hidden, ws.h.data.ptr,
                     ws.h.shape[1], T, pdl=self.ctx.pdl, q8=choice.kernel is Kernel.MMV8)
        else:
            self._one(choice.kernels[0], gate, ws.h, T, ws.g.data.ptr, F)
            self._one(choice.kernels[1], up, ws.h, T, ws.u.data.ptr, F)
        ops.act_mul(k, ws.g.data.ptr, ws.u.data.ptr, ws.a.data.ptr, T * F, act)
        return ws.a

    def head(self, rows: cupy.ndarray, n: int, norm: int, w: WeightRef, kern: Kernel, amax: int, feed) -> None:
        """RMSNorm(rows[:n]) * norm -> LM head -> ws.logits, and each row's argmax into ws.argmax
        (and the decode inputs, `feed`: argmax_unpack's io and ring arguments)."""
        k, ws, c = self.ctx.k, self.ctx.ws, self.ctx.c
        if kern in (Kernel.MMVF, Kernel.MMV8):
            # norm, LM head and argmax in one launch (+ the tiny unpack)
            x, nrm = self.normed(rows, norm, n, kern)
            ops.mmvf(k, [(w, 0, ws.logits.data.ptr, c.vocab_size)], c.hidden, x.data.ptr, x.shape[1], n, norm=nrm,
                     amax=amax, pdl=self.ctx.pdl, head=True, q8=kern is Kernel.MMV8)
            ops.argmax_unpack(k, amax, ws.argmax.data.ptr, n, *feed, pdl=self.ctx.pdl)
            return
        self.norm(rows, norm, ws.last_norm, n)
        self._one(kern, w, ws.last_norm, n, ws.logits.data.ptr, ws.logits.shape[1])
        ops.argmax_rows(k, ws.logits.data.ptr, c.vocab_size, c.vocab_size, ws.argmax.data.ptr, n, *feed)


class MmqLinear(Family):
    """Tensor-core matrix multiplies on the quantized blocks: each projection is a prep launch (the
    input rows as row-scaled fp16 halves, RMSNorm folded in) and an mmq launch (mmq.py) at
    fp32-class accuracy. Buffers sized once for max_rows rows and every matrix shape."""

    def __init__(self, ctx: Context, max_rows: int, shapes: Sequence[tuple[int, tuple[int, ...], bool]]):
        super().__init__(ctx)
        self.prep_buf = MmqPrep(max_rows, max(K for K, _, _ in shapes))
        # sized under the token-tile limit its launches plan with (fp16 records, the device's)
        self.scratch = MmqScratch.for_shapes(max_rows, shapes, getattr(ctx.k, "sm_count", 132), bn_limits(ctx.k))

    @property
    def nbytes(self) -> int:
        return self.prep_buf.nbytes + self.scratch.nbytes

    def _prep(self, x: cupy.ndarray, K: int, T: int, norm: int = 0) -> None:
        prep(self.ctx.k, x.data.ptr, x.shape[1], T, K, self.prep_buf,
             norm=(norm, self.ctx.c.rms_eps) if norm else None, pdl=self.ctx.pdl)

    def _mmq(self, segs, K: int, T: int, small: bool, accumulate: bool = False, amax: int = 0) -> None:
        mmq(self.ctx.k, segs, K, self.prep_buf, T, self.scratch, accumulate=accumulate, amax=amax,
            pdl=self.ctx.pdl, small=small)

    def norm_linear(self, x: cupy.ndarray, norm: int, segs: Sequence[Segment], choice: Choice, T: int) -> None:
        K = segs[0][0].cols
        self._prep(x, K, T, norm)
        for part in launches(segs):
            self._mmq(part, K, T, choice.kernel is Kernel.MMQS)

    def linear(self, x: cupy.ndarray, segs: Sequence[Segment], choice: Choice, T: int) -> None:
        """The segments' projections of the rows x[:T] as they are (no norm)."""
        self.norm_linear(x, 0, segs, choice, T)

    def linear_residual(self, a: cupy.ndarray, w: WeightRef, post_norm: int, kern: Kernel, T: int) -> None:
        self._prep(a, w.cols, T)
        dst, acc = self.dst(post_norm)
        self._mmq([(w, 0, dst.data.ptr, dst.shape[1])], w.cols, T, kern is Kernel.MMQS, accumulate=acc)
        self.residual(post_norm, T)

    def gated(self, x: cupy.ndarray, norm: int, gate: WeightRef, up: WeightRef, choice: Choice, act: int,
              T: int) -> cupy.ndarray:
        ws = self.ctx.ws
        self._prep(x, gate.cols, T, norm)
        mmq_ffn(self.ctx.k, gate, up, self.prep_buf, T, act, ws.a.data.ptr, ws.a.shape[1], self.scratch,
                pdl=self.ctx.pdl, small=choice.kernel is Kernel.MMQS)
        return ws.a

    def head(self, rows: cupy.ndarray, n: int, norm: int, w: WeightRef, kern: Kernel, amax: int, feed) -> None:
        ws = self.ctx.ws
        self._prep(rows, w.cols, n, norm)
        self._mmq([(w, 0, ws.logits.data.ptr, ws.logits.shape[1])], w.cols, n, kern is Kernel.MMQS, amax=amax)
        ops.argmax_unpack(self.ctx.k, amax, ws.argmax.data.ptr, n, *feed, pdl=self.ctx.pdl)


class Split16Linear(Family):
    """The split16 GEMMs (split16.py) on weights dequantized at start-up (kept, `weight_cache`) or
    before each GEMM into ws.deq, as split halves or fp16 rows (`precision`, split16.PRECISIONS);
    each group of matrices sharing an input is one matrix."""

    def __init__(self, ctx: Context, groups: Sequence[tuple[WeightRef, ...]], weight_cache: str,
                 precision: str = "fp16"):
        super().__init__(ctx)
        if precision not in split16.PRECISIONS:
            raise BackendError(f"gemm precision {precision!r}: one of {', '.join(split16.PRECISIONS)}")
        self.precision = precision
        self.lo = precision == "split"     # the weights' low halves are made and multiplied
        c, ws = ctx.c, ctx.ws
        # the workspace's split16 scratch (y32, x16) is sized from the config's widths (a DeltaNet's
        # output projection reads its value heads: v_heads * v_dim)
        widths = ({c.hidden, c.q_dim, c.ffn_dim} | ({c.ssm_v_heads * c.ssm_v_dim} if c.has_recurrent_state else set())
                  | ({c.shared_expert_ffn_dim} if c.shared_expert_ffn_dim else set()))
        for g in groups:
            if g[0].cols not in widths or sum(w.rows for w in g) > ws.y32.shape[1]:
                raise BackendError(f"split16: matrices {', '.join(w.name for w in g)} do not have the shapes of "
                                   f"the model's configuration")
        self.kx = split16.load_kernels(cupy.cuda.Device().id, getattr(ctx.k, "qtypes", None))
        self._calls = {K: split16.split_calls(K) for K in widths}
        # group (its first matrix's address) -> its split weight rows, kept from start-up
        self.kept: dict[int, cupy.ndarray] = {}
        sizes = [sum(w.rows for w in g) * g[0].cols for g in groups]
        total = split16.weight_bytes(precision) * sum(sizes)
        free = cupy.cuda.runtime.memGetInfo()[0]
        if weight_cache == "on" or (weight_cache == "auto" and total <= free * SPLIT16_KEEP_FREE_SHARE):
            try:
                for g in groups:
                    buf = cupy.empty(sum(w.rows for w in g) * g[0].cols, cupy.float32 if self.lo else cupy.float16)
                    split16.split_weights(self.kx, g, buf.data.ptr, self.lo)
                    self.kept[g[0].ptr] = buf
                cupy.cuda.get_current_stream().synchronize()    # steps run on the backend's own stream
                log.info("split16: %s weights kept on the device (%.2f GB)", precision, total / 1e9)
                return
            except cupy.cuda.memory.OutOfMemoryError:
                if weight_cache == "on":
                    raise
                self.kept.clear()
                log.warning("split16: no room for the %s weights (%.2f GB); dequantized before each GEMM", precision,
                            total / 1e9)
        # room for the largest group, dequantized before each GEMM (float32 elements)
        ws.ensure_dequant(-(-split16.weight_bytes(precision) * max(sizes) // 4))

    def layout(self, T: int) -> int:
        """The activation rows of a step of T rows (split16.LAYOUT_*)."""
        if not self.lo:
            return split16.LAYOUT_FP16
        return split16.LAYOUT_PAIRED if Dispatcher.split16_paired(T, self.ctx.ws.capacity) else split16.LAYOUT_SPLIT

    def _proj(self, mats: Sequence[WeightRef], T: int, y: int, ldy: int, layout: int) -> None:
        """y[:T] = s x[:T] @ [mats].T: the weights kept since start-up, or dequantize them now; then
        the GEMM calls."""
        ws = self.ctx.ws
        K = mats[0].cols
        w = self.kept.get(mats[0].ptr)
        if w is None:
            split16.split_weights(self.kx, tuple(mats), ws.deq.data.ptr, self.lo)
            w = ws.deq
        split16.split_gemm(w.data.ptr, ws.x16.data.ptr, sum(m.rows for m in mats), K, T, y, ldy, self._calls.get(K),
                           layout)

    def norm_linear(self, x: cupy.ndarray, norm: int, segs: Sequence[Segment], choice: Choice, T: int) -> None:
        # the group as one GEMM, then 1/s and the biases on the way out
        ws, c = self.ctx.ws, self.ctx.c
        mats = [w for w, _, _, _ in segs]
        inv, lay = ws.split_inv_ptrs[0], self.layout(T)
        split16.split_rows(self.kx, x.data.ptr, x.shape[1], norm, T, mats[0].cols, c.rms_eps, ws.x16.data.ptr, inv, lay)
        n = sum(w.rows for w in mats)
        self._proj(mats, T, ws.y32.data.ptr, n, lay)
        col = 0
        for part in launches(segs):     # each piece's columns of the GEMM's rows
            split16.unscale_scatter(self.kx, ws.y32.data.ptr + 4 * col, n, inv, T,
                                    [(y, ys, w.rows, b) for w, b, y, ys in part], lay)
            col += sum(w.rows for w, _, _, _ in part)

    def linear(self, x: cupy.ndarray, segs: Sequence[Segment], choice: Choice, T: int) -> None:
        """The segments' projections of the rows x[:T] as they are (no norm)."""
        self.norm_linear(x, 0, segs, choice, T)

    def linear_residual(self, a, w: WeightRef, post_norm: int, kern: Kernel, T: int) -> None:
        ws, c = self.ctx.ws, self.ctx.c
        lay = self.layout(T)
        if isinstance(a, SplitRows):          # the gated MLP left its output split for this projection
            inv = a.inv
        else:
            inv = ws.split_inv_ptrs[1]
            split16.split_rows(self.kx, a.data.ptr, a.shape[1], 0, T, w.cols, c.rms_eps, ws.x16.data.ptr, inv, lay)
        self._proj((w,), T, ws.tmp.data.ptr, ws.tmp.shape[1], lay)
        split16.unscale_add(self.kx, ws.x.data.ptr, ws.x.shape[1], ws.tmp.data.ptr, ws.tmp.shape[1], inv, post_norm,
                            T, c.hidden, c.rms_eps, lay)

    def gated(self, x: cupy.ndarray, norm: int, gate: WeightRef, up: WeightRef, choice: Choice, act: int,
              T: int) -> SplitRows:
        # gate and up as one GEMM; act(g) * u is split for the down projection in one pass
        ws, c = self.ctx.ws, self.ctx.c
        (inv_a, inv_b), lay = ws.split_inv_ptrs, self.layout(T)
        split16.split_rows(self.kx, x.data.ptr, x.shape[1], norm, T, c.hidden, c.rms_eps, ws.x16.data.ptr, inv_a, lay)
        F = gate.rows
        self._proj((gate, up), T, ws.y32.data.ptr, 2 * F, lay)
        split16.act_split(self.kx, ws.y32.data.ptr, F, inv_a, act, T, ws.x16.data.ptr, inv_b, lay)
        return SplitRows(inv_b)
