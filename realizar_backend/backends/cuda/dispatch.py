"""The matrix-multiply dispatcher: the one place that decides which kernel multiplies each matrix
of a GPU step.

A step runs its projections in one of three families, chosen from its rows (`decode_step`,
`prompt_step`):
- "gemv": GEMVs, several activation rows per launch, each weight read once per 8 rows: MMVF
  (mmvf.cu, quantized blocks, fp32 activations, the RMSNorm before a projection folded into it),
  MMV8 (mmv8.cu, one-row steps of the MMV8_TYPES: the input quantized to 8 bits in the launch)
  or GEMV (gemv.cu, float matrices);
- "mmq": tensor-core matrix multiplies on the quantized blocks (a prep launch turns the input rows
  into row-scaled fp16 halves): MMQS (mmqs.cu, 16-row weight tiles, weights straight into the mma
  fragments) or MMQ (mmq.cu, 128-row tiles, each weight read once per 64 rows);
- "split16": the weights dequantized to fp16 (kept from start-up where memory allows,
  `Settings.prefill_weight_cache`), multiplied by cuBLAS on the tensor cores, one fp16 copy of each
  input or fp16 hi/lo halves at fp32-class accuracy (`Settings.gemm_precision`, split16.py): a cost
  that hardly grows with the rows.
Within a family a group of matrices that share an input (Q, K and V; gate and up) takes one
launch when every matrix of it has the family's kernel, and otherwise the GEMVs (`linear`,
`gated`). The LM head has its own rule (`head`), and so do a mixture of experts' router and routed
experts, in every family of step (`experts`).

Every threshold is an entry of the table below, with the rule that sets it.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Sequence

from gguf import GGMLQuantizationType as Q

from ...kernels.catalog import (ATT_SMEM_MAX, MMQ_BN, MMV8_SMEM_MAX, MMV8_XQ_BYTES, MMVF_SMEM_MAX, mmq_smem_bytes,
                                mmv8_ring_smem, mmv8_smem)
from .matrices import QTYPES, WeightRef
from .support import MOE_MAX_K

# ---------------------------------------------------------------- the table
# Decode steps of this many rows or more run on the tensor cores: mmq.cu reads each weight block once
# per 64 rows, the GEMVs once per 8, so the GEMVs lose once a step has a tile's worth of rows.
MMQ_MIN_ROWS = 8
# ... from this many already when every matrix of the model (the LM head included) has an mmqs.cu
# kernel: mmqs reads each weight once per 16 rows, and beats the 4-row GEMV on every matrix shape.
MMQS_MIN_ROWS = 4
# The LM head takes the tensor cores from this many rows where mmqs.cu has its type (its prep is
# paid back from two rows on); one row stays on the GEMV with the argmax folded in.
MMQS_HEAD_MIN_ROWS = 2
# mmqs.cu serves any rows in groups of 16, re-reading the weights per group: beyond 16 rows it keeps
# the matrices whose weights stay in L2 between groups (up to this many bytes a launch); larger
# ones (an LM head) take mmq.cu's 64-row tiles.
MMQS_MAX_ROWS = 16
MMQS_L2_BYTES = 64 << 20
# Decode steps of this many rows or more run on the kept split16 weights, read at GEMM speed once per
# step, by gemm_precision: fp16 (2 bytes a weight) past one mmqs.cu group of 16 rows (at 16 the two
# tie; beyond, mmqs.cu re-reads the weights per group and mmq.cu's tiles run far below both roofs);
# split (4 bytes a weight) from where that beats re-reading the quantized blocks per 64-row tile.
SPLIT16_MIN_ROWS = {"fp16": 17, "split": 64}
# mmq.cu's 8-bit-activation variant (mmq.MmqPrep(a8=True): each 32 activations quantized as mmv8.cu
# does, one int8 mma a unit) takes no step yet: at a 7B step's shapes it beats mmq.cu's fp16 tiles
# from 32 rows but not split16 where that runs, nor mmqs.cu at 16 rows (docs/performance.md). It
# gets a row here where a step of it beats the family that step takes.
# Prompt steps of up to this many tokens (short prompts, the tail after a cached prefix) run on the
# tensor-core projections, padded to a bucket (PROMPT_MIN_BUCKET, then multiples of 16: mmqs.cu's
# 8- and 16-row tiles) and replayed from one CUDA graph per bucket.
PROMPT_MMQ_TOKENS = 64
PROMPT_MIN_BUCKET = 8
# ... and up to this many where the fp16 weights are kept: past one mmqs.cu group of 16 rows a prompt
# step reads the quantized blocks once per group, the kept fp16 weights once at GEMM speed (the decode
# steps' rule, SPLIT16_MIN_ROWS["fp16"]).
PROMPT_MMQ_TOKENS_FP16_KEPT = 16
# Longer prompt steps run on the split16 GEMMs from this many tokens (fewer: the GEMVs, whose time
# grows with every row), sooner when the split weights are kept (no dequantize per step).
GEMM_MIN_TOKENS = 17
GEMM_MIN_TOKENS_KEPT = 12
# GEMM prompt steps run on their token count rounded up to this multiple (padding rows on the
# scratch slot), so that their launches recur as a few graph keys.
GEMM_ROW_STEP = 64
# split16 steps of split precision of up to this many rows pair each activation row's hi and lo
# halves into one GEMM row: the GEMMs of so few rows are bound by reading the split weights, which
# the pairs read once instead of 1.5 times; past it the GEMMs turn compute-bound and the pairs'
# extra products cost more.
SPLIT16_PAIRED_MAX_ROWS = 128
# The split16 weights (2 bytes a weight, 4 at split precision) are kept from start-up
# (`prefill_weight_cache=auto`) when they take at most this share of the device memory free before
# the KV pool is sized: the KV pool keeps the other half. Kept, a 64-row decode step reads them once
# at GEMM speed instead of re-reading the quantized blocks per mmq tile, and prompts skip a
# dequantize per GEMM; a 7-8B model's (14-16 GB) fit beside its KV pool on an 80 GB GPU, a 32B
# model's (64 GB) do not.
SPLIT16_KEEP_FREE_SHARE = 0.5

# One-row GEMV steps multiply a group of matrices sharing an input (q/k/v, gate/up, one projection)
# on mmv8.cu (the input quantized to 8 bits per 32 values by its own launch, mmv8_q8, then dp4a, 2
# blocks of 16 warps an SM: half the SM's warps where mmvf.cu's staged fp32 rows leave a quarter)
# instead of mmvf.cu when every type of the group is in MMV8_TYPES and the group holds at least
# MMV8_MIN_BYTES of weights: the second launch and each block's copy of the 8-bit row are a fixed
# cost that only a long stream of weights hides (1.5B: gate/up, the Q6_K down projections and the LM
# head take it; 7-8B: every group but the output projection; 32B: every group; every group on
# mmv8 made the 1.5B's decode 6% slower and the 7B's 1% faster). The LM head's argmax folds into
# either kernel. The types are those timed end to end; mmv8.cu can take MMV8_KERNEL_TYPES. The 8-bit
# input costs accuracy as llama.cpp's mmvq does (a relative error of ~1/254 per activation).
MMV8_TYPES: frozenset = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4})
MMV8_MIN_BYTES = 8 << 20

# The routed experts (model/transformer.py Experts) of every step run on moe.cu's per-pair GEMVs
# (MOE_PAIRS): each (row, expert) pair reads its expert's rows through the id the router wrote on the
# device, so a step's launches do not depend on the routing (a decode bucket stays one graph). A
# step of n rows reads its experts' weights once per pair that chose them, up to n * top_k times.
# The grouped path (MOE_GROUPED: the pairs bucketed per expert on the device, each expert's weights
# read once per tile of MOE_GROUPED_BN of its pairs on mmq.cu's tensor-core tiles) wins once pairs
# share experts, and takes the steps from MOE_GROUPED_MIN_ROWS rows where every expert matrix has an
# mmq.cu kernel: from two rows (16 pairs over 128 experts) its bucketing and tiles cost less than the
# pairs' second reads of shared experts; one row's 8 pairs read 8 distinct experts once either way,
# and the pairs skip the bucketing (benchmarks/moe_grouped_bench.py times both at Qwen3-30B-A3B's
# shapes). None would keep the pairs at every row count (the GPU tests run both paths).
MOE_GROUPED_MIN_ROWS: int | None = 2
# The pairs of a one-row step take mmv8.cu's GEMVs instead (MOE_PAIRS8: moe8_gate_up_nb1 and
# moe8_gemv_nb1, the input rows quantized to 8 bits first) where gate, up and down are one-row
# GEMV types (MMV8_TYPES, mmv8_ok) and gate and up share type and shape: moe.cu's pairs decode each
# unit to 32 floats and read 4 bytes of activation per weight, the 8-bit rows staged in shared
# memory once per block; and the down projection's inputs, a row per pair (up to MOE_MAX_K of them),
# fit mmv8_q8's scratch.
MOE_PAIRS8 = True
# Their down projection takes the combine into the residual with it (MOE8_COMBINE: mmv8.cu
# moe8_down_combine_nb1, each block staging its token's top_k gated rows and summing the pairs'
# outputs in moe_combine's order) where those rows fit a block's shared memory (moe8_combine_ok): one
# launch less a layer, and the pairs' outputs never go through memory; else moe8_gemv_nb1, then
# moe.cu's moe_combine.
MOE8_COMBINE = True
# The grouped tiles take mmq.cu's 8-bit records (mmq8_moe_bnBN, each 32 activations quantized as
# mmv8.cu's, as llama.cpp's MoE tiles take q8_1) where gate, up and down are all of the 8-bit
# variant's types (MMQ8_TYPES): one int8 mma a 32-column unit where the fp16 records take four, and
# under a third of the activation bytes staged a token tile; the others (the 2- and 3-bit I-quants,
# Q2_K, Q3_K) keep the fp16 records. The cost is accuracy, as llama.cpp's: a 32-value unit rounded to
# max/127 steps errs by about 0.5% rms of its values, and the experts' outputs take two such
# roundings (the rows h, then the gated rows, whose products have heavier tails).
MOE_GROUPED_A8 = True
# Its token-tile heights (mmq.cu mmq_moe_bnBN): a step takes the smallest that holds its mean pairs
# per expert (rows x top_k / experts), so that a uniform routing fills one tile per expert; at most the
# widest whose tile the device's block holds for the records it reads (SmemLimits.mmq_bn_max).
MOE_GROUPED_BN = (8, 16, 32, 64)
# The router ([experts, hidden], F32 in real files) takes the GEMVs in every step: E outputs a row
# are too few for a tensor-core tile to pay its prep. So does a shared expert's one-output gate. The
# shared expert itself (qwen35moe: a small gated MLP every token takes beside the routed experts) is
# a dense MLP and takes the dense projections' rule (linear(): its gate and up as one group, its down
# projection alone: the step's family); the model lists it so (model/transformer.py Experts).

# A linear-attention hybrid's Gated DeltaNet (kernels/deltanet.cu) runs a prompt step's segments token
# by token (dn_delta: a block per value head walks the segment, a few barriers a row). A segment of a
# live slot of at least DN_CHUNK_MIN_TOKENS rows runs its whole chunks of support.DN_CHUNK rows in the
# chunked form first (dn_chunk_k<dk>: per chunk the decay-weighted k.k and q.k products, a triangular
# solve per value column and one state update, its barriers a chunk's), the rows after them token
# by token; decode steps never do (their graphs are unchanged). The rule: the shortest segment timed
# on which the chunked pair beats dn_delta at Qwen3.5/3.6's heads (benchmarks/deltanet_chunk_bench.py:
# from 64 rows, the shortest it times, on); at least support.DN_CHUNK (a chunked segment holds a whole
# chunk). None would run every segment token by token.
DN_CHUNK_MIN_TOKENS: int | None = 64

# A block holds at most the device's opt-in shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin),
# its kernel's static shared memory included. The staged kernels' limits (catalog MMV8_SMEM_MAX with
# mmv8.cu's Q4_K rings, MMVF_SMEM_MAX, ATT_SMEM_MAX) fit sm_80 and sm_90; a device with less
# (smem_limits: sm_86 and sm_89 allow 99 KB) takes a lesser plan, never more than it allows:
# - mmv8.cu's kinds 1 and 2 drop the Q4_K ring (MMV8_RING 0: the register path, a module of its own
#   options compiled by NVRTC) where a block cannot hold the ring beside a staged row of
#   MMV8_SMEM_MAX: the ring only feeds Q4_K weights faster, the staged row is what a row needs;
# - each family's staged rows shrink to what the block has left, SMEM_STATIC_RESERVE kept for the
#   kernel's own static shared memory (the staged kernels' reductions; the largest,
#   moe8_down_combine's per-pair sums, takes 2 KB): a row longer than that takes the path of rows too
#   long to stage (mmv8_ok, moe8_combine_ok, ops.mmvf_stage_ok), as rows past the constants do;
# - mmq.cu's token tiles (mmq.plan, moe_grouped_plan) are at most the widest of MMQ_BN whose tile
#   (catalog.mmq_smem_bytes, of the records the launch reads: fp16 or 8-bit) fits what the block has
#   left beside the same reserve: more tokens take more tiles of that width (mmq.plan's token tiles),
#   the grouped experts more tiles an expert. 99 KB holds the 8-bit records' tiles at every width and
#   the fp16 records' up to 32 tokens (64: 110 KB).
SMEM_STATIC_RESERVE = 4096

# Dispatcher.linear's and gated's choices remembered at most (all dropped when full): a model's groups
# times the step shapes a server runs at once
CHOICE_MEMO = 8192

# the kinds of projection groups the dense families multiply (model/transformer.py projections);
# "router" and "experts" have their own rule (Dispatcher.experts)
DENSE_KINDS = ("linear", "gated")

# the quant types of each kernel (the rest of QTYPES: float matrices). Q2_K has no tensor-core
# kernel: its mins per 16 columns would need activation sums per 16 columns, and the prep's records
# hold them per 32 (a Q2_K matrix runs on the GEMVs, and prompts on split16).
_LOWBIT = {Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S}
MMQ_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, *_LOWBIT})     # mmq.cu
MMQS_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, *_LOWBIT})                    # mmqs.cu
MMV8_KERNEL_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                               Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4})                               # mmv8.cu
# mmq.cu's 8-bit variant (mmq_takes under MMQ_A8): mmv8.cu's types (the QUnit types of common.cuh and
# the 4-bit level types)
MMQ8_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
                        Q.MXFP4})


class Kernel(enum.Enum):
    MMVF = "mmvf"
    MMV8 = "mmv8"
    GEMV = "gemv"
    MMQS = "mmqs"
    MMQ = "mmq"
    SPLIT16 = "split16"
    MOE_PAIRS = "moe_pairs"
    MOE_PAIRS8 = "moe_pairs8"
    MOE_GROUPED = "moe_grouped"


@dataclass(frozen=True)
class Step:
    family: str          # "gemv" | "mmq" | "split16"
    rows: int            # rows the step runs (padding included)


@dataclass(frozen=True)
class Choice:
    """The kernels of one group of matrices sharing an input: one per matrix; `fused`: gate and up
    in one launch that applies the activation on the way out."""
    kernels: tuple[Kernel, ...]
    fused: bool = False

    @functools.cached_property
    def kernel(self) -> Kernel | None:
        """The group's one kernel when every matrix takes it (one launch), else None (worked out
        once: the families ask for it per launch, of a choice the dispatcher remembers)."""
        return self.kernels[0] if len(set(self.kernels)) == 1 else None


@dataclass(frozen=True)
class ExpertsChoice:
    """The kernels of a routed-experts block: the router's GEMV, the experts' family, and whether
    gate and up take one launch (same type and shape) that applies the activation on the way out."""
    router: Kernel
    experts: Kernel
    fused: bool
    shared: tuple[Kernel, ...] = ()      # a shared expert's gate, up, down and gate logit
    a8: bool = False                     # the grouped experts on 8-bit records (moe_grouped_a8)


@dataclass(frozen=True)
class SmemLimits:
    """The staged kernels' shared memory on one device (smem_limits): bytes of staged rows a block of
    mmv8.cu (8-bit rows), mmvf.cu (fp32 rows) and attention.cu (its prompt tiles) may take, and
    whether mmv8.cu's kinds 1 and 2 keep the Q4_K ring after their row."""
    optin: int | None = None             # the device's opt-in bytes a block; None: not read (sm_80 / sm_90's plan)
    mmv8_rows: int = MMV8_SMEM_MAX
    mmvf_rows: int = MMVF_SMEM_MAX
    attention: int = ATT_SMEM_MAX
    mmv8_ring: bool = True
    mmq_bn: int = MMQ_BN[-1]             # mmq.cu's widest token tile on fp16 records
    mmq8_bn: int = MMQ_BN[-1]            # on 8-bit records (MMQ_A8)

    def mmq_bn_max(self, a8: bool = False) -> int:
        """The widest token tile of mmq.cu's launches on 8-bit (a8) or fp16 records (mmq.plan's and
        moe_grouped_plan's bn_max)."""
        return self.mmq8_bn if a8 else self.mmq_bn

    def mmv8_smem(self, kind: int) -> int:
        """The dynamic shared memory the loader allows mmv8.cu's module of `kind`: its staged rows,
        then its rings (none without the ring)."""
        return self.mmv8_rows + mmv8_ring_smem(kind, self.mmv8_ring)

    def reductions(self) -> list[str]:
        """What this plan takes below sm_80 / sm_90's, in words (for the loader's log)."""
        full, out = FULL_SMEM, []
        if not self.mmv8_ring:
            out.append("mmv8.cu without its Q4_K ring (MMV8_RING 0)")
        for name, have, want in (("mmv8.cu's staged rows", self.mmv8_rows, full.mmv8_rows),
                                 ("mmvf.cu's staged rows", self.mmvf_rows, full.mmvf_rows),
                                 ("attention.cu's tiles", self.attention, full.attention)):
            if have < want:
                out.append(f"{name} up to {have} bytes (not {want})")
        for a8 in (False, True):
            if self.mmq_bn_max(a8) < full.mmq_bn_max(a8):
                out.append(f"mmq.cu's token tiles of {'8-bit' if a8 else 'fp16'} records up to "
                           f"{self.mmq_bn_max(a8)} tokens (not {full.mmq_bn_max(a8)})")
        return out


