"""Launch helpers: one function per kernel, typed arguments (pointers as uint64, ints as int32),
shared by the forward pass, the start-up self-check and the GPU tests, so the tests exercise the
exact launches the model runs. Arrays are passed as device pointers (int); shapes and strides
are in elements."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cupy
import numpy as np

from ...formats.gpu_layout import device_row_bytes
from ...kernels.catalog import (FFNF_R, MMV8_Q8_THREADS, MMV8_R, MMV8_WARPS, MMVF_HEAD_R, MMVF_SMEM_MAX,
                                MMVF_WARPS, mmv8_ring_smem, mmv8_smem)
from . import pdl as _pdl
from .dispatch import FULL_SMEM, SmemLimits, same_shape
from .support import ATT_MAXD, MOE_MAX_K  # noqa: F401  (ATT_MAXD: the launchers' users read it from here)
from .support import DN_CHUNK, dn_chunk_kernel, dn_delta_kernel
from .matrices import WeightRef  # noqa: F401  (the launchers' matrices, imported from here by their users)
from .modules import MMV_NB, Kernels, resident_blocks

_U64, _I32, _I64, _F32 = np.uint64, np.int32, np.int64, np.float32
GEMV_WARPS, GEMV_MAXB, ATT_WARPS = 4, 8, 16                   # must match the .cu defines
GEMV_MAX_WPR = 16                                              # gemv.cu: most warps sharing one row,
GEMV_FFN_MAX_WPR = GEMV_WARPS                                  # and one row of ffn_gate_up
# gemv.cu's warps per row (gemv_wpr): doubled while the launch, doubled, keeps within GEMV_WARPS_PER_SM
# warps an SM (a quarter of an SM's warp slots: enough loads in flight to cover memory latency; a
# launch that already has them needs no shared-memory sum) and each warp still gets GEMV_MIN_PIECES
# 16-byte pieces of its row (a piece a lane: fewer leaves lanes idle)
GEMV_WARPS_PER_SM = 16
GEMV_MIN_PIECES = 32
ATT_TQ, ATT_KT = 16, 32                                        # attention.cu attn_tile


@dataclass(frozen=True)
class PagedKV:
    """One layer's paged KV cache as the kernels address it (kernels/paged_kv.cuh): the K and V
    pools (fp16 [blocks, block_size, kv_heads, head_dim]) and the block tables of every slot
    (int32 [slots, max_blocks])."""
    k: int
    v: int
    tables: int
    max_blocks: int
    bs_log2: int

    def args(self) -> tuple:
        return _U64(self.tables), _I32(self.max_blocks), _I32(self.bs_log2)


def _launch(fn, grid, block, args, shared_mem: int = 0, pdl: bool = False, cluster: int = 1) -> None:
    """Launch on the current stream; pdl: as a programmatic dependent launch (pdl.py), for the
    kernels that wait for the one before in pdl_wait() (mmvf, ffnf, attention, argmax_unpack);
    cluster: blocks per thread-block cluster (sm_90 and pdl.launcher() only: pdl.clusters_ok)."""
    if pdl or cluster > 1:
        _pdl.launcher()(fn, grid, block, args, shared_mem, cupy.cuda.get_current_stream().ptr, pdl, cluster)
    else:
        fn(grid, block, args, shared_mem=shared_mem)


def row_bytes(qtype, cols: int) -> int:
    """Bytes per row of a matrix on the device (Q6_K is regrouped: formats/gpu_layout.py)."""
    return device_row_bytes(qtype, cols)


def gemv_wpr(rows: int, row_bytes: int, nb: int, sm_count: int, most: int = GEMV_MAX_WPR) -> int:
    """Warps sharing one output row of a gemv.cu launch (rows of row_bytes bytes, nb activation rows):
    1, doubled while the doubled launch has at most GEMV_WARPS_PER_SM warps an SM and each warp would
    still get GEMV_MIN_PIECES 16-byte pieces, up to `most`. A launch of many rows keeps one warp a row;
    a few long rows (a router, a one-row gate) spread over many warps."""
    warps = rows * -(-nb // GEMV_MAXB)
    pieces = row_bytes // 16
    wpr = 1
    while (wpr < most and 2 * wpr * warps <= GEMV_WARPS_PER_SM * sm_count
           and pieces // (2 * wpr) >= GEMV_MIN_PIECES):
        wpr *= 2
    return wpr


@functools.cache
def gemv_launch(rows: int, row_bytes: int, nb: int, sm_count: int,
                ffn: bool = False) -> tuple[tuple[int, int], int, int]:
    """(grid, threads, wpr) of a gemv.cu launch (ffn: ffn_gate_up's): blocks of max(GEMV_WARPS, wpr) warps,
    GEMV_WARPS / wpr rows each (at least one), by one block per GEMV_MAXB activation rows."""
    wpr = gemv_wpr(rows, row_bytes, nb, sm_count, GEMV_FFN_MAX_WPR if ffn else GEMV_MAX_WPR)
    warps = max(GEMV_WARPS, wpr)
    per_block = warps // wpr
    return (-(-rows // per_block), -(-nb // GEMV_MAXB)), 32 * warps, wpr


def gemv(k: Kernels, w: WeightRef, x: int, xs: int, y: int, ys: int, nb: int,
         bias: int = 0, accumulate: bool = False, pdl: bool = False) -> None:
    grid, threads, wpr = gemv_launch(w.rows, w.row_bytes, nb, getattr(k, "sm_count", 132))
    _launch(k.gemv[w.qtype], grid, (threads,),
            (_U64(w.ptr), _I64(w.row_bytes), _I32(w.rows), _I32(w.cols), _U64(x), _I32(xs),
             _U64(y), _I32(ys), _I32(nb), _U64(bias), _I32(int(accumulate)), _I32(wpr)), 0, pdl)


@functools.cache
def _nb_variant(nb: int) -> int:
    """The GEMV module of nb rows (remembered: every mmvf/ffnf launch asks several times)."""
    return next((v for v in MMV_NB if v >= nb), MMV_NB[-1])


def warps_per_row(K: int) -> int:
    """Warps sharing one row: enough 32-unit strides that long rows finish in ~2-3 passes."""
    nu = K // 32
    return 1 if nu <= 64 else (2 if nu <= 128 else 4)


MMVF_R = 2                                                     # mmvf.cu: rows a group


def mmvf_wpr(K: int, rows: int, sm_count: int, staged: bool = True, warps: int = MMVF_WARPS[1]) -> int:
    """Warps sharing one row group: as warps_per_row, then doubled while the launch has fewer
    than two blocks per SM and the added warps still get units to read. Staged launches take at
    most 2 warps a group: each block stages the whole input, so fewer, longer-lived blocks win
    (benchmarks/mmvf_sweep.py --policy times the choice)."""
    wpr = min(warps_per_row(K), 2) if staged else warps_per_row(K)
    most = 2 if staged else warps
    groups = -(-rows // MMVF_R)
    while wpr < most and groups * wpr < 2 * sm_count * warps and K // 32 > 32 * wpr:
        wpr *= 2
    return wpr


_resident: dict[tuple[int, int], int] = {}


def _max_grid(k: Kernels, fn, smem: int, warps: int) -> int:
    """Blocks of an mmvf/ffnf launch that fit on the GPU at once (registers, shared memory, as the
    driver's occupancy calculator counts them): the kernels stride over row groups, so one resident
    wave does the work with one staging per block; a grid larger than that would run as two waves."""
    key = (id(fn), smem)
    n = _resident.get(key)
    if n is None:
        per_sm = resident_blocks(fn, 32 * warps, smem)
        if per_sm is None:          # no driver entry point: count registers and shared memory by hand
            regs = -(-int(fn.num_regs) // 8) * 8                 # allocation granularity per thread
            by_regs = 65536 // (regs * 32 * warps)
            by_smem = (228 * 1024) // (smem + int(fn.shared_size_bytes) + 1024)
            per_sm = min(by_regs, by_smem, 2048 // (32 * warps))
        n = _resident[key] = max(1, per_sm) * getattr(k, "sm_count", 132)
    return n


def device_smem(k: Kernels) -> SmemLimits:
    """The device's staged-row limits (Kernels.smem; stand-ins without one: sm_80 / sm_90's)."""
    return getattr(k, "smem", FULL_SMEM)


def _smem_check(kernel: str, need: int, limit: int, what: str) -> None:
    """A launch of `kernel` asking `need` bytes of dynamic shared memory where the device allows it
    `limit` (its SmemLimits): refused here, by name, rather than by the driver at launch."""
    if need > limit:
        raise ValueError(f"{kernel}: {what} need {need} bytes of shared memory; this device allows it {limit} "
                         f"(dispatch.smem_limits)")


def _check_x(x: int, xs: int, K: int) -> None:
    if x % 16 or xs % 4 or K % 32:
        raise ValueError(f"mmvf: activations must be 16-byte aligned with stride % 4 == 0 and K % 32 == 0 "
                         f"(x={x:#x}, xs={xs}, K={K})")


def mmvf_stride(K: int) -> int:
    """Floats per staged activation row: K swizzled values, then 2 sums per 32-unit (mmvf.cu)."""
    return K + (((K >> 4) + 3) & ~3)


def mmvf_stage_ok(K: int, nb: int, limit: int = MMVF_SMEM_MAX) -> bool:
    """The launch's activation rows fit in shared memory (staged reads; a folded norm needs them):
    within `limit` bytes, the device's (SmemLimits.mmvf_rows; catalog.MMVF_SMEM_MAX at most)."""
    return K % 32 == 0 and _nb_variant(nb) * mmvf_stride(K) * 4 <= limit



def _stage_args(norm, K: int, nb: int, limit: int = MMVF_SMEM_MAX):
    """(stage, nw pointer, eps) arguments and the dynamic shared memory of a launch; norm = (ptr, eps)
    or None. Activations are staged whenever they fit (in `limit` bytes: the device's)."""
    if not mmvf_stage_ok(K, nb, limit):
        if norm is not None:
            raise ValueError(f"mmvf: a folded norm of {nb} rows x {K} does not fit in shared memory")
        return _I32(0), _U64(0), _F32(0.0), 0
    nw, eps = norm if norm is not None else (0, 0.0)
    return _I32(1), _U64(nw), _F32(eps), _nb_variant(nb) * mmvf_stride(K) * 4


def mmv8_wpr(K: int, groups: int, blocks: int, warps: int = MMV8_WARPS) -> int:
    """Warps sharing one row group of an mmv8/ffn8 launch of `groups` groups on `blocks` resident
    blocks: the power of two (up to the block's warps, each lane left 2 units or more a row) that
    minimises rounds x units a lane per round, ceil(groups wpr / (warps blocks)) x K / (32 wpr): more
    warps a row shorten each round, and the last round of a launch whose groups do not fill it
    runs part-empty; ties to the fewer warps (fewer sums through shared memory)."""
    nu = K // 32
    best, best_t = 1, None
    w = 1
    while w <= warps and (w == 1 or nu >= 64 * w):
        t = -(-groups * w // (warps * max(blocks, 1))) * (-(-nu // (32 * w)))
        if best_t is None or t < best_t:
            best, best_t = w, t
        w *= 2
    return best


def _mmv8_quantize(k: Kernels, x: int, xs: int, K: int, nb: int, norm, pdl: bool) -> tuple[int, int]:
    """mmv8_q8: the nb input rows x (RMSNorm(x) with norm = (weight pointer, eps)) in mmv8.cu's 8-bit
    form, into the device's scratch (Kernels.mmv8_xq); returns its pointer and bytes a row."""
    xqs = mmv8_smem(K)                      # whole 16-byte pieces
    xq = k.mmv8_xq(nb * xqs)
    nw, eps = norm if norm is not None else (0, 0.0)
    _launch(k.mmv8["q8"], (-(-(K // 4) // MMV8_Q8_THREADS), nb), (MMV8_Q8_THREADS,),
            (_U64(x), _I32(xs), _I32(K), _U64(nw), _F32(eps), _U64(xq), _I64(xqs)), 0, pdl)
    return xq, xqs


def _mmv8_launch(k: Kernels, fn, kind: int, rows, K: int, nb: int) -> tuple[tuple, int, int]:
    """Grid, warps per row and dynamic shared memory of an mmv8.cu launch (kind 1 mmv8, 2 ffn8)
    over the rows of each matrix (each its own row groups): one resident wave, a block column per
    activation row."""
    lim = device_smem(k)
    smem = mmv8_smem(K)
    _smem_check("mmv8_nb1" if kind == 1 else "ffn8_nb1", smem, lim.mmv8_rows,
                f"an input row of {K} values (dispatch.mmv8_ok)")
    smem += mmv8_ring_smem(kind, lim.mmv8_ring)                 # the staged row, then the rings (if any)
    groups = sum(-(-r // MMV8_R[kind]) for r in rows)
    blocks = _max_grid(k, fn, smem, MMV8_WARPS)
    wpr = mmv8_wpr(K, groups, blocks)
    gpb = MMV8_WARPS // wpr
    return (min(-(-groups // gpb), blocks), nb), wpr, smem


def mmvf(k: Kernels, segs, K: int, x: int, xs: int, nb: int, accumulate: bool = False,
         norm=None, amax: int = 0, pdl: bool = False, head: bool = False, q8: bool = False) -> None:
    """y_s[b] (+)= W_s @ h[b] (+ bias_s) for up to three segments s = (WeightRef, bias, y, ys)
    sharing one fp32 activation input x [nb, K] (row stride xs): h = x, or with norm = (weight
    pointer, eps) h = RMSNorm(x) computed in the launch. amax: a zeroed uint64 [nb] buffer that
    receives the packed argmax of each output row (one segment; argmax_unpack reads it). head: the
    LM head; at one row it takes the module of MMVF_HEAD_R rows a group. q8: mmv8.cu's kernel (8-bit
    activations; the dispatcher's Kernel.MMV8), the input quantized by mmv8_q8 just before."""
    _check_x(x, xs, K)
    if q8:
        fn = k.mmv8["mmv8"]
        args = []
        for w, bias, y, ys in segs:
            args += [_U64(w.ptr), _I64(w.row_bytes), _I32(w.rows), _I32(int(w.qtype)), _U64(bias), _U64(y), _I32(ys)]
        args += [_U64(0), _I64(0), _I32(0), _I32(0), _U64(0), _U64(0), _I32(0)] * (3 - len(segs))
        grid, wpr, smem = _mmv8_launch(k, fn, 1, [w.rows for w, *_ in segs], K, nb)
        xq, xqs = _mmv8_quantize(k, x, xs, K, nb, norm, pdl)
        _launch(fn, grid, (MMV8_WARPS * 32,),
                (*args, _I32(K), _U64(xq), _I64(xqs), _I32(wpr), _I32(int(accumulate)), _U64(amax)), smem, pdl)
        return
    v = _nb_variant(nb)
    stage, nw, eps, smem = _stage_args(norm, K, nb, device_smem(k).mmvf_rows)
    # one-row launches whose input is too long to stage read each unit's 32 activations through L1
    # once per row group: groups of MMVF_HEAD_R rows (the LM head's module) halve those reads, and
    # all the block's warps share one group (its long rows in short per-warp chains)
    wide = v == 1 and not stage
    fn, R = (k.mmvf_head, MMVF_HEAD_R) if v == 1 and (head or wide) else (k.mmvf[v], MMVF_R)
    args = []
    groups = 0
    rows = 0
    for w, bias, y, ys in segs:
        args += [_U64(w.ptr), _I64(w.row_bytes), _I32(w.rows), _I32(int(w.qtype)), _U64(bias), _U64(y), _I32(ys)]
        groups += -(-w.rows // R)
        rows += w.rows
    for _ in range(3 - len(segs)):
        args += [_U64(0), _I64(0), _I32(0), _I32(0), _U64(0), _U64(0), _I32(0)]
    W = MMVF_WARPS[v]
    wpr = W if wide else mmvf_wpr(K, rows, getattr(k, "sm_count", 132), bool(stage), W)
    gpb = W // wpr
    grid = (min((groups + gpb - 1) // gpb, _max_grid(k, fn, smem, W)), (nb + v - 1) // v)
    _launch(fn, grid, (W * 32,),
            (*args, _I32(K), _U64(x), _I32(xs), _I32(nb), _I32(wpr), _I32(int(accumulate)), stage, nw, eps,
             _U64(amax)), smem, pdl)


def ffnf_lanes(K: int, wpr: int, nb: int = 1) -> int:
    """Lanes that share one row group of an ffnf launch of nb rows: 16 (two groups a warp) where
    that leaves fewer lanes idle in a row's last pass than 32 do (K = 1536: 48 units, 3 full passes
    of 16 lanes against a full and a half-empty one of 32), for rows of up to 64 units in groups of
    one warp (wpr 1) and launches of up to 4 rows (the 8-row kernel keeps 32: registers); else 32."""
    nu = K // 32
    return 16 if wpr == 1 and nu <= 64 and _nb_variant(nb) <= 4 and (-nu) % 16 < (-nu) % 32 else 32


def ffn_f(k: Kernels, wg: WeightRef, wu: WeightRef, x: int, xs: int, a: int, as_: int, nb: int, act: int,
          norm=None, pdl: bool = False, q8: bool = False) -> None:
    """a[b] = act(gate @ h[b]) * (up @ h[b]), fp32 in and out (gate and up share type and shape);
    h = x, or RMSNorm(x) with norm = (weight pointer, eps). q8: mmv8.cu's ffn8 (8-bit activations)."""
    K = wg.cols
    _check_x(x, xs, K)
    if q8:
        fn = k.mmv8["ffn8"]
        grid, wpr, smem = _mmv8_launch(k, fn, 2, [wg.rows], K, nb)
        xq, xqs = _mmv8_quantize(k, x, xs, K, nb, norm, pdl)
        _launch(fn, grid, (MMV8_WARPS * 32,),
                (_U64(wg.ptr), _U64(wu.ptr), _I64(wg.row_bytes), _I32(wg.rows), _I32(K), _I32(int(wg.qtype)),
                 _U64(xq), _I64(xqs), _I32(act), _U64(a), _I32(as_), _I32(wpr)), smem, pdl)
        return
    stage, nw, eps, smem = _stage_args(norm, K, nb, device_smem(k).mmvf_rows)
    v = _nb_variant(nb)
    W = MMVF_WARPS[v]
    wpr = mmvf_wpr(K, wg.rows, getattr(k, "sm_count", 132), bool(stage), W)
    lpg = ffnf_lanes(K, wpr, nb)
    gpb = W * (32 // lpg) // wpr
    groups = -(-wg.rows // FFNF_R.get(v, MMVF_R))
    grid = (min((groups + gpb - 1) // gpb, _max_grid(k, k.ffnf[v], smem, W)), (nb + v - 1) // v)
    _launch(k.ffnf[v], grid, (W * 32,),
            (_U64(wg.ptr), _U64(wu.ptr), _I64(wg.row_bytes), _I32(wg.rows), _I32(K), _I32(int(wg.qtype)),
             _U64(x), _I32(xs), _I32(nb), _I32(act), _U64(a), _I32(as_), _I32(wpr), stage, nw, eps, _I32(lpg)),
            smem, pdl)


def ffn_gate_up(k: Kernels, wg: WeightRef, wu: WeightRef, x: int, xs: int, a: int, as_: int,
                nb: int, act: int) -> None:
    grid, threads, wpr = gemv_launch(wg.rows, wg.row_bytes, nb, getattr(k, "sm_count", 132), ffn=True)
    k.ffn_gate_up[wg.qtype](grid, (threads,),
                            (_U64(wg.ptr), _U64(wu.ptr), _I64(wg.row_bytes), _I32(wg.rows), _I32(wg.cols),
                             _U64(x), _I32(xs), _U64(a), _I32(as_), _I32(nb), _I32(act), _I32(wpr)))


MOE_WARPS, MOE_TOPK_ROWS, MOE_COMBINE_THREADS, MOE_BUCKET_THREADS = 4, 4, 256, 256   # must match moe.cu (and MOE_MAX_K)


def moe_topk(k: Kernels, logits: int, ls: int, T: int, E: int, top_k: int, renorm: bool, ids: int,
             w: int, pdl: bool = False) -> None:
    """Each of T rows of router logits [T, E] (row stride ls): its top_k experts (the largest logits,
    ties to the lower index) into ids int32 [T, top_k] and their softmax probabilities into w float
    [T, top_k], renormalised to sum to one over the top_k where renorm."""
    if not 1 <= top_k <= min(E, MOE_MAX_K):
        raise ValueError(f"moe_topk: {top_k} experts of {E} per token (the kernel takes 1..{MOE_MAX_K})")
    _launch(k.moe["topk"], ((T + MOE_TOPK_ROWS - 1) // MOE_TOPK_ROWS,), (MOE_TOPK_ROWS * 32,),
            (_U64(logits), _I32(ls), _I32(T), _I32(E), _I32(top_k), _I32(int(renorm)), _U64(ids), _U64(w)), 0, pdl)


def moe_gate_up(k: Kernels, gate: WeightRef, up: WeightRef, ids: int, top_k: int, pairs: int, x: int, xs: int,
                a: int, as_: int, act: int, bg: int = 0, bu: int = 0) -> None:
    """a[p] = act(gate_e @ x[p // top_k] + bg_e) * (up_e @ x[p // top_k] + bu_e) for each of `pairs`
    (row, expert) pairs p, e = ids[p] (gate and up: stacks of experts of one type and shape; act 2:
    the clamped SwiGLU of the two; bg, bu: float [experts, rows] biases, 0: none)."""
    if not same_shape(gate, up):
        raise ValueError(f"moe_gate_up: {gate.name} and {up.name} differ in type or shape")
    k.moe[("gate_up", gate.qtype)]((pairs, (gate.rows + MOE_WARPS - 1) // MOE_WARPS), (MOE_WARPS * 32,),
                                   (_U64(gate.ptr), _U64(up.ptr), _I64(gate.row_bytes), _I64(gate.expert_bytes),
                                    _I32(gate.experts), _I32(gate.rows), _I32(gate.cols), _U64(ids), _I32(top_k),
                                    _U64(x), _I32(xs), _U64(a), _I32(as_), _I32(act), _U64(bg), _U64(bu)))


def moe_gemv(k: Kernels, w: WeightRef, ids: int, pairs: int, x: int, xs: int, xdiv: int, y: int, ys: int,
             bias: int = 0) -> None:
    """y[p] = w_e @ x[p // xdiv] (+ bias_e) for each of `pairs` (row, expert) pairs p, e = ids[p] (w: a
    stack of experts; xdiv 1: each pair its own input row, top_k: its token's; bias: float
    [experts, w.rows], 0: none)."""
    k.moe[("gemv", w.qtype)]((pairs, (w.rows + MOE_WARPS - 1) // MOE_WARPS), (MOE_WARPS * 32,),
                             (_U64(w.ptr), _I64(w.row_bytes), _I64(w.expert_bytes), _I32(w.experts), _I32(w.rows),
                              _I32(w.cols), _U64(ids), _U64(x), _I32(xs), _I32(xdiv), _U64(y), _I32(ys), _U64(bias)))


def moe8(k: Kernels, gate: WeightRef, up: WeightRef | None, ids: int, pairs: int, x: int, xs: int, xdiv: int,
         y: int, ys: int, act: int = 0, bg: int = 0, bu: int = 0, pdl: bool = False) -> None:
    """moe_gate_up (up given: its fused form) or moe_gemv (up None: y[p] = gate_e @ x[p // xdiv] + bg_e)
    on mmv8.cu's GEMVs (moe8_gate_up_nb1, moe8_gemv_nb1: 8-bit activations, the dispatcher's
    Kernel.MOE_PAIRS8): the pairs' ceil(pairs / xdiv) input rows quantized by mmv8_q8 first, then a
    block column per pair, its blocks spread so that the launch is one resident wave."""
    K, N = gate.cols, gate.rows
    _check_x(x, xs, K)
    if up is not None and not same_shape(gate, up):
        raise ValueError(f"moe8: {gate.name} and {up.name} differ in type or shape")
    fn = k.mmv8["moe8_gate_up" if up is not None else "moe8_gemv"]
    smem = mmv8_smem(K)
    _smem_check("moe8_gate_up_nb1" if up is not None else "moe8_gemv_nb1", smem, device_smem(k).mmv8_rows,
                f"an input row of {K} values (dispatch.mmv8_ok)")
    xq, xqs = _mmv8_quantize(k, x, xs, K, -(-pairs // xdiv), None, pdl)
    groups = -(-N // MMV8_R[3])
    per_pair = max(1, min(-(-groups // MMV8_WARPS), _max_grid(k, fn, smem, MMV8_WARPS) // max(pairs, 1)))
    head = (_U64(gate.ptr),) + ((_U64(up.ptr),) if up is not None else ())
    args = head + (_I64(gate.row_bytes), _I64(gate.expert_bytes), _I32(gate.experts), _I32(N), _I32(K),
                   _I32(int(gate.qtype)), _U64(ids), _I32(xdiv), _U64(xq), _I64(xqs))
    args += (_I32(act), _U64(bg), _U64(bu)) if up is not None else (_U64(bg),)
    _launch(fn, (per_pair, pairs), (MMV8_WARPS * 32,), args + (_U64(y), _I32(ys)), smem, pdl)


def moe8_combine_wpr(groups: int, top_k: int, blocks: int, warps: int = MMV8_WARPS) -> int:
    """Warps sharing one row group of a moe8_down_combine launch (`groups` groups a token on `blocks`
    resident blocks a token), each taking every wpr-th of the token's top_k pairs (a whole row each):
    the power of two (up to the block's warps, and to the first that holds every pair) that minimises
    rounds x pairs a warp per round, ceil(groups wpr / (warps blocks)) x ceil(top_k / wpr): one warp a
    group leaves most of the GPU idle when the groups are fewer than its warps, more warps a group
    than that need further rounds; ties to the fewer warps (fewer blocks staging the token's rows)."""
    best, best_t, w = 1, None, 1
    while w <= warps:
        t = -(-groups * w // (warps * max(blocks, 1))) * -(-top_k // w)
        if best_t is None or t < best_t:
            best, best_t = w, t
        if w >= top_k:
            break
        w *= 2
    return best


def moe8_down_combine(k: Kernels, down: WeightRef, ids: int, top_k: int, T: int, a: int, as_: int, x: int, xs: int,
                      w: int, bias: int = 0, pdl: bool = False) -> None:
    """x[t] += sum_j w[t, j] * (down_e @ a[t * top_k + j] + bias_e), e = ids[t * top_k + j], j in order,
    over the first down.rows columns of each of T rows (row stride xs): moe8's down projection and
    moe_combine in one launch (mmv8.cu moe8_down_combine_nb1; the same sum in the same order), y never
    written. The T * top_k rows of a (row stride as_) quantized by mmv8_q8 first; a block column per
    token, whose blocks each stage its top_k rows (dispatch.moe8_combine_ok: they fit its shared
    memory), spread so that the launch is one resident wave; ids int32 and w float [T, top_k]; bias:
    float [experts, down.rows], 0: none."""
    K, N = down.cols, down.rows
    _check_x(a, as_, K)
    if not 1 <= top_k <= MOE_MAX_K:
        raise ValueError(f"moe8_down_combine: {top_k} experts a token (the kernel takes 1..{MOE_MAX_K})")
    fn = k.mmv8["moe8_down_combine"]
    smem = top_k * mmv8_smem(K)
    _smem_check("moe8_down_combine_nb1", smem, device_smem(k).mmv8_rows,
                f"{top_k} input rows of {K} values (dispatch.moe8_combine_ok)")
    xq, xqs = _mmv8_quantize(k, a, as_, K, T * top_k, None, pdl)
    groups = -(-N // MMV8_R[3])
    blocks = max(1, _max_grid(k, fn, smem, MMV8_WARPS) // max(T, 1))
    wpr = moe8_combine_wpr(groups, top_k, blocks)
    grid = (min(-(-groups // (MMV8_WARPS // wpr)), blocks), T)
    _launch(fn, grid, (MMV8_WARPS * 32,),
            (_U64(down.ptr), _I64(down.row_bytes), _I64(down.expert_bytes), _I32(down.experts), _I32(N), _I32(K),
             _I32(int(down.qtype)), _U64(ids), _I32(top_k), _U64(xq), _I64(xqs), _U64(bias), _U64(w), _U64(x),
             _I32(xs), _I32(wpr)), smem, pdl)


def moe_combine(k: Kernels, x: int, xs: int, y: int, ys: int, w: int, top_k: int, T: int, H: int) -> None:
    """x[t] += sum_j w[t, j] * y[t * top_k + j] over the first H columns, j in order."""
    k.moe["combine"]((T, (H + MOE_COMBINE_THREADS - 1) // MOE_COMBINE_THREADS), (MOE_COMBINE_THREADS,),
                     (_U64(x), _I32(xs), _U64(y), _I32(ys), _U64(w), _I32(top_k), _I32(H)))


def moe_bucket(k: Kernels, ids: int, pairs: int, E: int, bn: int, cnt: int, lst: int, tiles: int, TB: int) -> None:
    """The grouped experts' lists (moe.cu moe_bucket_count, moe_bucket_fill) of `pairs` expert ids
    (int32): cnt int32 [E], lst int32 [TB * bn] (each expert's pairs in row order from slot bn x the
    tiles before it, -1 padding its last tile), tiles int32 [TB, 3] (expert, first slot, end of the
    expert's pairs; -1: none), TB the bound dispatch.moe_grouped_plan gives."""
    k.moe["bucket_count"]((E,), (MOE_BUCKET_THREADS,), (_U64(ids), _I32(pairs), _U64(cnt)))
    k.moe["bucket_fill"]((E,), (MOE_BUCKET_THREADS,), (_U64(ids), _I32(pairs), _I32(E), _I32(bn), _U64(cnt),
                                                       _U64(lst), _U64(tiles), _I32(TB)))


def moe_shared_add(k: Kernels, x: int, xs: int, y: int, ys: int, s: int, T: int, H: int) -> None:
    """x[t] += sigmoid(s[t]) * y[t] over the first H columns (a shared expert's output, its gate logit)."""
    k.moe["shared_add"]((T, (H + MOE_COMBINE_THREADS - 1) // MOE_COMBINE_THREADS), (MOE_COMBINE_THREADS,),
                        (_U64(x), _I32(xs), _U64(y), _I32(ys), _U64(s), _I32(H)))


def dequant(k: Kernels, w: WeightRef, out: int, os: int) -> None:
    total = w.rows * ((w.cols + 31) // 32)
    k.dequant[w.qtype](((total + 255) // 256,), (256,),
                       (_U64(w.ptr), _I64(w.row_bytes), _I32(w.rows), _I32(w.cols), _U64(out), _I64(os)))


def embed(k: Kernels, w: WeightRef, tokens: int, n: int, scale: float, out: int, os: int) -> None:
    nu = (w.cols + 31) // 32
    k.embed[w.qtype](((nu + 127) // 128, n), (128,),
                     (_U64(w.ptr), _I64(w.row_bytes), _I32(w.cols), _U64(tokens), _I32(n), _F32(scale),
                      _U64(out), _I32(os)))


def rms_norm(k: Kernels, x: int, xs: int, w: int, out: int, os: int, rows: int, width: int,
             eps: float, add: bool = False, pdl: bool = False) -> None:
    threads = 256 if width >= 256 else max(32, (width + 31) // 32 * 32)
    _launch(k.rms_norm, (rows,), (threads,), (_U64(x), _I32(xs), _U64(w), _U64(out), _I32(os), _I32(rows),
                                              _I32(width), _F32(eps), _I32(int(add))), 0, pdl)


def rope_kv(k: Kernels, q: int, kk: int, v: int, positions: int, slots: int, kv: PagedKV,
            H: int, KVH: int, D: int, rope_dim: int, table: int, neox: bool, n: int) -> None:
    """Rotate q and k rows in place by the cos/sin table (rope_table) and write k and v (fp16) to
    the cache rows of (slots[t], positions[t])."""
    k.rope_kv((n, H + KVH), (128,),
              (_U64(q), _U64(kk), _U64(v), _U64(positions), _U64(slots), *kv.args(), _U64(kv.k), _U64(kv.v),
               _I32(H), _I32(KVH), _I32(D), _I32(rope_dim), _U64(table), _I32(int(neox)), _I32(n)))


def rope_table(ctx: int, rope_dim: int, theta: float, scaling=None) -> cupy.ndarray:
    """cos and sin of every position < ctx and rotary pair, float32 [ctx, rope_dim / 2, 2], made in
    float64 as the CPU backend makes them (theta as the kernels receive it: float32), with the
    layer's RoPE scaling (ModelConfig.layer_rope_scaling) applied. RoPE on the GPU reads it (rope.cu,
    attention.cu, flash_decode.cu) instead of computing angles."""
    return cupy.asarray(rope_host_table(ctx, rope_dim, theta, scaling))


def rope_host_table(ctx: int, rope_dim: int, theta: float, scaling=None) -> np.ndarray:
    """rope_table's values on the host (NumPy, which releases the GIL here: it may run on a thread)."""
    from ...model.math import rope_angles
    cos, sin = rope_angles(np.arange(ctx), rope_dim, float(np.float32(theta)), scaling)
    return np.stack([cos, sin], axis=-1)


def attention(k: Kernels, q: int, out: int, kv: PagedKV, slots: int, positions: int,
              H: int, KVH: int, D: int, scale: float, window: int, n: int, rope=None, pdl: bool = False,
              sinks: int = 0, head_norms=None) -> None:
    """out (fp32): row t attends to positions [0, positions[t]] of the sequence in slots[t] (paged:
    kv's tables). rope = (k, v, rope_dim, neox, table): decode rows (one per sequence, attn_decode),
    RoPE of q and of the new k and the KV-cache write done here, from the unrotated q, k, v rows (no
    rope_kv launch); table: a rope_table(...) pointer. Without rope: prompt rows already in the
    cache (attn_tile). sinks: fp32 [H], each head's sink logit in its softmax (0: none).
    head_norms = (q_norm, k_norm, eps) with rope only: each head of q and the new k RMSNorm'd
    (fp32 [D] weights; a 0 pointer: that one not) before RoPE, as rms_norm over the heads would
    (kernels/head_norm.cuh); None: neither. The kernels' 8-bit and fp16 outputs are not used (null)."""
    if rope is None and head_norms is not None:
        raise ValueError("attention: head norms are fused with the decode RoPE only (else rms_norm first)")
    if rope is None:
        # prompt rows: tiles of ATT_TQ rows share the K/V rows they stage (attn_tile)
        smem = 4 * (ATT_TQ * D + 2 * ATT_KT * (D + 4))
        fn = k.attn_tile if D % 128 == 0 else k.attn_tile_v2      # 4 or 2 dims per lane: no idle lanes
        _smem_check("attn_tile" if D % 128 == 0 else "attn_tile_v2", smem, device_smem(k).attention,
                    f"a tile of {D}-dim heads")
        _launch(fn, ((n + ATT_TQ - 1) // ATT_TQ, H), (ATT_TQ * 32,),
                (_U64(q), _U64(out), _U64(kv.k), _U64(kv.v), _U64(slots), _U64(positions), *kv.args(),
                 _I32(H), _I32(KVH), _I32(D), _F32(scale), _I32(window), _I32(n), _U64(0), _U64(sinks)), smem, pdl)
        return
    kin, vin, rope_dim, neox, table = rope
    if not table:
        raise ValueError("attention: decode RoPE needs a cos/sin table (rope_table)")
    if getattr(k, "head_dim", None) and D > k.head_dim:
        raise ValueError(f"attention: decode kernels compiled for head_dim {k.head_dim}, got {D}")
    qn, kn, eps = head_norms if head_norms is not None else (0, 0, 0.0)
    _launch(k.attn_decode, (n, H), (ATT_WARPS * 32,),
            (_U64(q), _U64(out), _U64(kv.k), _U64(kv.v), _U64(slots), _U64(positions), *kv.args(),
             _I32(H), _I32(KVH), _I32(D), _F32(scale), _I32(window), _I32(n),
             _U64(0), _U64(0), _U64(0), _U64(kin), _U64(vin), _I32(rope_dim),
             _I32(int(neox)), _I32(1), _U64(table), _U64(sinks), _U64(qn), _U64(kn), _F32(eps)), 0, pdl)


def act_mul(k: Kernels, g: int, u: int, a: int, n: int, act: int) -> None:
    """a = act(g) * u over n floats (act 2: the clamped SwiGLU of g and u)."""
    k.act_mul(((n + 255) // 256,), (256,), (_U64(g), _U64(u), _U64(a), _I64(n), _I32(act)))


def split_pair(k: Kernels, src: int, q: int, gate: int, rows: int, heads: int, D: int) -> None:
    """src [rows][heads][2][D] ([query | gate] per head) -> q and gate [rows][heads][D]."""
    k.split_pair(((heads * D + 255) // 256, rows), (256,), (_U64(src), _U64(q), _U64(gate), _I32(rows), _I32(heads),
                                                             _I32(D)))


def sigmoid_mul(k: Kernels, y: int, gate: int, n: int) -> None:
    k.sigmoid_mul(((n + 255) // 256,), (256,), (_U64(y), _U64(gate), _I64(n)))


DN_CONV_THREADS = 128          # kernels/deltanet.cu: threads of a conv block (its limits: support.py)


@dataclass(frozen=True)
class StepRows:
    """The rows of a step as deltanet.cu reads them: slots and positions (device int32 [n]), the
    scratch slot (padding rows: zero state, none kept) and n."""
    slots: int
    positions: int
    scratch: int
    n: int

    def args(self) -> tuple:
        if self.n > 65535:              # a grid's y dimension holds the rows
            raise ValueError(f"deltanet kernels: {self.n} rows in one step, at most 65535")
        return _U64(self.slots), _U64(self.positions), _I32(self.scratch), _I32(self.n)


def dn_conv(k: Kernels, x: int, xs: int, w: int, taps: int, conv_state: int, rows: StepRows, C: int, out: int,
            os: int) -> None:
    """out = silu(causal depthwise conv of the rows x, each segment continuing its slot's conv_state
    [slots][taps][C], which it leaves holding its last `taps` inputs); w [C][taps + 1]."""
    k.deltanet["conv"](((C + DN_CONV_THREADS - 1) // DN_CONV_THREADS, rows.n), (DN_CONV_THREADS,),
              (_U64(x), _I32(xs), _U64(w), _I32(taps), _U64(conv_state), *rows.args(), _I32(C), _U64(out), _I32(os)))


def dn_delta(k: Kernels, cv: int, cvs: int, alpha: int, beta: int, abs_: int, z: int, zs: int, a_coef: int,
             dt_bias: int, out_norm: int, state: int, rows: StepRows, nk: int, dk: int, nv: int, dv: int,
             eps: float, out: int, os: int, chunk_min: int | None = None) -> None:
    """The gated delta rule of each value head over the segments of the step from the conv output
    cv, each continuing its slot's state [slots][nv][dk][dv] (left holding the last row's), and the
    gated RMSNorm of the heads' output into out (deltanet.cu dn_delta, or its instance for this dk).
    chunk_min (None: off; else at least support.DN_CHUNK, and the heads must have a chunked kernel,
    support.dn_chunk_kernel): a segment of a live slot of at least chunk_min rows runs its whole
    chunks of DN_CHUNK rows through deltanet.cu's dn_chunk_k<dk> first, then its remaining rows
    token by token as every other segment's."""
    args = (_U64(cv), _I32(cvs), _U64(alpha), _U64(beta), _I32(abs_), _U64(z), _I32(zs), _U64(a_coef),
            _U64(dt_bias), _U64(out_norm), _U64(state), *rows.args(), _I32(nk), _I32(dk), _I32(nv), _I32(dv),
            _F32(eps), _U64(out), _I32(os))
    grid, block = (nv, rows.n), (-(-dv // 32) * 32,)
    if chunk_min is not None:
        chunked = dn_chunk_kernel(dk, dv)
        if chunked is None or chunk_min < DN_CHUNK:
            raise ValueError(f"dn_delta: no chunked rule for chunk_min {chunk_min} at k_dim {dk}, v_dim {dv}")
        # a block per DN_CHUNK rows, two threads a column of S (deltanet.cu dn_chunk_segment)
        k.deltanet[chunked]((nv, -(-rows.n // DN_CHUNK)), (-(-dv // 16) * 32,), args + (_I32(chunk_min),))
    k.deltanet[dn_delta_kernel(dk)](grid, block, args + (_I32(chunk_min or 0),))


def add_rows(k: Kernels, x: int, xs: int, bias: int, n: int, width: int) -> None:
    """x[b, :width] += bias (fp32 [width]) for n rows of stride xs."""
    k.add_rows(((width + 255) // 256, n), (256,), (_U64(x), _I32(xs), _U64(bias), _I32(n), _I32(width)))


def gather_rows(k: Kernels, src: int, idx: int, dst: int, n: int, width: int) -> None:
    k.gather_rows(((width + 255) // 256, n), (256,), (_U64(src), _U64(idx), _U64(dst), _I32(n), _I32(width)))


def argmax_unpack(k: Kernels, key: int, out: int, n: int, io: int = 0, io_stride: int = 0, ring: int = 0,
                  ring_len: int = 0, pdl: bool = False) -> None:
    """out[:n] = rows packed by a fused-argmax GEMV into key[:n] (uint64), which is reset to 0.
    io: a decode step's int32 input rows (tokens, positions; row stride io_stride): each token is
    also written there and its position advanced, the next step's inputs (elementwise.cu feed_next).
    ring: int32 [ring_len, io_stride] (mapped host memory): token b also goes to the ring row in io
    row 3, which is advanced (token_ring.py)."""
    _launch(k.argmax_unpack, ((n + 127) // 128,), (128,),
            (_U64(key), _U64(out), _I32(n), _U64(io), _I32(io_stride), _U64(ring), _I32(ring_len)), 0, pdl)


def argmax_rows(k: Kernels, x: int, xs: int, cols: int, out: int, rows: int, io: int = 0, io_stride: int = 0,
                ring: int = 0, ring_len: int = 0) -> None:
    """out[r] = first index of the max of row r (NaN never wins); io and ring as argmax_unpack."""
    k.argmax_rows((rows,), (1024,), (_U64(x), _I32(xs), _I32(cols), _U64(out), _I32(rows), _U64(io), _I32(io_stride),
                                     _U64(ring), _I32(ring_len)))


def decode_io_merge(k: Kernels, io: int, io_stride: int, stage: int, n: int, b: int, scratch_slot: int,
                    ring_row: int) -> None:
    """A continuation's decode inputs (elementwise.cu decode_io_merge): row j of io [4, io_stride]
    becomes row stage[3, j] of the previous step's outputs, or (-1) stage[0..2, j]; rows n..b-1
    padding; every row's ring row is ring_row."""
    k.decode_io_merge((1,), (256,), (_U64(io), _I32(io_stride), _U64(stage), _I32(n), _I32(b),
                                     _I32(scratch_slot), _I32(ring_row)), shared_mem=max(12 * n, 4))
