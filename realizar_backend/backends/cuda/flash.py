"""Flash attention over the paged KV pool (kernels/flash_prefill.cu, kernels/flash_decode.cu):
module loading, launch plans and launchers.

A plan (plan_prefill / plan_decode) is pure arithmetic: the kernel's name, grid, block, dynamic
shared memory and the split-K scratch the launch needs. It is fixed per launch shape, so a decode
graph captured for a batch bucket replays at every context length: the kernel picks each row's
split count on the device from the row's length. The scratch (FlashScratch) holds the partials of
split rows and the counters that elect the block combining them (in clusters, also the partials, as
flagged words after the counters); the counters must start at zero (allocate does) and every launch
leaves them at zero.

Pool layout (paged_kv.cuh): per layer K and V are fp16 [num_blocks + 1][block_size][KVH][D]; the
sequence in slot s owns blocks bt[s * max_blocks + i]; block_size = 1 << bs_log2."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ...kernels import catalog
from . import pdl as _pdl


class _CupyOnUse:
    """CuPy, imported at the first launcher's use: the plans are arithmetic, importable (and
    tested against the CPU emulation) where CuPy is not installed."""

    def __getattr__(self, name: str):
        import cupy as cp
        globals()["cupy"] = cp          # later uses go straight to CuPy
        return getattr(cp, name)


cupy = _CupyOnUse()

_U64, _I32, _F32 = np.uint64, np.int32, np.float32

HEAD_DIMS = (64, 128, 256)
FL_MAXC = 8                       # flash.cuh: partials one block combines
FLD_NW, FLD_KW = 4, 16             # flash_decode.cu: warps per block, keys per warp tile
FLD_LL_WORDS = 34                  # flash_decode.cu: flagged words of a cluster partial's 32-dim slice
MAX_PREFILL_SPLITS = FL_MAXC
MAX_DECODE_SPLITS = FL_MAXC * FL_MAXC   # two combine levels
MAX_CLUSTER_SPLITS = 128                # in clusters: one partial per cluster, combined once (decode_spins)
DECODE_MAX_GROUP = 16             # q heads per KV head the decode kernel packs into one mma tile
DECODE_CLUSTERS = (1, 2, 4, 8)    # splits per thread-block cluster (8: the portable limit)


def prefill_wm(D: int) -> int:
    """The prefill kernel's default m-tiles per warp: two (each K/V fragment read from shared memory
    feeds two mma) where the registers allow, one for 256-dim heads."""
    return 1 if D > 128 else 2


def prefill_bk(D: int, wm: int = 1) -> int:
    """Keys per K/V tile of the prefill kernel (registers: 256-dim heads, and two m-tiles of 128
    dims, take half)."""
    return 32 if D > 128 or (wm == 2 and D > 64) else 64


def prefill_smem(D: int, nw: int = 4, qsplit: bool = False, wm: int = 1) -> int:
    """Dynamic shared memory of a prefill block (flash_prefill.cu): two K/V stages, plus the q tile
    unless its fragments live in registers (one m-tile of <= 128 dims without the hi/lo split)."""
    lds, bk = D + 8, prefill_bk(D, wm)
    qreg = D <= 128 and not qsplit and wm == 1
    rows = 4 * bk + (0 if qreg else 16 * nw * wm * (2 if qsplit else 1))
    return rows * lds * 2


def decode_smem(D: int) -> int:
    """Dynamic shared memory of a decode block (flash_decode.cu): each warp's stages (3, or 2 for
    256-dim heads), then the q tile (hi, lo); for 256-dim heads then the slice copies a cluster's
    blocks push (34 floats per 32-dim slice of up to 16 heads), which smaller heads keep over the q
    tile (their q fragments live in registers)."""
    lds, nst = D + 8, 3 if D <= 128 else 2
    recv = 16 * (D // 32) * 34 * 4 if D > 128 else 0
    return (FLD_NW * nst * 2 * FLD_KW * lds + 2 * 16 * lds) * 2 + recv


@dataclass(frozen=True)
class Plan:
    kernel: str                  # entry point (module compiled with its -D options)
    options: tuple               # NVRTC defines selecting that one entry point
    grid: tuple[int, int, int]
    threads: int
    smem: int                    # dynamic shared memory, bytes
    splits: int                  # gridDim of the split axis (prefill z, decode x)
    part_floats: int             # scratch: partial outputs (float32)
    ml_count: int                # scratch: (m, l) pairs
    counters: int                # scratch: int32 counters (zero between launches)
    rows: int = 1                # prefill: rows per block (16 nw wm)
    cluster: int = 1             # decode: blocks per thread-block cluster along x (sm_90)


def plan_prefill(n: int, H: int, D: int, splits: int = 1, nw: int = 4, wm: int | None = None,
                 qsplit: bool = False, min_blocks: int = 0) -> Plan:
    """n prompt rows of H heads; splits: key splits per row tile (1 = none; at most 8); nw warps of
    wm m-tiles of 16 rows each per block (wm None: prefill_wm); min_blocks: blocks per SM the
    kernel's registers must allow (0: the compiler's choice)."""
    _check_dims(H, 1, D)
    wm = prefill_wm(D) if wm is None else wm
    if nw not in (4, 8) or wm not in (1, 2) or (wm == 2 and (D > 128 or nw != 4)) \
            or (nw == 8 and (D != 128 or qsplit or wm != 1)):
        raise ValueError(f"flash prefill: no variant with {nw} warps x {wm} m-tiles for head_dim {D} "
                         f"(qsplit={qsplit})")
    if not 1 <= splits <= MAX_PREFILL_SPLITS:
        raise ValueError(f"flash prefill: splits must be 1..{MAX_PREFILL_SPLITS}, got {splits}")
    bq = 16 * nw * wm
    tiles = -(-n // bq)
    opts = (f"-DFL_D={D}", f"-DFL_NW={nw}", f"-DFL_WM={wm}", f"-DFL_QS={int(qsplit)}")
    if min_blocks:
        opts += (f"-DFL_MINB={min_blocks}",)
    return Plan(f"flash_prefill_d{D}_w{nw}_m{wm}_q{int(qsplit)}", opts,
                (tiles, H, splits), 32 * nw, prefill_smem(D, nw, qsplit, wm), splits,
                splits * n * H * D if splits > 1 else 0, splits * n * H if splits > 1 else 0,
                tiles * H if splits > 1 else 0, bq)


def plan_decode(n: int, H: int, KVH: int, D: int, splits: int = 1, qsplit: bool = True, cluster: int = 1) -> Plan:
    """n decode rows (one token each); splits: the most key splits a row may take (1..64, in
    clusters 1..128); cluster: splits per thread-block cluster (sm_90: they combine through
    distributed shared memory; splits a multiple of it), 1: every level of the combine through
    global memory."""
    _check_dims(H, KVH, D)
    if H // KVH > DECODE_MAX_GROUP:
        raise ValueError(f"flash decode: {H // KVH} q heads per KV head; at most {DECODE_MAX_GROUP}")
    most = MAX_CLUSTER_SPLITS if cluster > 1 else MAX_DECODE_SPLITS
    if not 1 <= splits <= most:
        raise ValueError(f"flash decode: splits must be 1..{most}{' in clusters' if cluster > 1 else ''}, "
                         f"got {splits}")
    if cluster not in DECODE_CLUSTERS or splits % cluster:
        raise ValueError(f"flash decode: {cluster} splits per cluster must be one of {DECODE_CLUSTERS} "
                         f"and divide the {splits} splits")
    name, opts = f"flash_decode_d{D}_q{int(qsplit)}", (f"-DFL_D={D}", f"-DFL_QS={int(qsplit)}")
    if splits == 1:
        return Plan(name, opts, (1, KVH, n), 32 * FLD_NW, decode_smem(D), 1, 0, 0, 0)
    if cluster > 1:
        # in the counters (zero between launches, as the flagged words are): a counter per 32-dim
        # slice (the warps of the last level vote on their own; an even count, D / 32 being even),
        # then one partial per cluster and slice as 34 flagged 64-bit words (32 values, m, l)
        maxcl, nsl = splits // cluster, n * H * (D // 32)
        words = nsl * maxcl * FLD_LL_WORDS
        return Plan(name, opts, (splits, KVH, n), 32 * FLD_NW, decode_smem(D), splits, 0, 0,
                    nsl + 2 * words, cluster=cluster)
    maxg = -(-splits // FL_MAXC)
    lvl = splits + (maxg if splits > FL_MAXC else 0)
    return Plan(name, opts, (splits, KVH, n), 32 * FLD_NW, decode_smem(D), splits,
                n * H * D * lvl, n * H * lvl, n * KVH * (1 + maxg))


# the flash kernels' static shared memory, kept beside a plan's dynamic shared memory when a device's
# limit decides whether its head size takes them (fits): flash_prefill.cu's per-row arrays of a
# 128-row block take under 6 KB, flash_decode.cu's under 3 KB
FL_STATIC_RESERVE = 6 * 1024


def fits(smem: int, optin: int | None) -> bool:
    """A flash block of `smem` bytes of dynamic shared memory fits a device whose blocks may hold
    optin bytes (modules.smem_optin; None: not known, taken to fit). Where a head size's default
    plans do not (prefill_smem, decode_smem: sm_86 and sm_89 hold 99 KB a block), its attention
    takes attention.cu's kernels instead (forward.py)."""
    return optin is None or smem + FL_STATIC_RESERVE <= optin