FULL_SMEM = SmemLimits()


def mmq_bn_fit(room: int, a8: bool) -> int:
    """The widest of MMQ_BN whose mmq.cu tile (fp16 or 8-bit records: a8) takes at most `room` bytes
    of dynamic shared memory (the narrowest where none does: its launches are refused by name)."""
    return max((bn for bn in MMQ_BN if mmq_smem_bytes(bn, a8) <= room), default=MMQ_BN[0])


def smem_limits(optin: int | None) -> SmemLimits:
    """The staged kernels' plan on a device whose blocks may hold `optin` bytes of shared memory
    (None: unknown, the full plan), by the rule above: sm_80 and sm_90 keep FULL_SMEM's limits."""
    if optin is None:
        return FULL_SMEM
    room = optin - SMEM_STATIC_RESERVE
    ring = all(MMV8_SMEM_MAX + mmv8_ring_smem(kind) <= room for kind in (1, 2))
    return SmemLimits(optin, min(MMV8_SMEM_MAX, room), min(MMVF_SMEM_MAX, room), min(ATT_SMEM_MAX, room), ring,
                      mmq_bn_fit(room, False), mmq_bn_fit(room, True))


# ---------------------------------------------------------------- what each kernel takes
def mmvf_ok(w: WeightRef) -> bool:
    """mmvf.cu: quantized types, whole 32-weight units per row (every quantized type has them)."""
    return QTYPES[w.qtype].blocks and w.cols % 32 == 0


