"""The model on the GPU: the model definition of model/ (weights.py builds it with device weights)
run by `StepOps`, the model's operations (model/ops.py) as kernel launches over the workspace.

Everything a step reads that changes per step (token ids, positions, slots) is already in device
buffers, so a decode step is a fixed launch sequence per batch bucket that a CUDA graph can
capture and replay. Which kernel multiplies each matrix of a step is the dispatcher's
(dispatch.py); the families of kernels it picks from implement the multiplying operations
(linear.py; a mixture of experts' routed experts: experts.py).

Decode rows (one new token per sequence) fold RoPE, the KV write and the per-head q/k norms of the
models that have them into attention; prompt rows read each other's cache rows, so the head norms
(rms_norm), RoPE and the KV write (rope_kv) run first. Attention runs on the
flash kernels (flash.py: tensor cores, split over the sequence where one row's keys must fill the
GPU) where they take the head size, and on attention.cu's otherwise and for decode rows that are
all short (the backend's choice per step: `long_decode`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import cupy
import numpy as np

from ... import timeline
from ...model.config import ModelConfig
from ...model.ops import AttentionSpec
from ...settings import Settings
from . import dispatch, flash, ops
from .dispatch import Dispatcher, Kernel, Step
from .experts import GroupedExperts, PairExperts
from .kv_cache import KVCache
from .linear import ACT, Context, GemvLinear, MmqLinear, Split16Linear, launches
from .modules import Kernels
from .pdl import clusters_ok
from .recurrent import RecurrentState
from .support import dn_chunk_kernel
from .weights import DeviceWeights
from .workspace import Workspace, next_pow2

log = logging.getLogger(__name__)

# prompt attention plans remembered (_prefill_plan): a server's steps take a few (rows, depth) at once
PLAN_MEMO = 256


def rope_host_tables(c: ModelConfig, max_context: int) -> dict[tuple[float, bool], np.ndarray]:
    """The RoPE cos/sin tables of the layers, on the host (ops.rope_host_table): one per distinct
    (theta, scaled) of the layers (gemma3's sliding layers: their own base, unscaled), keyed so.
    ~0.1 s per table at 32k positions, with the GIL released: the backend makes them on a thread
    while the weights go up."""
    out: dict[tuple[float, bool], np.ndarray] = {}
    for li in range(c.n_layers):
        sc = c.layer_rope_scaling(li)
        key = (c.layer_rope_theta(li), sc is not None)
        if key not in out:
            out[key] = ops.rope_host_table(max_context, c.rope_dim, key[0], sc)
    return out


class Forward:
    def __init__(self, k: Kernels, w: DeviceWeights, ws: Workspace, settings: Settings, max_context: int,
                 rope_host: Future | None = None):
        """settings.prefill_weight_cache: whether the split16 weights are kept, gemm_precision: their
        precision (linear.py). The KV
        cache (`kv`) is set by the backend once it has sized the pool from what is left.
        rope_host: rope_host_tables(config, max_context) made ahead (None: made here)."""
        self.k, self.w, self.ws = k, w, ws
        self.model = w.model
        c = self.c = w.config
        self.kv: KVCache | None = None
        self.recurrent: RecurrentState | None = None   # a hybrid's DeltaNet states: set with the KV cache
        if c.has_recurrent_state:
            _ = k.deltanet["conv"]        # its module now, never inside a graph capture
        groups = self.model.projections()
        # the groups the dense families multiply (a mixture of experts' router and experts: experts.py)
        dense = [(kind, g) for kind, g in groups if kind in dispatch.DENSE_KINDS]
        head = self.model.output
        self.ctx = Context(k, ws, c)
        self.gemv = GemvLinear(self.ctx)
        self.split16 = Split16Linear(self.ctx, [g for _, g in dense], settings.prefill_weight_cache,
                                     settings.gemm_precision)
        timeline.mark("cuda: split16 GEMMs set up (%d split weight groups kept)", len(self.split16.kept))
        self.dispatcher = Dispatcher(groups, head, split16_kept=bool(self.split16.kept),
                                     precision=settings.gemm_precision, smem=ops.device_smem(k))
        # (a group of more projections than one launch writes: each launch's, linear.launches; a model
        # with a shared expert multiplies a gated pair also as two segments: its gate and up, experts.py)
        unfused = {False} if c.shared_expert_ffn_dim else set()
        shapes = {(g[0].cols, tuple(m.rows for m in part), ffn)
                  for kind, g in dense for part in launches(g) for ffn in {kind == "gated"} | unfused}
        shapes.add((head.cols, (head.rows,), False))
        self.mmq = MmqLinear(self.ctx, max(ws.max_rows, dispatch.PROMPT_MMQ_TOKENS), sorted(shapes))
        self._family = {Kernel.MMVF: self.gemv, Kernel.MMV8: self.gemv, Kernel.GEMV: self.gemv,
                        Kernel.MMQS: self.mmq, Kernel.MMQ: self.mmq, Kernel.SPLIT16: self.split16,
                        Kernel.MOE_PAIRS: PairExperts(self.ctx, self.gemv, self.family),
                        Kernel.MOE_GROUPED: GroupedExperts(self.ctx, self.gemv, self.family)}
        self._family[Kernel.MOE_PAIRS8] = self._family[Kernel.MOE_PAIRS]
        # packed (value, row) keys of the LM head's fused argmax; argmax_unpack re-zeroes them
        self.am_key = cupy.zeros(ws.max_rows, cupy.uint64)
        # RoPE cos/sin per position (rope.cu, attention.cu), one table per distinct (theta, scaling) of
        # the layers (gemma3's sliding layers: their own base, unscaled)
        host = rope_host.result() if rope_host is not None else rope_host_tables(c, max_context)
        tables = {key: cupy.asarray(t) for key, t in host.items()}
        self.rope_tables = [tables[(c.layer_rope_theta(li), c.layer_rope_scaling(li) is not None)]
                            for li in range(c.n_layers)]
        timeline.mark("cuda: RoPE tables up (%d positions x %d)", max_context, len(tables))
        # (device pointer, length) of the host's token ring (token_ring.py); (0, 0): none
        self.token_ring = (0, 0)
        # the flash kernels take the head sizes they have, where their blocks fit the device's shared
        # memory (flash.fits: the prompt's, then the long decode rows'); else attention.cu's kernels
        optin = ops.device_smem(k).optin
        self.flash = (c.head_dim in flash.HEAD_DIMS
                      and flash.fits(flash.plan_prefill(1, c.n_heads, c.head_dim).smem, optin))
        self.flash_decode = self.flash and flash.fits(flash.decode_smem(c.head_dim), optin)
        if c.head_dim in flash.HEAD_DIMS and not self.flash_decode:
            log.info("cuda: head size %d: the %s attention on attention.cu's kernels, the flash kernels' blocks "
                     "need more shared memory than this device allows (%s bytes)", c.head_dim,
                     "long decode rows'" if self.flash else "prompt and long decode rows'", optin)
        self._plans: dict[tuple[int, int], flash.Plan] = {}     # _prefill_plan's
        if self.flash:
            self.fk = flash.get_flash_kernels(k.device.id, getattr(k, "prebuilt", True))
            buckets = [1 << i for i in range(ws.max_rows.bit_length()) if 1 << i <= ws.max_rows]
            # on sm_90 the splits of a row combine in thread-block clusters (flash_decode.cu)
            clusters = clusters_ok(k)
            self.dec_plans = {}
            for b in buckets if self.flash_decode else ():
                splits, cl = flash.decode_cluster(
                    flash.decode_splits(b, c.n_kv_heads, self.fk.sm_count, clusters=clusters), clusters)
                self.dec_plans[b] = flash.plan_decode(b, c.n_heads, c.n_kv_heads, c.head_dim, splits=splits,
                                                      cluster=cl)
            # decode graphs capture the decode scratch: sized once, here; prompts grow their own
            self.dec_scratch, self.pre_scratch = flash.FlashScratch(), flash.FlashScratch()
            self.dec_scratch.ensure(*self.dec_plans.values())
            # the prompt scratch holds the bucketed steps' plans at any depth from the start: growing
            # it later would drop every prompt graph (scratch_listeners)
            self.pre_scratch.ensure(*(self._prefill_plan(b, max_context) for b in self.dispatcher.buckets))
            self.fk.prepare(*([self.dec_plans[1]] if self.flash_decode else []), self._prefill_plan(512, 512))
        self.max_pos = 0          # largest position of the prompt rows being run (prefill_step)
        self.scratch_listeners: list = []   # called when the prompt attention's scratch moves
        self.long_decode = False  # this decode step's attention: flash-decoding (long rows) or attention.cu

    def _prefill_plan(self, T: int, keys: int) -> "flash.Plan":
        """The prompt attention's plan for T rows over up to `keys` keys. Remembered (plans are
        immutable): every layer of a prompt step asks for its step's plan, and the step's key asked
        first; at most PLAN_MEMO of them, all dropped when full."""
        plan = self._plans.get((T, keys))
        if plan is None:
            c = self.c
            rows = flash.plan_prefill(T, c.n_heads, c.head_dim).rows
            plan = flash.plan_prefill(T, c.n_heads, c.head_dim,
                                      splits=flash.prefill_splits(T, c.n_heads, keys, self.fk.sm_count, rows))
            if len(self._plans) >= PLAN_MEMO:
                self._plans.clear()
            self._plans[(T, keys)] = plan
        return plan

    @property
    def nbytes(self) -> int:
        """Device bytes of the step buffers kept here (batched-decode and flash scratch)."""
        return self.mmq.nbytes + (self.dec_scratch.nbytes + self.pre_scratch.nbytes if self.flash else 0)

    @property
    def pdl(self) -> bool:
        """Launch the kernels that wait for their predecessor in pdl_wait() as programmatic dependent
        launches (pdl.py); the backend sets it while it captures a decode step."""
        return self.ctx.pdl

    @pdl.setter
    def pdl(self, on: bool) -> None:
        self.ctx.pdl = on

    def family(self, kernel: Kernel):
        return self._family[kernel]

    # ------------------------------------------------------------ attention
    def attention(self, spec: AttentionSpec, T: int, pos: int, slots: int, decode: bool, sinks: int = 0,
                  head_norms: tuple[int, int] | None = None) -> None:
        """ws.attn[:T] from ws.q, ws.k, ws.v: the head norms (head_norms: the q and k norms' fp32
        [head_dim] on the device; None: none), RoPE and the KV write (all three in the attention
        launch for decode rows), then attention over the paged cache (sinks: the layer's sink
        logits, fp32 [n_heads] on the device; 0: none)."""
        c, ws, kv, li = self.c, self.ws, self.kv.layer(spec.layer), spec.layer
        neox = spec.rope.style == "neox"
        fuse = decode and c.head_dim <= ops.ATT_MAXD
        norms = (*head_norms, c.rms_eps) if head_norms is not None else None
        if not fuse:
            D = c.head_dim
            if norms is not None:       # in place over each head of q, then of k
                for y, w, heads in ((ws.q, norms[0], c.n_heads), (ws.k, norms[1], c.n_kv_heads)):
                    ops.rms_norm(self.k, y.data.ptr, D, w, y.data.ptr, D, T * heads, D, c.rms_eps)
            ops.rope_kv(self.k, ws.q.data.ptr, ws.k.data.ptr, ws.v.data.ptr, pos, slots, kv, c.n_heads,
                        c.n_kv_heads, c.head_dim, spec.rope.dim, self.rope_tables[li].data.ptr, neox, T)
        rope = (ws.k.data.ptr, ws.v.data.ptr, spec.rope.dim, neox, self.rope_tables[li].data.ptr) if fuse else None
        args = (ws.q.data.ptr, ws.attn.data.ptr, kv.k, kv.v, kv.tables, kv.max_blocks, kv.bs_log2, slots, pos, T,
                c.n_heads, c.n_kv_heads, c.head_dim, spec.scale, spec.window)
        if self.flash_decode and fuse and self.long_decode:
            flash.decode(self.fk, self.dec_plans[T], *args, self.dec_scratch, rope=rope, pdl=self.pdl, sinks=sinks,
                         head_norms=norms)
        elif self.flash and not fuse:
            plan = self._prefill_plan(T, self.max_pos + 1)
            if self.pre_scratch.ensure(plan):
                for cb in self.scratch_listeners:
                    cb()
            flash.prefill(self.fk, plan, *args, self.pre_scratch, pdl=self.pdl, sinks=sinks)
        else:
            ops.attention(self.k, ws.q.data.ptr, ws.attn.data.ptr, kv, slots, pos, c.n_heads, c.n_kv_heads,
                          c.head_dim, spec.scale, spec.window, T, rope=rope, pdl=self.pdl, sinks=sinks,
                          head_norms=norms if fuse else None)

    # ------------------------------------------------------------ whole steps
    def decode_step(self, b: int, long: bool = False) -> None:
        """One decode step for b rows (a bucket); inputs in ws.dec_io[0/1/2, :b] (tokens/positions/slots;
        row 3: the token ring's row, token_ring.py).
        long: the rows' attention on the flash-decoding kernels (split over long sequences), else on
        attention.cu's. The step ends by writing its argmax tokens and the next positions into
        ws.dec_io[0/1]: the next step's inputs when the host feeds none."""
        self.long_decode = long
        io = self.ws.dec_io
        step = self.dispatcher.decode_step(b)
        self.model.forward(StepOps(self, step, io[0].data.ptr, io[1].data.ptr, io[2].data.ptr, decode=True,
                                   head_rows=b))

    def prompt_step(self, T: int) -> Step:
        """The family of a prompt step of T tokens and the rows it runs (the rows past T: padding
        on the scratch slot)."""
        return self.dispatcher.prompt_step(T)

    def prefill_key(self, T: int, n_items: int, max_pos: int) -> tuple[int, int, int, str]:
        """What fixes the launches of a prompt step of T tokens of n_items sequences whose last row
        sits at max_pos (a graph's key): the rows it runs, its head rows, the attention plan's key
        splits, the family of its projections."""
        step = self.prompt_step(T)
        splits = self._prefill_plan(step.rows, max_pos + 1).splits if self.flash else 0
        return step.rows, self.prompt_items(n_items, step.family), splits, step.family

    def prompt_items(self, n_items: int, family: str) -> int:
        """The sequences a prompt step's head runs for n_items: on the split16 GEMMs a power of two
        (up to the workspace's rows), so that their graph keys recur (the extra rows repeat row 0)."""
        if family != "split16":
            return n_items
        return min(next_pow2(n_items), self.ws.max_rows)

    def prefill_launches(self, T: int, n_items: int, family: str) -> None:
        """The launches of a prompt step of T rows (self.max_pos set) in the family given; the
        inputs of its rows in the workspace, ws.last_idx[:n_items] each item's last row."""
        ws = self.ws
        self.model.forward(StepOps(self, Step(family, T), ws.tokens.data.ptr, ws.positions.data.ptr,
                                   ws.slots.data.ptr, decode=False, head_rows=n_items))


class StepOps:
    """The model's operations (model/ops.py) for one GPU step of step.rows rows at positions pos[t]
    of the sequences in slots[t] (device pointers; tok: the token ids). Values are workspace
    buffers: the residual stream is ws.x, q/k/v ws.q/k/v, attention's output ws.attn, the gated
    MLP's ws.a (or its split16 rows); the routed experts add into ws.x (experts.py); a hybrid's
    gated attention projects into ws.qg (split into ws.q and ws.gate), its DeltaNet into ws.mixed,
    z, beta and alpha, through ws.conv into ws.dn_out, each segment of rows through its slot's
    state (fwd.recurrent). decode: one new token per sequence, the head over every row
    and its tokens fed to the next step's inputs (ws.dec_io); else a prompt step, the head over
    each sequence's last row (ws.last_idx[:head_rows])."""

    def __init__(self, fwd: Forward, step: Step, tok: int, pos: int, slots: int, decode: bool, head_rows: int):
        self.fwd, self.step, self.T = fwd, step, step.rows
        self.tok, self.pos, self.slots, self.decode, self.head_rows = tok, pos, slots, decode, head_rows

    def embed(self, table, scale: float):
        ws, c = self.fwd.ws, self.fwd.c
        ops.embed(self.fwd.k, table, self.tok, self.T, scale, ws.x.data.ptr, c.hidden)
        return ws.x

    def norm_linear(self, x, norm: int, mats, biases) -> tuple:
        ws = self.fwd.ws
        choice = self.fwd.dispatcher.linear(self.step, mats)
        outs = ws.outputs(tuple(w.rows for w in mats))
        segs = [(w, b or 0, o.data.ptr, o.shape[1]) for w, b, o in zip(mats, biases, outs)]
        self.fwd.family(choice.kernels[0]).norm_linear(x, norm, segs, choice, self.T)
        return outs

    def attention(self, q, k, v, spec: AttentionSpec, sinks=None, head_norms=None):
        ws = self.fwd.ws
        if q is not ws.q or k is not ws.k or v is not ws.v:
            raise NotImplementedError("attention on the GPU: q, k and v in the workspace's ws.q, ws.k, ws.v")
        self.fwd.attention(spec, self.T, self.pos, self.slots, self.decode, sinks or 0, head_norms)
        return ws.attn

    def linear_residual(self, a, w, x, post_norm, bias=None):
        if bias is not None and post_norm is not None:
            # the bias goes before the post-norm there; no model has both (support.py refuses one)
            raise NotImplementedError("an output projection bias before a post-norm on the GPU")
        fwd = self.fwd
        kern = fwd.dispatcher.linear(self.step, (w,)).kernels[0]
        fwd.family(kern).linear_residual(a, w, post_norm or 0, kern, self.T)
        if bias is not None:        # x + (a @ w.T + bias): the bias after the projection, every family alike
            ops.add_rows(fwd.k, fwd.ws.x.data.ptr, fwd.ws.x.shape[1], bias, self.T, fwd.c.hidden)
        return fwd.ws.x

    def norm_gated_mlp(self, x, norm: int, gate, up, act: str):
        choice = self.fwd.dispatcher.gated(self.step, gate, up)
        return self.fwd.family(choice.kernels[0]).gated(x, norm, gate, up, choice, ACT[act], self.T)

    def norm_moe_residual(self, x, norm: int, experts):
        e = experts
        shared = (e.shared_gate, e.shared_up, e.shared_down, e.shared_router) if e.shared_gate is not None else ()
        choice = self.fwd.dispatcher.experts(self.step, e.router, e.gate, e.up, shared, e.down)
        return self.fwd.family(choice.experts).moe(x, norm, e, choice, self.T)

    def split_heads(self, y, parts: int) -> tuple:
        fwd, ws, c = self.fwd, self.fwd.ws, self.fwd.c
        if parts != 2 or y is not ws.qg:
            raise NotImplementedError("split_heads on the GPU: a gated attention's [query | gate] heads only")
        ops.split_pair(fwd.k, ws.qg.data.ptr, ws.q.data.ptr, ws.gate.data.ptr, self.T, c.n_heads, c.head_dim)
        return ws.q, ws.gate

    def sigmoid_gate(self, y, gate):
        ops.sigmoid_mul(self.fwd.k, y.data.ptr, gate.data.ptr, self.T * y.shape[1])
        return y

    def delta_rule(self, mixed, z, beta, alpha, net):
        """The conv then the delta rule with its gated RMSNorm (kernels/deltanet.cu), each segment of
        the step's rows carried through its slot's state; into ws.dn_out."""
        fwd, ws, c = self.fwd, self.fwd.ws, self.fwd.c
        conv_state, state = fwd.recurrent.layer(net.layer)
        rows = ops.StepRows(self.slots, self.pos, fwd.kv.scratch_slot, self.T)
        C = mixed.shape[1]
        ops.dn_conv(fwd.k, mixed.data.ptr, C, net.conv, c.ssm_conv_kernel - 1, conv_state.data.ptr, rows, C,
                    ws.conv.data.ptr, ws.conv.shape[1])
        # long prompt segments in chunks first where the heads have a chunked kernel (dispatch's rule)
        chunk = dispatch.DN_CHUNK_MIN_TOKENS
        if self.decode or dn_chunk_kernel(net.k_dim, net.v_dim) is None:
            chunk = None
        ops.dn_delta(fwd.k, ws.conv.data.ptr, ws.conv.shape[1], alpha.data.ptr, beta.data.ptr, alpha.shape[1],
                     z.data.ptr, z.shape[1], net.a_coef, net.dt_bias, net.out_norm, state.data.ptr, rows,
                     net.k_heads, net.k_dim, net.v_heads, net.v_dim, c.rms_eps, ws.dn_out.data.ptr,
                     ws.dn_out.shape[1], chunk_min=chunk)
        return ws.dn_out

    def logits(self, x, norm: int, w):
        fwd, ws, c = self.fwd, self.fwd.ws, self.fwd.c
        n = self.head_rows
        if self.decode:
            rows, io = ws.x, ws.dec_io
            feed = (io.data.ptr, io.shape[1], *fwd.token_ring)
        else:
            ops.gather_rows(fwd.k, ws.x.data.ptr, ws.last_idx.data.ptr, ws.last.data.ptr, n, c.hidden)
            rows, feed = ws.last, (0, 0, 0, 0)
        kern = fwd.dispatcher.head(n)
        fwd.family(kern).head(rows, n, norm, w, kern, fwd.am_key.data.ptr, feed)
        return ws.logits
