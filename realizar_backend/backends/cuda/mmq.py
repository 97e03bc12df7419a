"""Batched decode projections on the tensor cores (kernels/mmq.cu): launchers, the launch plan
(token-tile width, K split) and the buffers they need. A step of M sequences reads each weight
block once per 64 tokens (the GEMVs of mmvf.cu once per 8), with fp32-class results.

A projection is two launches: `prep` (the input rows, RMSNorm folded in or not, as row-scaled
fp16 hi/lo halves and unit sums in an MmqPrep buffer), then `mmq` (up to three segments sharing
the input: Q, K, V with biases; or one matrix, adding into the residual; the LM head with its
fused argmax) or `mmq_ffn` (gate and up, a = act(g) * u). One prep serves every launch on the same
input. Launches allocate nothing and never synchronize: buffers come from MmqPrep and MmqScratch,
sized once for the largest batch, so the sequence can be captured in a CUDA graph.

8-bit activations (`MmqPrep(..., a8=True)`): the prep quantizes each 32 values of a row to int8 with
their own scale (the q8_1 scheme of mmv8.cu) and mmq / mmq_ffn run mmq.cu's -DMMQ_A8 modules (one
int8 mma per 32-column unit and 16 x 8 piece, a quarter of the fp16 variant's mma instructions and
under a third of its activation bytes), for the types of dispatch.MMQ8_TYPES; results are those of W @ the
quantized activations, within fp32 roundings; mmq_moe (the grouped experts) as well. mmqs.cu takes
fp16 records only.

The dispatcher (dispatch.py) sends launches to kernels/mmqs.cu instead (`small`: same prep, same
numerics): one block per 16 weight rows and token group of up to 16 rows, its warps splitting K,
weights straight from memory into the mma fragments (`small_warps`: warps per block).
Where those blocks would leave SMs empty (1536-row projections at up to 16 rows), a
thread-block cluster of blocks shares each tile's K (`small_cluster`, sm_90).

The plan: token tiles of 8, 16, 32 or 64 (the smallest that holds M; larger M takes several tiles
of 64, whose CTAs run side by side and share each weight block through L2), at most the widest whose
tile the device's block holds (bn_max: its SmemLimits.mmq_bn_max of the records read, 32 for fp16
records on a 99 KB block; more tokens take more tiles of that width); 128-row weight tiles
(FFN: 64 gate + 64 up rows). When tiles x token tiles cannot fill the GPU (1536-row
projections), K is split over CTAs; the last CTA of a tile adds the partial sums in a fixed order
(deterministic), bounded so that it reads at most MAX_PARTIAL_READ bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import cupy
import numpy as np
from gguf import GGMLQuantizationType as Q

from .dispatch import MMQ8_TYPES, MMQS_TYPES, mmq_ok, mmqs_ok, mmqs_takes, same_shape
from .modules import MMQ_BN, mmq_smem_bytes
from .pdl import clusters_ok
from .ops import WeightRef, _launch, device_smem

if TYPE_CHECKING:
    from .modules import Kernels

_U64, _I32, _I64, _F32 = np.uint64, np.int32, np.int64, np.float32
THREADS, BM, KC, REC = 256, 128, 128, 528       # kernels/mmq.cu MMQ_THREADS, MMQ_BM, MMQ_KC, MMQ_REC
REC8 = 160                                       # MMQ_REC of the 8-bit variant (-DMMQ_A8=1)
PREP_THREADS = 1024                              # MMQ_PREP_THREADS
ACC = {8: 4, 16: 8, 32: 16, 64: 32}             # accumulators per thread of mmq_bnBN (MT * NT * 4)
SMALL_MAX_WARPS = 8                              # MMQS_MAXW
SMALL_WARPS_PER_SM = 16                          # the warps a launch aims to keep on each SM
SMALL_MIN_WARPS = 4
SMALL_REGS = 128                                 # registers a thread of mmqs.cu (__launch_bounds__(256, 2))
SM_REGS = 65536                                  # registers an SM (sm_80, sm_90)
SMALL_MAX_CLUSTER = 4                            # blocks per cluster sharing one tile's K (1: none)
SMALL_CLUSTER_MIN_ITEMS = 4                      # 64-column items each warp of a cluster keeps (small_cluster)
CTAS_PER_SM = 2                                  # __launch_bounds__(256, 2): the K split aims at one such wave
MAX_PARTIAL_READ = 384 * 1024                    # bytes of partial sums the last CTA of a split tile reads


def small_warps(tiles: int, K: int, sm_count: int, cluster: int = 1) -> int:
    """Warps per block of an mmqs launch of `tiles` 16-row tiles (blocks: tiles x cluster): enough
    for SMALL_WARPS_PER_SM warps on every SM, at least SMALL_MIN_WARPS (a launch of many tiles, as
    an LM head's, still needs warps to keep its loads in flight), at most one per 64-column item of
    K among the cluster's warps; then fewer, where that takes a last wave of blocks off
    (`small_cost`)."""
    items = K // 64 // cluster
    want = max(SMALL_MIN_WARPS, -(-SMALL_WARPS_PER_SM * sm_count // (tiles * cluster)))
    w0 = max(1, min(SMALL_MAX_WARPS, items, want))
    return min(range(2, w0 + 1), key=lambda w: (small_cost(tiles * cluster, items, w, sm_count), -w), default=w0)


def small_cost(blocks: int, items: int, warps: int, sm_count: int) -> int:
    """A launch's time in units of one warp's 64-column item: waves of blocks (as many a block as
    the SM's registers hold at SMALL_REGS a thread) x the items each warp takes. A gate/up launch of
    560 blocks at 4 warps (4 blocks an SM, 132 SMs) is two waves, the second of 32 blocks; at 3 (5
    an SM) one."""
    per_sm = max(1, SM_REGS // (SMALL_REGS * 32 * warps))
    return -(-blocks // (per_sm * sm_count)) * -(-items // warps)


def small_cluster(tiles: int, K: int, sm_count: int, limit: int | None = None) -> int:
    """Blocks per cluster of an mmqs launch of `tiles` blocks (16-row tiles x token groups): doubled
    while the launch leaves SMs without a block and K is long enough that every warp of the larger
    cluster, at SMALL_MAX_WARPS a block, keeps SMALL_CLUSTER_MIN_ITEMS 64-column items; at most
    limit (None: SMALL_MAX_CLUSTER). Short K (a few items a warp) stays unclustered: there the
    cluster's barriers cost more than the idle SMs gain."""
    limit = SMALL_MAX_CLUSTER if limit is None else limit
    c = 1
    while (2 * c <= limit and tiles * c < sm_count
           and K // 64 >= 2 * c * SMALL_MAX_WARPS * SMALL_CLUSTER_MIN_ITEMS):
        c *= 2
    return c


def prep_row_bytes(K: int, a8: bool = False) -> int:
    """Bytes per activation row of an MmqPrep buffer for inputs of K values (a8: int8 records)."""
    return -(-K // KC) * (REC8 if a8 else REC)


def tile_width(M: int, bn_max: int = MMQ_BN[-1]) -> int:
    """Tokens per CTA tile: the smallest width up to bn_max that holds M, else bn_max (several tiles)."""
    widths = [bn for bn in MMQ_BN if bn <= bn_max] or [MMQ_BN[0]]
    return next((bn for bn in widths if bn >= M), widths[-1])


@dataclass(frozen=True)
class Plan:
    bn: int                  # token-tile width (kernel mmq_bnBN)
    tiles: int               # weight-row tiles over all segments
    token_tiles: int
    splits: int              # K ranges per tile
    cps: int                 # 128-column chunks per K range
    partial_floats: int      # scratch the split needs (0: no split)
    counters: int

    @property
    def grid(self) -> int:
        return self.tiles * self.splits * self.token_tiles


def plan(M: int, K: int, rows: tuple[int, ...], ffn: bool, sm_count: int, splits: int | None = None,
         bn_max: int = MMQ_BN[-1]) -> Plan:
    """The launch of one projection: M tokens, K inputs, the output rows of each segment (ffn: the
    gate's), on sm_count SMs. splits: force the K split (a benchmark's sweep); None: the plan's.
    bn_max: the widest token tile (the device's SmemLimits.mmq_bn_max of the records read)."""
    bn = tile_width(M, bn_max)
    tb = -(-M // bn)
    tiles = -(-rows[0] // (BM // 2)) if ffn else sum(-(-n // BM) for n in rows)
    nch = -(-K // KC)
    if splits is None:
        splits = 1
        base = tiles * tb
        if base < sm_count:
            cap = max(1, MAX_PARTIAL_READ // (THREADS * ACC[bn] * 4))
            splits = min(-(-CTAS_PER_SM * sm_count // base), cap, nch)
    splits = max(1, min(splits, nch))
    cps = -(-nch // splits)
    splits = -(-nch // cps)                  # no empty K range
    split = splits > 1
    return Plan(bn, tiles, tb, splits, cps, tiles * tb * splits * THREADS * ACC[bn] if split else 0,
                tiles * tb if split else 0)


class MmqPrep:
    """The split activation rows of up to M tokens of up to K values (prep's output, mmq's input):
    records of 528 bytes per 128 columns, and 1/s per row. a8: the 8-bit variant's records (160
    bytes per 128 columns: int8 values and a scale and sum per 32), which select it in mmq / mmq_ffn."""

    def __init__(self, M: int, K: int, a8: bool = False):
        self.M, self.K, self.a8 = M, K, a8
        self.rec = cupy.empty(max(1, M * prep_row_bytes(K, a8)), cupy.uint8)
        self.inv = cupy.empty(max(1, M), cupy.float32)
        self.filled = (0, 0)                # (M, K) of the last prep launch: a host-side check

    @property
    def nbytes(self) -> int:
        return self.rec.nbytes + self.inv.nbytes


class MmqScratch:
    """Partial sums and per-tile counters of the launches that split K. The counters start at zero
    and every launch leaves them at zero; launches sharing one scratch must run in stream order."""

    def __init__(self, partial_floats: int, counters: int):
        self.part = cupy.empty(max(1, partial_floats), cupy.float32)
        self.cnt = cupy.zeros(max(1, counters), cupy.uint32)

    @classmethod
    def for_shapes(cls, M_max: int, shapes, sm_count: int, bn_max: tuple[int, ...] = (MMQ_BN[-1],)) -> "MmqScratch":
        """Big enough for every batch size up to M_max and every shape (K, rows of each segment,
        ffn) of shapes, planned under each token-tile limit of bn_max (need_scratch): what a forward
        pass allocates once."""
        need = need_scratch(M_max, shapes, sm_count, bn_max)
        return cls(*need)

    @property
    def nbytes(self) -> int:
        return self.part.nbytes + self.cnt.nbytes


def need_scratch(M_max: int, shapes, sm_count: int, bn_max: tuple[int, ...] = (MMQ_BN[-1],)) -> tuple[int, int]:
    """(partial floats, counters) that MmqScratch needs for batch sizes 1..M_max and shapes
    [(K, (rows, ...), ffn)], each planned under every token-tile limit of bn_max: the limits of the
    launches sharing the scratch (the device's SmemLimits.mmq_bn_max of each kind of records they
    read: bn_limits), as those launches plan (a narrower tile takes more token tiles, each with its
    counter, and may split K more ways)."""
    p = c = 0
    for M in range(1, M_max + 1):
        for K, rows, ffn in shapes:
            for bn in set(bn_max):
                pl = plan(M, K, tuple(rows), ffn, sm_count, bn_max=bn)
                p, c = max(p, pl.partial_floats), max(c, pl.counters)
    return p, c


def bn_limits(k, a8: tuple[bool, ...] = (False,)) -> tuple[int, ...]:
    """The token-tile limits (SmemLimits.mmq_bn_max) of launches on the device of k on records of
    each kind in a8 (fp16: False, 8-bit: True): the bn_max of the buffers those launches share
    (need_scratch, experts.GroupedBuffers)."""
    return tuple(device_smem(k).mmq_bn_max(v) for v in a8)


def _sm_count(k) -> int:
    return getattr(k, "sm_count", 132)


def prep_splits(M: int, K: int, sm_count: int) -> int:
    """Blocks a row of a prep launch of M rows of K values: its rounds of 32 units (one a warp) dealt
    over blocks while the launch has fewer blocks than SMs. Each block reads the whole row and writes
    its rounds' records: at 4 rows of 8,960 the records of one block were 9 rounds of warp sums."""
    rounds = -(-4 * -(-K // KC) // (PREP_THREADS // 32))
    return max(1, min(rounds, sm_count // max(1, M)))


def prep(k: "Kernels", x: int, xs: int, M: int, K: int, out: MmqPrep, norm=None, pdl: bool = False) -> None:
    """Rows x[:M, :K] (fp32, row stride xs floats) -> out; norm = (weight pointer, eps): the rows
    are RMSNorm(x) * weight, computed in the launch."""
    if K % 32 or M < 1 or M > out.M or K > out.K:
        raise ValueError(f"mmq.prep: {M} rows of {K} (K % 32 == 0) do not fit a buffer of {out.M} x {out.K}")
    nw, eps = norm if norm is not None else (0, 0.0)
    _launch((k.mmq8 if out.a8 else k.mmq)["prep"], (M, prep_splits(M, K, _sm_count(k))), (PREP_THREADS,),
            (_U64(x), _I32(xs), _I32(M), _I32(K), _U64(nw), _F32(eps), _U64(out.rec.data.ptr),
             _I64(prep_row_bytes(K, out.a8)), _U64(out.inv.data.ptr)), 0, pdl)
    out.filled = (M, K)


def _check(kind: str, mats, K: int, p: MmqPrep, M: int, a8: bool | None = None) -> bool:
    """Raises where the launch cannot run; returns whether it runs on the 8-bit variant (a8: as asked,
    None: as the prep buffer's records are)."""
    if a8 is None:
        a8 = p.a8
    if a8 != p.a8:
        raise ValueError(f"{kind}: the prep buffer holds {'int8' if p.a8 else 'fp16'} records; "
                         f"the {'8-bit' if a8 else 'fp16'} variant reads the other kind (MmqPrep(..., a8=))")
    for w in mats:
        if not mmq_ok(w) or w.cols != K or (a8 and w.qtype not in MMQ8_TYPES):
            raise ValueError(f"{kind}: {w.name} ({getattr(w.qtype, 'name', w.qtype)}, {w.rows} x {w.cols}) "
                             f"has no {'8-bit ' if a8 else ''}tensor-core kernel for K = {K}")
    if M < 1:
        raise ValueError(f"{kind}: no rows (M = {M})")
    if p.filled[1] != K or M > p.filled[0]:
        raise ValueError(f"{kind}: the prep buffer holds {p.filled[0]} rows of {p.filled[1]}, not {M} of {K}: "
                         "call mmq.prep on this input first")
    return a8


def _block_fits(k, kernel: str, smem: int) -> None:
    """A tile of `smem` bytes of dynamic shared memory within the device's opt-in bytes a block (its
    Kernels.smem): else refused by name here, not by the driver at launch. The plans keep within it
    (their bn_max); this is the last check, for a tile width asked for outright (sm_86 and sm_89's
    99 KB hold no 64-token tile of fp16 records)."""
    optin = device_smem(k).optin
    if optin is not None and smem > optin:
        raise ValueError(f"{kernel}: its tiles need {smem} bytes of shared memory; this device allows a block {optin}")


def _launch_mmq(k, pl: Plan, seg_args: list, K: int, p: MmqPrep, M: int, mode: int, act: int, accumulate: bool,
                scratch: MmqScratch, amax: int, pdl: bool) -> None:
    if pl.partial_floats > scratch.part.size or pl.counters > scratch.cnt.size:
        raise ValueError(f"mmq: the scratch holds {scratch.part.size} partial sums and {scratch.cnt.size} counters; "
                         f"this launch needs {pl.partial_floats} and {pl.counters} (size it with "
                         "MmqScratch.for_shapes over every shape and batch size)")
    _block_fits(k, f"mmq{'8' if p.a8 else ''}_bn{pl.bn}", mmq_smem_bytes(pl.bn, p.a8))
    for _ in range(3 - len(seg_args) // 7):
        seg_args += [_U64(0), _I64(0), _I32(0), _I32(0), _U64(0), _U64(0), _I32(0)]
    _launch((k.mmq8 if p.a8 else k.mmq)[pl.bn], (pl.grid,), (THREADS,),
            (*seg_args, _I32(K), _U64(p.rec.data.ptr), _I64(prep_row_bytes(K, p.a8)), _U64(p.inv.data.ptr), _I32(M),
             _I32(mode), _I32(act), _I32(int(accumulate)), _I32(pl.splits), _I32(pl.cps),
             _U64(scratch.part.data.ptr), _U64(scratch.cnt.data.ptr), _U64(amax)),
            mmq_smem_bytes(pl.bn, p.a8), pdl)


def _small_ok(mats, M: int, small: bool | None, a8: bool = False) -> bool:
    """Whether a launch runs on mmqs.cu: as asked, or (None) as the dispatcher's rule says; never
    on 8-bit records (mmqs.cu reads the fp16 ones)."""
    if a8:
        if small:
            raise ValueError("mmqs: no 8-bit variant (the prep buffer holds int8 records)")
        return False
    if small is None:
        return mmqs_takes(mats, M)
    if small and not all(mmqs_ok(w) for w in mats):
        raise ValueError(f"mmqs: {', '.join(getattr(w.qtype, 'name', str(w.qtype)) for w in mats)} "
                         f"(types {', '.join(sorted(q.name for q in MMQS_TYPES))}) have no small-batch kernel")
    return small


def _launch_small(k, seg_args: list, tiles: int, K: int, p: MmqPrep, M: int, mode: int, act: int,
                  accumulate: bool, amax: int, pdl: bool, warps: int | None, cluster: int | None) -> None:
    t = 8 if M <= 8 else 16
    groups = -(-M // t)
    if cluster is None:
        cluster = small_cluster(tiles * groups, K, _sm_count(k)) if clusters_ok(k) else 1
    elif cluster > 1 and not clusters_ok(k):
        raise ValueError("mmqs: thread-block clusters need compute capability 9.0 and cuLaunchKernelEx")
    if not 1 <= cluster <= 8 or K // 64 < cluster:
        raise ValueError(f"mmqs: {cluster} blocks per cluster (1..8, at most one per 64 columns of K = {K})")
    W = warps or small_warps(tiles * groups, K, _sm_count(k), cluster)
    if not 1 <= W <= SMALL_MAX_WARPS:
        raise ValueError(f"mmqs: {W} warps per block (1..{SMALL_MAX_WARPS})")
    for _ in range(3 - len(seg_args) // 7):
        seg_args += [_U64(0), _I64(0), _I32(0), _I32(0), _U64(0), _U64(0), _I32(0)]
    _launch(k.mmqs[t], (tiles * groups * cluster,), (32 * W,),
            (*seg_args, _I32(K), _U64(p.rec.data.ptr), _I64(prep_row_bytes(K)), _U64(p.inv.data.ptr), _I32(M),
             _I32(mode), _I32(act), _I32(int(accumulate)), _U64(amax), _I32(groups)), 0, pdl, cluster)


def mmq(k: "Kernels", segs, K: int, p: MmqPrep, M: int, scratch: MmqScratch, accumulate: bool = False,
        amax: int = 0, pdl: bool = False, splits: int | None = None, small: bool | None = None,
        warps: int | None = None, cluster: int | None = None, a8: bool | None = None) -> None:
    """y_s[t] (+)= W_s @ h[t] (+ bias_s) for t < M and up to three segments s = (WeightRef, bias
    pointer or 0, y pointer, y row stride) sharing the input h that prep wrote into p. amax (one
    segment): a zeroed uint64 [M] buffer that receives the packed argmax of each row (as mmvf's;
    argmax_unpack reads and resets it). small: mmqs.cu (True) or mmq.cu's tiles (False), as the
    dispatcher says (None: its rule, dispatch.mmqs_takes); warps: mmqs's warps per block (None: small_warps);
    cluster: its blocks per cluster (None: small_cluster where clusters_ok, else 1). a8: the 8-bit
    variant (None: where p holds its records; it must)."""
    if not 1 <= len(segs) <= 3 or (amax and len(segs) != 1):
        raise ValueError("mmq: one to three segments, and only one with amax")
    mats = [w for w, _, _, _ in segs]
    a8 = _check("mmq", mats, K, p, M, a8)
    args: list = []
    for w, bias, y, ys in segs:
        args += [_U64(w.ptr), _I64(w.row_bytes), _I32(w.rows), _I32(int(w.qtype)), _U64(bias), _U64(y), _I32(ys)]
    if _small_ok(mats, M, small, a8):
        tiles = sum(-(-w.rows // 16) for w in mats)
        return _launch_small(k, args, tiles, K, p, M, 0, 0, accumulate, amax, pdl, warps, cluster)
    pl = plan(M, K, tuple(w.rows for w in mats), False, _sm_count(k), splits, device_smem(k).mmq_bn_max(a8))
    _launch_mmq(k, pl, args, K, p, M, 0, 0, accumulate, scratch, amax, pdl)


def mmq_ffn(k: "Kernels", wg: WeightRef, wu: WeightRef, p: MmqPrep, M: int, act: int, a: int, as_: int,
            scratch: MmqScratch, pdl: bool = False, splits: int | None = None, small: bool | None = None,
            warps: int | None = None, cluster: int | None = None, a8: bool | None = None) -> None:
    """a[t] = act(gate @ h[t]) * (up @ h[t]) for t < M (act 0: SiLU, 1: GELU-tanh), fp32 out with
    row stride as_; gate and up share type and shape. a8: as mmq's."""
    if wg.qtype != wu.qtype or wg.rows != wu.rows or wg.cols != wu.cols or wg.row_bytes != wu.row_bytes:
        raise ValueError(f"mmq_ffn: gate {wg.name} and up {wu.name} differ in type or shape")
    a8 = _check("mmq_ffn", [wg, wu], wg.cols, p, M, a8)
    args = []
    for w in (wg, wu):
        args += [_U64(w.ptr), _I64(w.row_bytes), _I32(w.rows), _I32(int(w.qtype)), _U64(0), _U64(a), _I32(as_)]
    if _small_ok([wg, wu], M, small, a8):
        return _launch_small(k, args, -(-wg.rows // 16), wg.cols, p, M, 1, act, False, 0, pdl, warps, cluster)
    pl = plan(M, wg.cols, (wg.rows,), True, _sm_count(k), splits, device_smem(k).mmq_bn_max(a8))
    _launch_mmq(k, pl, args, wg.cols, p, M, 1, act, False, scratch, 0, pdl)


def mmq_moe(k: "Kernels", w0: WeightRef, w1: WeightRef | None, bn: int, TB: int, tiles: int, lst: int, top_k: int,
            p: MmqPrep, y: int, ys: int, mode: int, act: int = 0, b0: int = 0, b1: int = 0) -> None:
    """The grouped experts' tiles (mmq.cu mmq_moe_bnBN) over the lists of ops.moe_bucket (tile height
    bn, TB token tiles: dispatch.moe_grouped_plan under the device's bn_max for p's records): mode 1,
    y[slot] = act(w0_e @ h + b0_e, w1_e @ h + b1_e) with gate w0 and up w1 (stacks of one type and
    shape) over p's records of the step's rows (row lst[slot] // top_k);
    mode 0, y[lst[slot]] = w0_e @ a[slot] + b0_e over p's records of the slots. b0, b1: float
    [experts, rows] biases (0: none). The records of p (fp16 or 8-bit) choose the variant."""
    if mode and (w1 is None or not same_shape(w0, w1)):
        raise ValueError(f"mmq_moe: gate {w0.name} and up {getattr(w1, 'name', None)} differ in type or shape")
    a8 = _check("mmq_moe", [w0] + ([w1] if mode else []), w0.cols, p, 1)
    rows = BM // 2 if mode else BM
    _block_fits(k, f"mmq{'8' if a8 else ''}_moe_bn{bn}", mmq_smem_bytes(bn, a8))
    _launch((k.mmq8 if a8 else k.mmq)[("moe", bn)], (-(-w0.rows // rows) * TB,), (THREADS,),
            (_U64(w0.ptr), _U64(w1.ptr if mode else 0), _I64(w0.row_bytes), _I64(w0.expert_bytes), _I32(w0.rows),
             _I32(int(w0.qtype)), _U64(b0), _U64(b1), _U64(y), _I32(ys), _I32(w0.cols), _U64(p.rec.data.ptr),
             _I64(prep_row_bytes(w0.cols, a8)), _U64(p.inv.data.ptr), _U64(tiles), _U64(lst), _I32(top_k), _I32(TB),
             _I32(mode), _I32(act)), mmq_smem_bytes(bn, a8))