def moe8_combine_ok(down: WeightRef, top_k: int, smem: SmemLimits = FULL_SMEM) -> bool:
    """MOE_PAIRS8's down projection and combine in one launch (MOE8_COMBINE): the token's top_k
    8-bit rows of down.cols values within a block's shared memory (the device's: smem)."""
    return MOE8_COMBINE and 1 <= top_k <= MOE_MAX_K and top_k * mmv8_smem(down.cols) <= smem.mmv8_rows


def mmv8_ok(w: WeightRef, smem: SmemLimits = FULL_SMEM) -> bool:
    """mmv8.cu: its types, with the input row's 8-bit form within its shared memory (the device's: smem)."""
    return w.qtype in MMV8_KERNEL_TYPES and mmvf_ok(w) and mmv8_smem(w.cols) <= smem.mmv8_rows


def mmq_ok(w: WeightRef) -> bool:
    """mmq.cu: its types, whole blocks per row."""
    return w.qtype in MMQ_TYPES and w.cols % QTYPES[w.qtype].block == 0


def mmq8_ok(w: WeightRef) -> bool:
    """mmq.cu's 8-bit variant (-DMMQ_A8): the types whose integers fit int8 (mmq_takes)."""
    return w.qtype in MMQ8_TYPES and mmq_ok(w)


