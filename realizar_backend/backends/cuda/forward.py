"""The transformer forward pass as a sequence of kernel launches over the workspace.

Everything a step reads that changes per step (token ids, positions, slots) is already in
device buffers, so a decode step is a fixed launch sequence per batch bucket that a CUDA graph
can capture and replay.

`block` is the one definition of a layer, shared by every kind of step: RMSNorm + Q/K/V, the
per-head q/k norms (qwen3, gemma3), RoPE and the KV write, attention over the paged KV cache
(kv_cache.py), the output projection into the residual (with gemma3's post-norm), RMSNorm +
gate/up/activation, and the down projection into the residual. How the projections of a step run
is its Projections object (projections.py): GEMVs for decode steps of a few rows and prompt steps
of a few tokens (several rows per launch; integer-dot on 8-bit activations, fp32-activation or, for
float types, plain), a tensor-core matrix multiply on the quantized blocks for decode steps of
MMQ_MIN_ROWS rows or more and prompt steps of up to Settings.prompt_mmq_tokens (mmq.py), GEMMs
for longer prompt steps (prefill.py). A new architecture is flags in model/arch.py plus, where it
changes the layer, an edit here.

Decode rows (one new token per sequence) fold RoPE and the KV write into attention; prompt rows
read each other's cache rows, so RoPE and the KV write run first (rope_kv). Attention runs on the
flash kernels (flash.py: tensor cores, split over the sequence where one row's keys must fill the
GPU) or, with Settings.attention "classic", on attention.cu's.
"""

from __future__ import annotations

from concurrent.futures import Future

import cupy
import numpy as np

from ... import timeline
from ...model.config import ModelConfig
from ...settings import Settings
from . import flash, ops
from .kv_cache import KVCache
from .pdl import clusters_ok
from .modules import Kernels
from .prefill import GemmProjections
from .projections import GemvProjections, MmqProjections, Projections, StepContext
from .weights import DeviceWeights, LayerIndex
from .workspace import Workspace

# prompt steps the tensor-core projections do not take (prompt_step) use the GEMM projections from
# this many tokens, shorter ones the GEMVs, whose GPU time grows with every row. GEMV and
# tensor-core steps replay CUDA graphs (graphs.PrefillGraphs); GEMM steps run eagerly, their token
# counts vary from step to step (~560 launches: 8.5-9.5 ms of host time on the H100 machine's
# host for qwen15 whatever the rows).
# tools/prefill_rows_bench.py, qwen15 twin, depth 4,000: GEMV graph 2.7 / 5.0 / 8.0 / 13.2 ms at
# 1 / 4 / 8 / 16 tokens, the eager split16 GEMMs 8.5-9.4 ms: the GEMMs win from about 12 tokens
# when their split weights are kept from start-up (no dequantize per step), else from 17
GEMM_MIN_TOKENS = 17
GEMM_MIN_TOKENS_KEPT = 12
# decode steps (buckets) of this many rows or more use the tensor-core matrix multiply (mmq.py),
# which reads each weight block once per 64 rows; smaller ones the GEMVs (once per 8 rows)
MMQ_MIN_ROWS = 8
# from this many rows, when every projection's matrices have mmqs.cu's types (MmqProjections.small),
# the tensor cores take over from the GEMVs already: mmqs reads each weight once per 16 rows (qwen15
# step projections, tools/mmq_bench.py: 1.95 ms against the GEMVs' 2.99 at 4 rows, 1.92 / 1.70 at 2)
SMALL_MIN_ROWS = 4
# ... and the LM head from this many (tools/mmq_bench.py --shapes head, 2 rows: 125.8 us on mmqs, prep
# included, against 151.7 on the 2-row GEMV; one row stays on the GEMV, ~96 us)
SMALL_HEAD_MIN_ROWS = 2
# decode steps of this many rows or more run the prefill's split16 GEMMs on its kept split weights
# (blas.py: captured like the rest of the step), with Settings.batched_decode "split16" / "auto"
SPLIT16_MIN_ROWS = {"split16": 16, "auto": 64}
# prompt steps on the GEMMs run on their token count rounded up to a multiple of this (the rows past
# it: padding on the scratch slot), so that their launches recur as a few graph keys
# (graphs.PrefillGraphs): eager, a step's ~840 launches (GEMMs included) cost the host 10-15 ms, and
# several times that while the server's other threads want the GIL (perf-notes v24)
GEMM_ROW_STEP = 64
# prompt steps on the tensor-core projections are padded to a bucket of this many rows or a multiple
# of 16 (mmqs.cu takes 8- and 16-row tiles, then token groups of 16: a bucket costs about what its
# largest step would), so a few graphs serve every length up to Settings.prompt_mmq_tokens
PROMPT_MIN_BUCKET = 8