def decode_cluster(splits: int, clusters: bool) -> tuple[int, int]:
    """(splits, splits per cluster) of a decode plan that may take `splits` (decode_splits), where
    the device and driver launch thread-block clusters (clusters: pdl.clusters_ok): from 4 splits,
    clusters of up to 8 (the splits rounded down to whole clusters): the larger the cluster, the
    fewer partials go through global memory; fewer than 4 splits keep the global combine."""
    if not clusters or splits < 4:
        return splits, 1
    c = max(x for x in DECODE_CLUSTERS if x <= splits)
    return splits // c * c, c


def prefill_splits(n: int, H: int, max_keys: int, sm_count: int, plan_rows: int = 128,
                   min_split_keys: int = 512, target_blocks: int | None = None) -> int:
    """Key splits for a prefill launch whose blocks take plan_rows rows (16 nw wm): none while the
    row tiles alone give about two blocks per SM; otherwise enough to get there (long keys only: a
    split takes at least min_split_keys keys)."""
    blocks = -(-n // plan_rows) * H
    target = target_blocks or 2 * sm_count
    if blocks >= target:
        return 1
    return max(1, min(MAX_PREFILL_SPLITS, -(-target // blocks), -(-max_keys // min_split_keys)))


def decode_splits(n: int, KVH: int, sm_count: int, target_blocks: int | None = None,
                  clusters: bool = False) -> int:
    """The most splits a decode row may take, for a batch bucket of n rows: enough that the blocks
    of all (row, KV head) pairs about fill one wave of one block per SM, rounded down. More splits
    cost more than they spread (a second wave, and more partials to combine).
    clusters (the splits combine in thread-block clusters): where even MAX_DECODE_SPLITS splits leave
    SMs idle (one or two rows), up to two blocks per SM and MAX_CLUSTER_SPLITS. A row just past 4,096
    keys then takes 65 splits of 64 keys, not 33 of 128 (chunks are whole 64-key block passes)."""
    if clusters and target_blocks is None and n * KVH * MAX_DECODE_SPLITS <= sm_count:
        return max(1, min(MAX_CLUSTER_SPLITS, 2 * sm_count // (n * KVH)))
    target = target_blocks or sm_count
    return max(1, min(MAX_DECODE_SPLITS, target // (n * KVH)))


def decode_spins(plan: Plan, sm_count: int, per_sm: int) -> bool:
    """Whether a cluster plan's last level waits in cluster 0 (flash_decode.cu) instead of electing the
    last cluster by a counter; per_sm: decode blocks an SM holds (FlashKernels.spins asks the driver).
    A waiting block keeps its slot until the partials it waits for are written, so it may wait only
    where the blocks that write them can always be placed: the waiting blocks (cluster 0 of each row
    and KV head) take at most a quarter of the GPU's slots, which leaves some GPC with three quarters
    of its slots free, room for a cluster of 8 even at one block an SM (256-dim heads: shared memory).
    Waiting saves the counter's atomics and the fence before them."""
    return plan.cluster > 1 and 4 * plan.grid[1] * plan.grid[2] * plan.cluster <= per_sm * sm_count


def _check_dims(H: int, KVH: int, D: int) -> None:
    if D not in HEAD_DIMS:
        raise ValueError(f"flash attention: head_dim {D} not supported (kernels exist for {HEAD_DIMS})")
    if H <= 0 or KVH <= 0 or H % KVH:
        raise ValueError(f"flash attention: {H} q heads do not group over {KVH} KV heads")


class FlashScratch:
    """Split-K scratch on the device, sized for the largest plan it serves (grow with ensure;
    growing moves the buffers, so graphs that captured the old ones must be re-captured)."""

    def __init__(self) -> None:
        self.part = cupy.empty(0, cupy.float32)
        self.ml = cupy.empty(0, cupy.float32)
        self.counters = cupy.zeros(0, cupy.int32)

    def ensure(self, *plans: Plan) -> bool:
        """Grow to hold every plan given; True when a buffer moved."""
        grew = False
        need_p = max((p.part_floats for p in plans), default=0)
        need_m = 2 * max((p.ml_count for p in plans), default=0)
        need_c = max((p.counters for p in plans), default=0)
        if need_p > self.part.size:
            self.part, grew = cupy.empty(need_p, cupy.float32), True
        if need_m > self.ml.size:
            self.ml, grew = cupy.empty(need_m, cupy.float32), True
        if need_c > self.counters.size:
            self.counters, grew = cupy.zeros(need_c, cupy.int32), True
        return grew

    def args(self, plan: Plan) -> tuple:
        if (plan.part_floats > self.part.size or 2 * plan.ml_count > self.ml.size
                or plan.counters > self.counters.size):
            raise ValueError(f"flash attention: scratch too small for {plan.kernel} with {plan.splits} splits "
                             f"(needs {plan.part_floats} + {2 * plan.ml_count} floats and {plan.counters} counters, "
                             f"has {self.part.size} + {self.ml.size} and {self.counters.size}); call ensure(plan)")
        return _U64(self.part.data.ptr), _U64(self.ml.data.ptr), _U64(self.counters.data.ptr)

    @property
    def nbytes(self) -> int:
        return self.part.nbytes + self.ml.nbytes + self.counters.nbytes


class FlashKernels:
    """The flash entry points of one device, each compiled on first use into its own module (one
    variant per NVRTC call: a second or so each). Call `get` for every plan before capturing a graph."""

    def __init__(self, device_id: int = 0, prebuilt: bool = True):
        self.device = cupy.cuda.Device(device_id)
        self.prebuilt = prebuilt
        self.sm_count = int(self.device.attributes["MultiProcessorCount"])
        from .modules import smem_optin
        self.optin = smem_optin(device_id)
        self._mods: dict[tuple, Future] = {}
        self._per_sm: dict[Plan, int] = {}
        self._lock = threading.Lock()

    def prepare(self, *plans: Plan) -> None:
        """Start compiling the plans' modules in the background."""
        for p in plans:
            self._future(p)

    def _future(self, plan: Plan) -> Future:
        from .modules import _module, _pool
        fname = "flash_prefill.cu" if plan.kernel.startswith("flash_prefill") else "flash_decode.cu"
        key = (fname, plan.options, plan.kernel)
        with self._lock:
            fut = self._mods.get(key)
            if fut is None:
                def build():
                    with self.device:
                        opts = catalog.base_options(self.device.compute_capability) + plan.options
                        fn = _module(self.device.id, fname, opts, self.prebuilt).get_function(plan.kernel)
                        _ = fn.attributes              # load now, never during a capture
                        return fn
                fut = self._mods[key] = _pool.submit(build)   # the loader's threads: abandoned at exit
            return fut

    def get(self, plan: Plan):
        fn = self._future(plan).result()
        static = int(fn.shared_size_bytes)
        if plan.smem > self.optin - static:
            raise ValueError(f"flash attention: {plan.kernel} needs {plan.smem} bytes of dynamic shared memory; this "
                             f"device allows it {self.optin - static} ({self.optin} a block, {static} static): "
                             "flash.fits decides where it runs")
        if plan.smem > fn.max_dynamic_shared_size_bytes:
            fn.max_dynamic_shared_size_bytes = plan.smem
        return fn

    def spins(self, plan: Plan) -> bool:
        """decode_spins on this device (one block an SM where the driver cannot say)."""
        from .modules import resident_blocks
        per_sm = self._per_sm.get(plan)
        if per_sm is None:           # a driver call: once per plan, not on every eager launch
            per_sm = self._per_sm[plan] = resident_blocks(self.get(plan), plan.threads, plan.smem) or 1
        return decode_spins(plan, self.sm_count, per_sm)


_kernels: dict[tuple[int, bool], FlashKernels] = {}
_klock = threading.Lock()


def get_flash_kernels(device_id: int = 0, prebuilt: bool = True) -> FlashKernels:
    with _klock:
        fk = _kernels.get((device_id, prebuilt))
        if fk is None:
            fk = _kernels[device_id, prebuilt] = FlashKernels(device_id, prebuilt)
        return fk


def _scratch_args(scratch: FlashScratch | None, plan: Plan) -> tuple:
    if plan.splits == 1:
        return _U64(0), _U64(0), _U64(0)
    if scratch is None:
        raise ValueError(f"flash attention: {plan.kernel} with {plan.splits} splits needs a FlashScratch")
    return scratch.args(plan)


def _launch(fn, plan: Plan, args, pdl: bool) -> None:
    if pdl or plan.cluster > 1:
        launch = _pdl.launcher()
        if launch is None:
            raise ValueError(f"flash attention: {plan.kernel} in clusters of {plan.cluster} needs cuLaunchKernelEx")
        launch(fn, plan.grid, (plan.threads,), args, plan.smem, cupy.cuda.get_current_stream().ptr, pdl, plan.cluster)
    else:
        fn(plan.grid, (plan.threads,), args, shared_mem=plan.smem)


def _aligned(**ptrs: int) -> None:
    bad = [f"{k}={v:#x}" for k, v in ptrs.items() if v % 16]
    if bad:
        raise ValueError("flash attention: pointers must be 16-byte aligned: " + ", ".join(bad))


def _paging(max_blocks: int, bs_log2: int) -> None:
    if max_blocks <= 0 or not 0 <= bs_log2 <= 12:
        raise ValueError(f"flash attention: bad block table shape (max_blocks={max_blocks}, bs_log2={bs_log2})")


def prefill(fk: FlashKernels, plan: Plan, q: int, out: int, kpool: int, vpool: int, bt: int, max_blocks: int,
            bs_log2: int, slots: int, positions: int, n: int, H: int, KVH: int, D: int, scale: float, window: int,
            scratch: FlashScratch | None = None, o16: int = 0, min_split_keys: int = 512, pdl: bool = False,
            sinks: int = 0) -> None:
    """Prompt rows: q fp32 [n, H, D] (roped), K/V of every row's positions already in the pool
    (rope_kv); row t sees keys [start, positions[t]] of slot slots[t]. out fp32 [n, H, D] and, when
    given, o16 fp16 [n, H, D]. sinks: fp32 [H], each head's sink logit in its softmax (0: none).
    The plan must come from plan_prefill(n, H, D, ...)."""
    if plan.grid[1:] != (H, plan.splits) or plan.grid[0] * plan.rows < n or (plan.grid[0] - 1) * plan.rows >= n \
            or f"_d{D}_" not in plan.kernel:
        raise ValueError(f"flash prefill: plan {plan.kernel} {plan.grid} does not fit n={n}, H={H}, D={D}")
    _check_dims(H, KVH, D)
    _paging(max_blocks, bs_log2)
    _aligned(q=q, out=out, kpool=kpool, vpool=vpool)
    if min_split_keys <= 0:
        raise ValueError("flash prefill: min_split_keys must be positive")
    part, ml, cnt = _scratch_args(scratch, plan)
    fn = fk.get(plan)
    _launch(fn, plan, (_U64(q), _U64(out), _U64(o16), _U64(kpool), _U64(vpool), _U64(bt), _I32(max_blocks),
                       _I32(bs_log2), _U64(slots), _U64(positions), _I32(n), _I32(H), _I32(KVH), _F32(scale),
                       _I32(window), part, ml, cnt, _I32(min_split_keys), _U64(sinks)), pdl)


def decode(fk: FlashKernels, plan: Plan, q: int, out: int, kpool: int, vpool: int, bt: int, max_blocks: int,
           bs_log2: int, slots: int, positions: int, n: int, H: int, KVH: int, D: int, scale: float, window: int,
           scratch: FlashScratch | None = None, rope=None, o16: int = 0, oq: int = 0, od: int = 0,
           single_max: int = 256, split_keys: int = 64, pdl: bool = False, sinks: int = 0,
           head_norms=None) -> None:
    """Decode rows (one token per row, n = the batch bucket): out fp32 [n, H, D]; o16 fp16 and
    (oq int8, od float2 per 32 values) 8-bit blocks when given.
    rope = (k, v, rope_dim, neox, table): q, k, v are the step's unrotated fp32 rows ([n, H, D],
    [n, KVH, D] x 2); the kernel ropes q and k from table (ops.rope_table: float32 [positions,
    rope_dim / 2, 2]) and writes the new k and v to the pool at positions[t]. rope None: q is roped
    and the pool already holds every row's key (rope_kv ran).
    Rows with at most single_max keys run in one pass; longer rows split into chunks of at least
    split_keys keys (a multiple of 64), at most plan.splits per row. sinks: fp32 [H], each head's
    sink logit in its softmax (0: none). head_norms = (q_norm, k_norm, eps) with rope only: each head
    of q and the new k RMSNorm'd (fp32 [D] weights; a 0 pointer: that one not) before RoPE, as
    rms_norm over the heads would (kernels/head_norm.cuh); None: neither."""
    if plan.grid != (plan.splits, KVH, n) or f"_d{D}_" not in plan.kernel:
        raise ValueError(f"flash decode: plan {plan.kernel} {plan.grid} does not fit n={n}, KVH={KVH}, D={D}")
    _check_dims(H, KVH, D)
    _paging(max_blocks, bs_log2)
    _aligned(q=q, out=out, kpool=kpool, vpool=vpool)
    if split_keys <= 0 or split_keys % 64 or single_max < 0:
        raise ValueError(f"flash decode: split_keys must be a positive multiple of 64 (got {split_keys}) "
                         f"and single_max >= 0 (got {single_max})")
    if bool(oq) != bool(od):
        raise ValueError("flash decode: 8-bit output needs both oq and od")
    if rope is not None:
        kin, vin, rope_dim, neox, table = rope
        if not table:
            raise ValueError("flash decode: RoPE needs the cos/sin table (ops.rope_table)")
        if rope_dim <= 0 or rope_dim % 2 or rope_dim > D:
            raise ValueError(f"flash decode: rope_dim {rope_dim} must be even and at most head_dim {D}")
        fuse = 1
    else:
        if head_norms is not None:
            raise ValueError("flash decode: head norms are fused with RoPE only (else rms_norm first)")
        kin = vin = table = 0
        rope_dim, neox, fuse = D, False, 0
    qn, kn, eps = head_norms if head_norms is not None else (0, 0, 0.0)
    part, ml, cnt = _scratch_args(scratch, plan)
    fn = fk.get(plan)
    _launch(fn, plan, (_U64(q), _U64(kin), _U64(vin), _U64(out), _U64(o16), _U64(oq), _U64(od), _U64(kpool),
                       _U64(vpool), _U64(bt), _I32(max_blocks), _I32(bs_log2), _U64(slots), _U64(positions), _I32(n),
                       _I32(H), _I32(KVH), _F32(scale), _I32(window), _U64(table), _I32(rope_dim), _I32(int(neox)),
                       _I32(fuse), part, ml, cnt, _I32(single_max), _I32(split_keys),
                       _I32(int(fk.spins(plan))), _U64(sinks), _U64(qn), _U64(kn), _F32(eps)), pdl)