def mmqs_ok(w: WeightRef) -> bool:
    """mmqs.cu: its types, rows of whole 64-weight items."""
    return w.qtype in MMQS_TYPES and mmq_ok(w) and w.cols % 64 == 0


def same_shape(a: WeightRef, b: WeightRef) -> bool:
    """One launch takes both (gate and up): type, shape and (stacks of experts) expert count alike."""
    return (a.qtype, a.rows, a.cols, a.row_bytes, a.experts) == (b.qtype, b.rows, b.cols, b.row_bytes, b.experts)


def mmqs_takes(mats: Sequence[WeightRef], rows: int) -> bool:
    """A tensor-core launch over mats (every one mmq_ok) at `rows` rows runs on mmqs.cu: up to
    MMQS_MAX_ROWS rows, and beyond for launches of up to MMQS_L2_BYTES of weights."""
    return all(mmqs_ok(w) for w in mats) and (
        rows <= MMQS_MAX_ROWS or sum(w.rows * w.row_bytes for w in mats) <= MMQS_L2_BYTES)


def moe_grouped_ok(gate: WeightRef, up: WeightRef, down: WeightRef) -> bool:
    """The grouped experts take the stacks: gate and up of one type and shape (one fused launch),
    every matrix on mmq.cu."""
    return same_shape(gate, up) and all(mmq_ok(w) for w in (gate, up, down))