def prompt_buckets(max_tokens: int) -> tuple[int, ...]:
    """Row counts of the prompt steps on the tensor-core projections, for steps of up to max_tokens
    (Settings.prompt_mmq_tokens; 0: none): 8, the multiples of 16 below max_tokens, max_tokens."""
    if max_tokens <= 0:
        return ()
    return tuple(sorted({min(PROMPT_MIN_BUCKET, max_tokens), max_tokens,
                         *range(16, max_tokens, 16)}))


def prompt_step(T: int, mmq_min: int, buckets: tuple[int, ...], gemm_min: int) -> tuple[str, int]:
    """How a prompt step of T tokens runs, and on how many rows: ("mmq", its bucket) from mmq_min
    tokens up to the largest bucket; else ("gemm", T rounded up to GEMM_ROW_STEP) from gemm_min
    tokens; else ("gemv", T)."""
    if buckets and mmq_min <= T <= buckets[-1]:
        return "mmq", next(b for b in buckets if b >= T)
    if T >= gemm_min:
        return "gemm", -(-T // GEMM_ROW_STEP) * GEMM_ROW_STEP
    return "gemv", T


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
        """settings.decode_activations: "fp32" (every projection on fp32 activations: the reference
        the others approximate, on mmvf.cu), "int8" (8-bit activation blocks everywhere they apply),
        "int8-fp32-down" (all but the FFN down projection, whose input has the widest range).
        settings.prefill_precision / prefill_weight_cache: the prefill GEMMs (prefill.py). The KV
        cache (`kv`) is set by the backend once it has sized the pool from what is left.
        rope_host: rope_host_tables(config, max_context) made ahead (None: made here)."""
        self.k, self.w, self.ws = k, w, ws
        self.c = w.config
        self.kv: KVCache | None = None
        self.ctx = StepContext(k, w, ws, self.c, 1 if self.c.activation == "gelu_tanh" else 0)
        self.gemv = GemvProjections(self.ctx, settings.decode_activations)
        self.gemm = GemmProjections(self.ctx, settings.prefill_precision, settings.prefill_weight_cache)
        timeline.mark("cuda: prefill GEMMs set up (%s, %d split weight groups kept)", self.gemm.prefill,
                      len(self.gemm.cached))
        buckets = prompt_buckets(settings.prompt_mmq_tokens)
        mmq_rows = max(ws.max_rows, buckets[-1] if buckets else 0)
        self.mmq = (MmqProjections(self.ctx, mmq_rows, self.gemv, MMQ_MIN_ROWS, SMALL_MIN_ROWS)
                    if mmq_rows >= SMALL_MIN_ROWS else None)
        # prompt steps of prompt_mmq_min .. prompt_buckets[-1] tokens run on the tensor-core
        # projections where every projection of the model has them (else the GEMVs would take
        # the rest, whose time grows with every row)
        self.prompt_buckets = buckets if self.mmq is not None and self.mmq.all_on else ()
        self.prompt_mmq_min = self.mmq.min_rows if self.mmq is not None else 0
        kept = self.gemm.prefill == "split16" and bool(self.gemm.cached)
        self.split16_min_rows = SPLIT16_MIN_ROWS.get(settings.batched_decode) if kept else None
        int8 = settings.decode_activations != "fp32"
        self.head_q8 = ops.blocks_ok(w.output) and self.ctx.norm16 and int8
        self.head_f32 = ops.blocks_ok(w.output)
        # packed (value, row) keys of the LM head's fused argmax; argmax_unpack re-zeroes them
        self.am_key = cupy.zeros(ws.max_rows, cupy.uint64)
        # RoPE cos/sin per position (rope.cu, attention.cu), one table per distinct (theta, scaling) of
        # the layers (gemma3's sliding layers: their own base, unscaled)
        host = rope_host.result() if rope_host is not None else rope_host_tables(self.c, max_context)
        tables = {key: cupy.asarray(t) for key, t in host.items()}
        self.rope_tables = [tables[(self.c.layer_rope_theta(li), self.c.layer_rope_scaling(li) is not None)]
                            for li in range(len(w.layers))]
        timeline.mark("cuda: RoPE tables up (%d positions x %d)", max_context, len(tables))
        # (device pointer, length) of the host's token ring (token_ring.py); (0, 0): none
        self.token_ring = (0, 0)
        self.flash = settings.attention == "flash" and self.c.head_dim in flash.HEAD_DIMS
        if self.flash:
            c = self.c
            self.fk = flash.get_flash_kernels(k.device.id, getattr(k, "prebuilt", True))
            buckets = [1 << i for i in range(ws.max_rows.bit_length()) if 1 << i <= ws.max_rows]
            # on sm_90 the splits of a row combine in thread-block clusters (flash_decode.cu)
            clusters = clusters_ok(k)
            self.dec_plans = {}
            for b in buckets:
                splits, cl = flash.decode_cluster(
                    flash.decode_splits(b, c.n_kv_heads, self.fk.sm_count, clusters=clusters), clusters)
                self.dec_plans[b] = flash.plan_decode(b, c.n_heads, c.n_kv_heads, c.head_dim, splits=splits,
                                                      cluster=cl)
            # decode graphs capture the decode scratch: sized once, here; prompts grow their own
            self.dec_scratch, self.pre_scratch = flash.FlashScratch(), flash.FlashScratch()
            self.dec_scratch.ensure(*self.dec_plans.values())
            # the prompt scratch holds the bucketed steps' plans at any depth from the start: growing
            # it later would drop every prompt graph (scratch_listeners)
            self.pre_scratch.ensure(*(self._prefill_plan(b, max_context) for b in self.prompt_buckets))
            self.fk.prepare(self.dec_plans[1], self._prefill_plan(512, 512))
        self.gemm_min_tokens = (GEMM_MIN_TOKENS_KEPT if self.gemm.prefill == "split16" and self.gemm.cached
                                else GEMM_MIN_TOKENS)
        self.max_pos = 0          # largest position of the prompt rows being run (prefill_step)
        self.scratch_listeners: list = []   # called when the prompt attention's scratch moves
        self.long_decode = False  # this decode step's attention: flash-decoding (long rows) or attention.cu

    def _prefill_plan(self, T: int, keys: int) -> "flash.Plan":
        c = self.c
        rows = flash.plan_prefill(T, c.n_heads, c.head_dim).rows
        return flash.plan_prefill(T, c.n_heads, c.head_dim,
                                  splits=flash.prefill_splits(T, c.n_heads, keys, self.fk.sm_count, rows))

    @property
    def nbytes(self) -> int:
        """Device bytes of the step buffers kept here (batched-decode and flash scratch)."""
        n = self.mmq.nbytes if self.mmq is not None else 0
        return n + (self.dec_scratch.nbytes + self.pre_scratch.nbytes if self.flash else 0)

    @property
    def pdl(self) -> bool:
        """Launch the kernels that wait for their predecessor in pdl_wait() as programmatic dependent
        launches (pdl.py); the backend sets it while it captures a decode step."""
        return self.ctx.pdl

    @pdl.setter
    def pdl(self, on: bool) -> None:
        self.ctx.pdl = on

    # ------------------------------------------------------------ attention and its inputs
    def qk_norm(self, lw: LayerIndex, T: int) -> None:
        """Per-head RMSNorm of q and k (qwen3, gemma3), in place."""
        if lw.q_norm:
            c, k, ws, D = self.c, self.k, self.ws, self.c.head_dim
            ops.rms_norm(k, ws.q.data.ptr, D, lw.q_norm, ws.q.data.ptr, D, T * c.n_heads, D, c.rms_eps)
            ops.rms_norm(k, ws.k.data.ptr, D, lw.k_norm, ws.k.data.ptr, D, T * c.n_kv_heads, D, c.rms_eps)

    def rope_kv(self, li: int, lw: LayerIndex, T: int, pos: int, slots: int) -> None:
        """RoPE of q and k in place, and k, v into the cache rows of (slots[t], pos[t])."""
        c, ws = self.c, self.ws
        ops.rope_kv(self.k, ws.q.data.ptr, ws.k.data.ptr, ws.v.data.ptr, pos, slots, self.kv.layer(li),
                    c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim, self.rope_tables[li].data.ptr,
                    c.rope_style == "neox", T)

    def attention(self, li: int, lw: LayerIndex, T: int, pos: int, slots: int, outs: tuple[int, int, int],
                  fuse_rope: bool) -> None:
        """ws.attn[:T] (and outs: 8-bit values and scales, fp16); fuse_rope: decode rows (T is the
        bucket), RoPE and the KV write done here."""
        c, ws, kv = self.c, self.ws, self.kv.layer(li)
        oq, od, o16 = outs
        rope = ((ws.k.data.ptr, ws.v.data.ptr, c.rope_dim, c.rope_style == "neox",
                 self.rope_tables[li].data.ptr) if fuse_rope else None)
        args = (ws.q.data.ptr, ws.attn.data.ptr, kv.k, kv.v, kv.tables, kv.max_blocks, kv.bs_log2, slots, pos, T,
                c.n_heads, c.n_kv_heads, c.head_dim, c.scale, lw.window)
        if self.flash and fuse_rope and self.long_decode:
            flash.decode(self.fk, self.dec_plans[T], *args, self.dec_scratch, rope=rope, o16=o16, oq=oq, od=od,
                         pdl=self.pdl)
        elif self.flash and not fuse_rope and not oq:
            plan = self._prefill_plan(T, self.max_pos + 1)
            if self.pre_scratch.ensure(plan):
                for cb in self.scratch_listeners:
                    cb()
            flash.prefill(self.fk, plan, *args, self.pre_scratch, o16=o16, pdl=self.pdl)
        else:
            ops.attention(self.k, ws.q.data.ptr, ws.attn.data.ptr, kv, slots, pos, c.n_heads, c.n_kv_heads,
                          c.head_dim, c.scale, lw.window, T, oq, od, o16, rope, pdl=self.pdl)

    # ------------------------------------------------------------ the layer
    def block(self, li: int, lw: LayerIndex, p: Projections, T: int, pos: int, slots: int, decode: bool) -> None:
        """Layer li over T rows (positions pos[t] of the sequences in slots[t]: device pointers);
        the residual stream is ws.x. decode: one new token per sequence."""
        p.qkv(li, lw, T)
        self.qk_norm(lw, T)
        fuse = decode and self.c.head_dim <= ops.ATT_MAXD
        if not fuse:
            self.rope_kv(li, lw, T, pos, slots)
        self.attention(li, lw, T, pos, slots, p.attn_outputs(li), fuse)
        p.out(li, lw, T)
        p.ffn(li, lw, T)
        p.down(li, lw, T)

    def layers(self, p: Projections, T: int, tok: int, pos: int, slots: int, decode: bool = False) -> None:
        """Embed token ids (device pointer tok) and run every layer; the residual stream ends in ws.x[:T]."""
        c, ws = self.c, self.ws
        ops.embed(self.k, self.w.tok_embd, tok, T, c.embed_scale, ws.x.data.ptr, c.hidden)
        for li, lw in enumerate(self.w.layers):
            self.block(li, lw, p, T, pos, slots, decode)

    def head(self, rows: cupy.ndarray, n: int, io: cupy.ndarray | None = None) -> None:
        """Final norm + LM head + greedy argmax for rows[:n] -> ws.logits, ws.argmax (MMQ_MIN_ROWS rows
        or more: on the tensor cores, mmq.py); io: the decode inputs (ws.dec_io), which also receive
        the argmax tokens and advanced positions."""
        c, ws, g = self.c, self.ws, self.gemv
        feed = (io.data.ptr, io.shape[1], *self.token_ring) if io is not None else (0, 0, 0, 0)
        if self.mmq is not None and self.mmq.head_ok and n >= (SMALL_HEAD_MIN_ROWS if self.mmq.small
                                                               else self.mmq.min_rows):
            self.mmq.head(rows, n, self.w.output_norm, ws.logits, self.am_key.data.ptr)
            ops.argmax_unpack(self.k, self.am_key.data.ptr, ws.argmax.data.ptr, n, *feed, pdl=self.pdl)
            return
        if self.head_q8:
            g.norm_q8(rows, self.w.output_norm, n, None, ws.head_q, ws.head_d)
            ops.mmv_q8(self.k, [(self.w.output, 0, ws.logits.data.ptr, c.vocab_size)], c.hidden,
                       ws.head_q.data.ptr, ws.head_d.data.ptr, n)
        elif self.head_f32:
            # norm, LM head and argmax in one launch (+ the tiny unpack)
            x, norm = g.normed(rows, self.w.output_norm, n)
            ops.mmvf(self.k, [(self.w.output, 0, ws.logits.data.ptr, c.vocab_size)], c.hidden, x.data.ptr,
                     x.shape[1], n, norm=norm, amax=self.am_key.data.ptr, pdl=self.pdl, head=True)
            ops.argmax_unpack(self.k, self.am_key.data.ptr, ws.argmax.data.ptr, n, *feed, pdl=self.pdl)
            return
        else:
            g.norm(rows, self.w.output_norm, ws.last_norm, n)
            g.gemv(self.w.output, ws.last_norm, n, ws.logits)
        ops.argmax_rows(self.k, ws.logits.data.ptr, c.vocab_size, c.vocab_size, ws.argmax.data.ptr, n, *feed)

    # ------------------------------------------------------------ whole steps
    def decode_step(self, b: int, long: bool = False) -> None:
        """One decode step for b rows (a bucket); inputs in ws.dec_io[0/1/2, :b] (tokens/positions/slots;
        row 3: the token ring's row, token_ring.py).
        long: the rows' attention on the flash-decoding kernels (split over long sequences), else on
        attention.cu's. The step ends by writing its argmax tokens and the next positions into
        ws.dec_io[0/1]: the next step's inputs when the host feeds none."""
        self.long_decode = long
        io = self.ws.dec_io
        p = self.decode_projections(b)
        self.layers(p, b, io[0].data.ptr, io[1].data.ptr, io[2].data.ptr, decode=True)
        self.head(self.ws.x, b, io)

    def decode_projections(self, b: int) -> Projections:
        """How a decode step of b rows runs its projections (fixed per bucket: captured once)."""
        if self.split16_min_rows is not None and b >= self.split16_min_rows:
            return self.gemm
        if self.mmq is not None and b >= self.mmq.min_rows:
            return self.mmq
        return self.gemv

    def prompt_step(self, T: int) -> tuple[str, int]:
        """The projections of a prompt step of T tokens ("gemv", "mmq" or "gemm") and the rows it
        runs: T, or for "mmq" its bucket (the rows past T: padding on the scratch slot)."""
        return prompt_step(T, self.prompt_mmq_min, self.prompt_buckets, self.gemm_min_tokens)

    def prefill_key(self, T: int, n_items: int, max_pos: int) -> tuple[int, int, int, str]:
        """What fixes the launches of a prompt step of T tokens of n_items sequences whose last row
        sits at max_pos (a graph's key): the rows it runs, n_items, the attention plan's key
        splits, the projections."""
        kind, rows = self.prompt_step(T)
        splits = self._prefill_plan(rows, max_pos + 1).splits if self.flash else 0
        return rows, self.prompt_items(n_items, kind), splits, kind

    def prompt_items(self, n_items: int, kind: str) -> int:
        """The sequences a prompt step's head runs for n_items: on the GEMMs a power of two (up to
        the workspace's rows), so that their graph keys recur (the extra rows repeat row 0)."""
        if kind != "gemm":
            return n_items
        return min(1 << (n_items - 1).bit_length(), self.ws.max_rows)

    def prefill_step(self, T: int, n_items: int, max_pos: int) -> None:
        """A prompt step of T tokens of n_items sequences, launched eagerly; the inputs of its rows
        (prompt_step: T, or the bucket with its padding) in the workspace; ws.last_idx[:n_items]
        holds each item's last row; max_pos: the largest position among them."""
        self.max_pos = max_pos
        kind, rows = self.prompt_step(T)
        self.prefill_launches(rows, n_items, kind)

    def prefill_launches(self, T: int, n_items: int, kind: str) -> None:
        """The launches of a prompt step of T rows (self.max_pos set) on the projections of kind."""
        ws = self.ws
        p = {"gemv": self.gemv, "mmq": self.mmq, "gemm": self.gemm}[kind]
        self.layers(p, T, ws.tokens.data.ptr, ws.positions.data.ptr, ws.slots.data.ptr)
        ops.gather_rows(self.k, ws.x.data.ptr, ws.last_idx.data.ptr, ws.last.data.ptr, n_items, self.c.hidden)
        self.head(ws.last, n_items)