def moe_grouped_a8(gate: WeightRef, up: WeightRef, down: WeightRef) -> bool:
    """The grouped experts' launches read 8-bit records (MOE_GROUPED_A8's rule)."""
    return MOE_GROUPED_A8 and all(mmq8_ok(w) for w in (gate, up, down))


def moe_grouped_plan(rows: int, top_k: int, experts: int, bn_max: int = MOE_GROUPED_BN[-1]) -> tuple[int, int]:
    """(bn, tiles): a grouped step's token-tile height (MOE_GROUPED_BN, at most bn_max: the device's
    SmemLimits.mmq_bn_max of the records the launches read) and the token tiles its launches cover,
    a bound that holds for any routing: an expert with c > 0 pairs takes ceil(c / bn) <= (c + bn - 1)
    / bn tiles, so P = rows x top_k pairs over at most min(E, P) experts take at most
    (P + min(E, P) (bn - 1)) // bn."""
    P = rows * top_k
    widths = [b for b in MOE_GROUPED_BN if b <= bn_max] or [MOE_GROUPED_BN[0]]
    bn = next((b for b in widths if b * experts >= P), widths[-1])
    return bn, (P + min(experts, P) * (bn - 1)) // bn


def prompt_buckets(max_tokens: int = PROMPT_MMQ_TOKENS) -> tuple[int, ...]:
    """Row counts of the prompt steps on the tensor-core projections, for steps of up to
    max_tokens: PROMPT_MIN_BUCKET, the multiples of 16 below max_tokens, max_tokens."""
    if max_tokens <= 0:
        return ()
    return tuple(sorted({min(PROMPT_MIN_BUCKET, max_tokens), max_tokens, *range(16, max_tokens, 16)}))


class Dispatcher:
    def __init__(self, groups: Sequence[tuple[str, tuple[WeightRef, ...]]], head: WeightRef, split16_kept: bool,
                 precision: str = "fp16", smem: SmemLimits = FULL_SMEM):
        """groups: every group of matrices the model's steps multiply (the model's `projections()`:
        ("linear" | "gated" | "router" | "experts", mats)); head: the LM head; split16_kept: the
        split16 weights are kept on the device, at `precision` (Settings.gemm_precision); smem: the
        device's staged-row limits (smem_limits; the Kernels' `smem`). The
        families of steps are chosen from the dense groups (DENSE_KINDS): the router and experts
        run on their own kernels in every family."""
        self.head_matrix = head
        self.smem = smem
        self.split16_kept = split16_kept
        self.split16_min_rows = SPLIT16_MIN_ROWS[precision]
        # linear's and gated's choices by (family, rows, the matrices' identities): a step asks for
        # the same few hundred on every step of its shape (each entry keeps its matrices, so that
        # their identities stay theirs; a WeightRef's type and shape never change)
        self._choices: dict[tuple, tuple[Choice, tuple]] = {}
        groups = [(kind, g) for kind, g in groups if kind in DENSE_KINDS]
        mats = [w for _, g in groups for w in g]
        # every group on the tensor cores: prompt steps may take them (else the GEMVs would take
        # the rest of such a step, whose time grows with every row)
        self.mmq_all = all(self._mmq_group(kind, g) for kind, g in groups)
        self.mmqs_all = self.mmq_all and mmq_ok(head) and all(mmqs_ok(w) for w in mats + [head])
        self.mmq_min_rows = MMQS_MIN_ROWS if self.mmqs_all else MMQ_MIN_ROWS
        fp16_kept = split16_kept and precision == "fp16"
        self.buckets = (prompt_buckets(PROMPT_MMQ_TOKENS_FP16_KEPT if fp16_kept else PROMPT_MMQ_TOKENS)
                        if self.mmq_all else ())
        self.gemm_min_tokens = GEMM_MIN_TOKENS_KEPT if split16_kept else GEMM_MIN_TOKENS

    @staticmethod
    def _mmq_group(kind: str, mats: Sequence[WeightRef]) -> bool:
        ok = all(mmq_ok(w) for w in mats)
        return ok and (kind != "gated" or same_shape(*mats))

    # ------------------------------------------------------------ steps
    def decode_step(self, b: int) -> Step:
        """The family of a decode step of b rows (a bucket: fixed per bucket, captured once)."""
        if self.split16_kept and b >= self.split16_min_rows:
            return Step("split16", b)
        if b >= self.mmq_min_rows:
            return Step("mmq", b)
        return Step("gemv", b)

    def prompt_step(self, T: int) -> Step:
        """The family of a prompt step of T tokens and the rows it runs: a tensor-core step at its
        bucket, a GEMM step at T rounded up to GEMM_ROW_STEP, or T rows on the GEMVs."""
        if self.buckets and self.mmq_min_rows <= T <= self.buckets[-1]:
            return Step("mmq", next(b for b in self.buckets if b >= T))
        if T >= self.gemm_min_tokens:
            return Step("split16", -(-T // GEMM_ROW_STEP) * GEMM_ROW_STEP)
        return Step("gemv", T)

    # ------------------------------------------------------------ matrices
    @staticmethod
    def _gemv(mats: Sequence[WeightRef], rows: int = 0, smem: SmemLimits = FULL_SMEM) -> tuple[Kernel, ...]:
        """The GEMV of each matrix in a step of `rows` rows: the group on mmv8.cu by the rule of
        MMV8_TYPES (one-row steps only, rows within the device's limit: smem), else each on mmvf.cu
        where it takes the type."""
        if rows == 1 and mats and all(w.qtype in MMV8_TYPES and mmv8_ok(w, smem) for w in mats) \
                and sum(w.rows * w.row_bytes for w in mats) >= MMV8_MIN_BYTES:
            return (Kernel.MMV8,) * len(mats)
        return tuple(Kernel.MMVF if mmvf_ok(w) else Kernel.GEMV for w in mats)

    def _remember(self, key: tuple, mats: tuple, choice: Choice) -> Choice:
        if len(self._choices) >= CHOICE_MEMO:
            self._choices.clear()
        self._choices[key] = (choice, mats)
        return choice

    def linear(self, step: Step, mats: Sequence[WeightRef]) -> Choice:
        """The kernels of projections that share one input (remembered per step shape and matrices)."""
        key = (step.family, step.rows, *map(id, mats))
        hit = self._choices.get(key)
        return hit[0] if hit is not None else self._remember(key, tuple(mats), self._linear(step, mats))

    def _linear(self, step: Step, mats: Sequence[WeightRef]) -> Choice:
        if step.family == "split16":
            return Choice((Kernel.SPLIT16,) * len(mats))
        if step.family == "mmq" and self._mmq_group("linear", mats):
            return Choice(((Kernel.MMQS if mmqs_takes(mats, step.rows) else Kernel.MMQ),) * len(mats))
        return Choice(self._gemv(mats, step.rows, self.smem))

    def gated(self, step: Step, gate: WeightRef, up: WeightRef) -> Choice:
        """The kernels of act(gate) * up: fused into one launch where both share type and shape
        (remembered per step shape and matrices)."""
        key = ("gated", step.family, step.rows, id(gate), id(up))
        hit = self._choices.get(key)
        return hit[0] if hit is not None else self._remember(key, (gate, up), self._gated(step, gate, up))

    def _gated(self, step: Step, gate: WeightRef, up: WeightRef) -> Choice:
        fused = same_shape(gate, up)
        if step.family == "split16":
            return Choice((Kernel.SPLIT16,) * 2, True)
        if step.family == "mmq" and self._mmq_group("gated", (gate, up)):
            return Choice(((Kernel.MMQS if mmqs_takes((gate, up), step.rows) else Kernel.MMQ),) * 2, True)
        return Choice(self._gemv((gate, up), step.rows, self.smem), fused)

    def head(self, rows: int) -> Kernel:
        """The LM head's kernel for `rows` rows (its argmax folded in wherever the kernel can: mmvf.cu
        and mmv8.cu): a one-row step takes the GEMVs' rule (mmv8.cu for a large head of its types)."""
        w = self.head_matrix
        if mmq_ok(w) and rows >= (MMQS_HEAD_MIN_ROWS if self.mmqs_all else self.mmq_min_rows):
            return Kernel.MMQS if mmqs_takes((w,), rows) else Kernel.MMQ
        return self._gemv((w,), rows, self.smem)[0]

    def experts(self, step: Step, router: WeightRef, gate: WeightRef, up: WeightRef,
                shared: Sequence[WeightRef] = (), down: WeightRef | None = None) -> ExpertsChoice:
        """The kernels of a routed-experts block in a step (the rules of MOE_GROUPED_MIN_ROWS and the
        router's above; the grouped path needs the down projection's stack), and of its shared
        expert where it has one: its gate and up, and its down projection, linear()'s for the step;
        its gate logit a GEMV."""
        grouped = (MOE_GROUPED_MIN_ROWS is not None and step.rows >= MOE_GROUPED_MIN_ROWS
                   and down is not None and moe_grouped_ok(gate, up, down))
        pairs8 = (MOE_PAIRS8 and step.rows == 1 and down is not None and same_shape(gate, up)
                  and all(w.qtype in MMV8_TYPES and mmv8_ok(w, self.smem) for w in (gate, up, down))
                  and MOE_MAX_K * mmv8_smem(down.cols) <= MMV8_XQ_BYTES)
        kind = Kernel.MOE_GROUPED if grouped else Kernel.MOE_PAIRS8 if pairs8 else Kernel.MOE_PAIRS
        kshared = ()
        if shared:
            sg, su, sd, sr = shared
            kshared = (*self.linear(step, (sg, su)).kernels, self.linear(step, (sd,)).kernels[0],
                       self._gemv((sr,))[0])
        return ExpertsChoice(self._gemv((router,))[0], kind, same_shape(gate, up), kshared,
                             grouped and moe_grouped_a8(gate, up, down))

    @staticmethod
    def split16_paired(rows: int, capacity: int) -> bool:
        """A split16 step pairs its rows' halves (see SPLIT16_PAIRED_MAX_ROWS) while 2 x rows fit
        the workspace."""
        return rows <= SPLIT16_PAIRED_MAX_ROWS and 2 * rows <= capacity
