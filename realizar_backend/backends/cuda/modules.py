"""Kernel loading: every kernels/*.cu module loaded once per process and device with cupy.RawModule,
and one dispatch table per quant type (GGML type -> RawKernel) for each templated family.

A module comes prebuilt (kernels/cubin, made by tools/build_kernels.py) where one of exactly its
source and options, or a more general one (kernels/catalog.py), ships for this GPU; otherwise NVRTC
compiles it (and CuPy keeps it in its on-disk kernel cache)."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import cupy

from ...formats.gpu_layout import REGROUPED
from . import dispatch
from .matrices import QTYPES
from .support import DN_DELTA_K
from ...kernels import catalog
from ...kernels.catalog import MMQ_BN  # noqa: F401  (token-tile widths of mmq.cu, one module each)
from ...kernels.catalog import MMQ_DEPTH, mmq_smem_bytes  # noqa: F401  (mmq.py and the tests read them from here)
from ...kernels.catalog import MMV_NB  # noqa: F401  (activation rows per launch column; ops imports it here)
from ...kernels.catalog import source as _source

log = logging.getLogger(__name__)


class _Lazy:
    """A future that starts on first .result() (on the calling thread)."""

    def __init__(self, fn):
        self._fn, self._value, self._lock = fn, None, threading.Lock()

    def result(self):
        with self._lock:
            if self._fn is not None:
                self._value, self._fn = self._fn(), None
            return self._value


_occupancy = None


def resident_blocks(fn, threads: int, smem: int) -> int | None:
    """Blocks of kernel fn (threads each, smem bytes of dynamic shared memory) that one SM holds at
    once, from the driver's occupancy calculator; None where libcuda has no such entry point."""
    global _occupancy
    try:
        if _occupancy is None:
            f = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor
            f.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            f.restype = ctypes.c_int
            _occupancy = f
        n = ctypes.c_int()
        rc = _occupancy(ctypes.byref(n), fn.kernel.ptr, threads, smem)
    except (OSError, AttributeError):
        return None
    return n.value if rc == 0 else None


class _Family(Mapping):
    """A kernel family keyed by GGML type or batch width, whose modules compile in the background
    (or on first use): a lookup waits for its module. A decode step's eager run before its capture
    has loaded everything the step launches; modules of other families may still load on other
    threads during a capture, which the relaxed capture mode allows."""

    def __init__(self, entries: dict):
        self._f = entries                 # key -> (future of a module's {name: function}, name)

    def __getitem__(self, key):
        fut, name = self._f[key]
        return fut.result()[name]

    def __iter__(self):
        return iter(self._f)

    def __len__(self):
        return len(self._f)


# NVRTC releases the GIL: one compile per core, up to 16 (a GPU machine has them)
_pool = ThreadPoolExecutor(max_workers=max(4, min(16, os.cpu_count() or 4)), thread_name_prefix="nvrtc")


def _abandon_pending() -> None:
    # at interpreter exit, modules queued for the background (wider batches, sampling) that nothing
    # waited for are dropped instead of compiled: the pool's threads are joined right after this
    _pool.shutdown(wait=False, cancel_futures=True)


# threading's exit hooks run in reverse order, so this one runs before concurrent.futures joins
# the pool's threads (atexit would run after)
getattr(threading, "_register_atexit", lambda fn: None)(_abandon_pending)

_driver_version: int | None = None
_loaded: dict[tuple, str] = {}          # (device, file, options) -> "prebuilt <cubin>" or "nvrtc"
_loaded_lock = threading.Lock()


def _prebuilt_usable() -> bool:
    """The driver runs cubins of the nvcc that built the shipped ones (CUDA major.minor)."""
    global _driver_version
    need = catalog.manifest().get("cuda_version")
    if not need:
        return False
    with _loaded_lock:
        if _driver_version is not None:
            return _driver_version >= need
        _driver_version = cupy.cuda.runtime.driverGetVersion()
        if _driver_version < need:
            log.info("prebuilt kernels need a driver for CUDA %d.%d (this one: %d.%d): compiling with NVRTC",
                     need // 1000, need % 1000 // 10, _driver_version // 1000, _driver_version % 1000 // 10)
    return _driver_version >= need


def _module(device_id: int, filename: str, options: tuple[str, ...], prebuilt: bool = True) -> cupy.RawModule:
    """kernels/<filename> as a loaded module on the current device (device_id): the prebuilt cubin
    for its source and options (or a more general module, catalog.find_prebuilt) where one ships
    and prebuilt is on, else compiled with NVRTC (CuPy's disk cache makes a second start cheap)."""
    text = _source(filename)
    if prebuilt and _prebuilt_usable():
        hit = catalog.find_prebuilt(text, options, keep_mask=filename in catalog.QMASK_EXACT)
        if hit is None:
            log.debug("kernels %s %s: no prebuilt cubin, compiling with NVRTC", filename, " ".join(options[1:]))
        else:
            path, used = hit
            try:
                mod = cupy.RawModule(path=str(catalog.unpacked(path)))
                mod.compile()                      # cuModuleLoad now, on this thread
                if used != options:
                    log.debug("kernels %s %s: the prebuilt general module %s serves it", filename,
                              " ".join(options[1:]), path.name)
                with _loaded_lock:
                    _loaded[(device_id, filename, options)] = f"prebuilt {path.parent.name}/{path.name}"
                return mod
            except Exception as e:  # a driver that refuses the cubin (or no lzma): the source still compiles
                log.debug("kernels %s: prebuilt %s not loadable (%s), compiling with NVRTC", filename, path.name, e)
    mod = cupy.RawModule(code=text, options=options)
    mod.compile()
    with _loaded_lock:
        _loaded[(device_id, filename, options)] = "nvrtc"
    return mod


_optin: dict[int, int] = {}


def smem_optin(device_id: int) -> int:
    """The most shared memory a block of the device may have, static and dynamic together
    (cudaDevAttrMaxSharedMemoryPerBlockOptin), read once per device: the loader caps every dynamic
    shared memory it allows a kernel to it (dispatch.smem_limits); sampling.py sizes its gathers by it."""
    n = _optin.get(device_id)
    if n is None:
        rt = cupy.cuda.runtime
        n = _optin[device_id] = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id))
    return n


def loaded_modules() -> dict[tuple, str]:
    """(device, file, options) -> where each module loaded so far came from ("prebuilt <cubin>" or
    "nvrtc"): for logs and tests."""
    with _loaded_lock:
        return dict(_loaded)


class Kernels:
    """All RawKernels of one device. Attributes are plain functions; per-type families are mappings
    keyed by GGML type (or batch width), looked up once per launch, never searched.

    Modules ship prebuilt for common GPUs (loaded in milliseconds); elsewhere a first start
    compiles them with NVRTC. To keep that short: only the quant types of the model are compiled in
    (qtypes; None = all, for tests), every module loads on its own thread, the fast GEMVs build once
    per batch width, and the families a batch-1 start does not need (wider batches, the GEMVs of
    float matrices) load in the background or on first use; so does the batched-decode matrix
    multiply (mmq, one module per token-tile width), the routed experts (moe, for mixture-of-experts
    models only) and the Gated DeltaNet (deltanet, for linear-attention hybrids only). prebuilt=False: NVRTC for all."""

    def __init__(self, device_id: int, qtypes=None, head_dim: int | None = None, prebuilt: bool = True):
        dev = self.device = cupy.cuda.Device(device_id)
        # decode attention compiled for this head size only (None: any, up to 256)
        self.head_dim = head_dim
        cc = dev.compute_capability
        types = {q for q in QTYPES if qtypes is None or q in set(qtypes)}
        self.qtypes = frozenset(types)
        self.prebuilt = prebuilt
        opts = catalog.base_options(cc)
        # only the type-templated files see the mask; without one (qtypes None) they hold every type
        typed = () if _every_type(types) else (catalog.qmask_option(types),)
        self.sm_count = int(dev.attributes["MultiProcessorCount"])
        # the staged kernels' limits on this device (sm_80, sm_90: the catalog's; less shared memory
        # a block: a lesser plan, dispatch.smem_limits), which the dispatcher and launchers follow
        optin = smem_optin(device_id)
        self.smem = dispatch.smem_limits(optin)
        for what in self.smem.reductions():
            log.info("cuda kernels: %s: compute capability %s allows a block %d bytes of shared memory",
                     what, cc, optin)

        def build(fname: str, names, extra=(), smem: int = 0, lazy: bool = False):
            def run():
                t0 = time.perf_counter()
                with dev:
                    mod = _module(device_id, fname, opts + tuple(extra), prebuilt)
                    fns = {n: mod.get_function(n) for n in names}
                    for name, fn in fns.items():
                        if smem:   # staged activation rows / K-V tiles in dynamic shared memory
                            # never more than the device allows beside the kernel's static shared memory
                            # (attention.cu's attn_decode holds its state there and takes no dynamic)
                            static = int(fn.shared_size_bytes)
                            allowed = min(smem, optin - static)
                            if allowed < smem:
                                log.debug("kernels %s %s: %s allowed %d bytes of dynamic shared memory, not %d "
                                          "(the device's %d a block, %d of them static)", fname, " ".join(extra),
                                          name, allowed, smem, optin, static)
                            fn.max_dynamic_shared_size_bytes = allowed
                        _ = fn.attributes              # compile and load now, never during a capture
                log.debug("kernels %s %s ready in %.2f s", fname, " ".join(extra), time.perf_counter() - t0)
                return fns
            return _Lazy(run) if lazy else _pool.submit(run)

        sfx = {q: QTYPES[q].suffix for q in types}
        # A first start waits for the modules of a batch-1 step and of the prompt (prefill.cu), so
        # those are submitted first and alone, one per core (the batch-1 GEMVs, the slowest at
        # ~1.5 s, before the rest); the wider batches and sampling follow once they are in (ready()).
        # Sharing the cores with those (20 compiles on 16 threads) made the start ~1 s longer.
        def gemvs(nb: int, lazy: bool = False):
            return tuple(build("mmvf.cu", [f"{kind}_nb{nb}"], typed + catalog.mmvf_options(nb, i), self.smem.mmvf_rows,
                               lazy)
                         for i, kind in ((1, "mmvf"), (2, "ffnf")))
        self._mmvf = {1: gemvs(1)}
        # the LM head, and rows too long to stage, at one row: the same kernel with more rows a warp
        # group (catalog.MMVF_HEAD_R)
        self._mmvf_head = build("mmvf.cu", ["mmvf_nb1"], typed + catalog.mmvf_options(1, 1, head=True),
                                self.smem.mmvf_rows)
        # the one-row GEMVs on 8-bit activations (mmv8.cu): loaded with the core where the dispatcher
        # sends a type of the model to them (dispatch.MMV8_TYPES), else on first use (tests, benchmarks)
        eager8 = bool(types & dispatch.MMV8_TYPES)
        names8 = {1: ["mmv8_nb1", "mmv8_q8"], 2: ["ffn8_nb1"],
                  3: ["moe8_gate_up_nb1", "moe8_gemv_nb1", "moe8_down_combine_nb1"]}
        # (the experts' moe8 kernels where the dispatcher's MOE_PAIRS8 rule is on); without the Q4_K
        # ring where the device's blocks cannot hold it (self.smem: a module of its own options)
        mmv8 = {i: build("mmv8.cu", names, typed + catalog.mmv8_options(i, self.smem.mmv8_ring),
                         self.smem.mmv8_smem(i),
                         lazy=not eager8 or (i == 3 and not dispatch.MOE_PAIRS8))
                for i, names in names8.items()}
        self.mmv8 = _Family({"mmv8": (mmv8[1], "mmv8_nb1"), "q8": (mmv8[1], "mmv8_q8"), "ffn8": (mmv8[2], "ffn8_nb1"),
                             "moe8_gate_up": (mmv8[3], "moe8_gate_up_nb1"), "moe8_gemv": (mmv8[3], "moe8_gemv_nb1"),
                             "moe8_down_combine": (mmv8[3], "moe8_down_combine_nb1")})
        self._mmv8_xq = None
        self._deq = build("dequant.cu", [f"{p}_{x}" for x in sfx.values() for p in ("dequant", "embed")],
                          typed)
        # one module per attention entry point (attention.cu ATT_KIND): compiled in parallel
        hd = (f"-DATT_HEAD_DIM={head_dim}",) if head_dim else ()
        self._core = [build("attention.cu", [name], (f"-DATT_KIND={i}",) + (hd if i == 1 else ()),
                            smem=self.smem.attention)
                      for i, name in enumerate(catalog.ATT_KINDS, 1)]
        # Q5_0 / Q8_0 / Q6_K / MXFP4 matrices are regrouped on the GPU at upload (repack.cu, formats/gpu_layout.py)
        regrouped = [q for q in REGROUPED if q in types]
        repack = build("repack.cu", [f"repack_{sfx[q]}" for q in regrouped]) if regrouped else None
        self._core += [build("elementwise.cu", ["spin_ns",
                                                "act_mul", "add_rows", "split_pair", "sigmoid_mul", "gather_rows",
                                                "argmax_rows",
                                                "argmax_unpack",
                                                "decode_io_merge"]),
                       build("norm.cu", ["rms_norm"]),
                       build("rope.cu", ["rope_kv"])]
        _module_future(device_id, "prefill.cu", self.qtypes, prebuilt)   # loaded by its user (split16.py)
        # the GEMVs of float matrices (F32, F16, BF16): compiled on first use
        floats = [q for q in types if not QTYPES[q].blocks]
        gemv = build("gemv.cu", [f"{p}_{sfx[q]}" for q in floats for p in ("gemv", "ffn_gate_up")], typed, lazy=True)
        # the batched-decode matrix multiply (mmq.cu), one module per token-tile width, and its prep
        # (mmq_moe_bnBN: the grouped experts' tiles, in the same module)
        mmq = {bn: build("mmq.cu", [f"mmq_bn{bn}", f"mmq_moe_bn{bn}"], typed + (f"-DMMQ_BN={bn}",),
                         smem=mmq_smem_bytes(bn), lazy=True)
               for bn in MMQ_BN}
        mmq_prep = build("mmq.cu", ["mmq_prep"], ("-DMMQ_BN=0",), lazy=True)
        # its 8-bit-activation variant (-DMMQ_A8=1: int8 records, int8 mma), the same on first use
        mmq8 = {bn: build("mmq.cu", [f"mmq8_bn{bn}", f"mmq8_moe_bn{bn}"], typed + ("-DMMQ_A8=1", f"-DMMQ_BN={bn}"),
                          smem=mmq_smem_bytes(bn, a8=True), lazy=True)
                for bn in MMQ_BN}
        mmq8_prep = build("mmq.cu", ["mmq8_prep"], ("-DMMQ_A8=1", "-DMMQ_BN=0"), lazy=True)
        mmqs = build("mmqs.cu", ["mmqs_t8", "mmqs_t16"], typed, lazy=True)    # the same for 2..16 rows
        # the routed experts of mixture-of-experts models (moe.cu): loaded on first use, by such models only
        moe = build("moe.cu", ["moe_topk", "moe_combine", "moe_shared_add", "moe_bucket_count", "moe_bucket_fill"]
                    + [f"{p}_{sfx[q]}" for q in types
                                                            for p in ("moe_gate_up", "moe_gemv")], typed, lazy=True)
        # a linear-attention hybrid's Gated DeltaNet (deltanet.cu): loaded on first use, by such models only
        dn_deltas = ["dn_delta"] + [f"dn_{kind}_k{d}" for kind in ("delta", "chunk") for d in DN_DELTA_K]
        deltanet = build("deltanet.cu", ["dn_conv", *dn_deltas], lazy=True)
        self._gemvs, self._sfx = gemvs, sfx
        self._ready_lock = threading.Lock()
        self._ready = False

        # lookups that wait for their own module only: the weights upload (repack) can run while
        # the rest compiles
        self.repack = _Family({q: (repack, "repack_" + sfx[q]) for q in regrouped})
        self.gemv = _Family({q: (gemv, "gemv_" + sfx[q]) for q in floats})
        self.ffn_gate_up = _Family({q: (gemv, "ffn_gate_up_" + sfx[q]) for q in floats})
        self.mmq = _Family({**{bn: (mmq[bn], f"mmq_bn{bn}") for bn in MMQ_BN}, "prep": (mmq_prep, "mmq_prep"),
                            **{("moe", bn): (mmq[bn], f"mmq_moe_bn{bn}") for bn in MMQ_BN}})
        self.mmq8 = _Family({**{bn: (mmq8[bn], f"mmq8_bn{bn}") for bn in MMQ_BN}, "prep": (mmq8_prep, "mmq8_prep"),
                             **{("moe", bn): (mmq8[bn], f"mmq8_moe_bn{bn}") for bn in MMQ_BN}})
        self.mmqs = _Family({t: (mmqs, f"mmqs_t{t}") for t in (8, 16)})
        # keys: "conv", and the delta rule's kernels by name (support.dn_delta_kernel, dn_chunk_kernel)
        self.deltanet = _Family({"conv": (deltanet, "dn_conv"), **{name: (deltanet, name) for name in dn_deltas}})
        # keys: "topk", "combine", "shared_add", "bucket_count", "bucket_fill", ("gate_up", type), ("gemv", type)
        self.moe = _Family({"topk": (moe, "moe_topk"), "combine": (moe, "moe_combine"),
                            "shared_add": (moe, "moe_shared_add"), "bucket_count": (moe, "moe_bucket_count"),
                            "bucket_fill": (moe, "moe_bucket_fill"),
                            **{(p, q): (moe, f"moe_{p}_{sfx[q]}") for q in types for p in ("gate_up", "gemv")}})

    def mmv8_xq(self, nbytes: int) -> int:
        """Device pointer of the scratch rows mmv8_q8 writes and the mmv8.cu GEMV after it reads. One
        buffer a device serves every such pair: the launches of a stream take it in turn (mmv8_q8
        waits for the GEMV before it, the GEMV for its mmv8_q8). Allocated once, at the first launch
        (a step's eager run, before any capture), never moved: captured graphs keep its address."""
        if self._mmv8_xq is None:
            with self.device:
                self._mmv8_xq = cupy.empty(catalog.MMV8_XQ_BYTES, cupy.uint8)
        if nbytes > self._mmv8_xq.nbytes:
            raise ValueError(f"mmv8: {nbytes} bytes of quantized rows exceed its scratch ({catalog.MMV8_XQ_BYTES})")
        return self._mmv8_xq.data.ptr

    def ready(self, max_batch: int | None = None) -> "Kernels":
        """Wait for the modules a batch-1 start needs, then start the GEMVs for batches of up to
        max_batch rows (None: every width) and sampling in the background; wider ones load on first
        use. Every other attribute exists from here on."""
        with self._ready_lock:
            if self._ready:
                return self
            sfx, deq = self._sfx, self._deq
            self.dequant = {q: deq.result()["dequant_" + sfx[q]] for q in self.qtypes}
            self.embed = {q: deq.result()["embed_" + sfx[q]] for q in self.qtypes}
            for fut in self._core:
                for name, fn in fut.result().items():
                    setattr(self, name, fn)
            for fut in self._mmvf[1]:
                fut.result()
            self.mmvf_head = self._mmvf_head.result()["mmvf_nb1"]
            eager = MMV_NB[-1] if max_batch is None else next((v for v in MMV_NB if v >= max_batch), MMV_NB[-1])
            self._mmvf.update({nb: self._gemvs(nb, lazy=nb > eager) for nb in MMV_NB[1:]})
            _module_future(self.device.id, "sampling.cu", None, self.prebuilt)   # loaded by its user (sampling.py)
            self.mmvf = _Family({nb: (self._mmvf[nb][0], f"mmvf_nb{nb}") for nb in MMV_NB})
            self.ffnf = _Family({nb: (self._mmvf[nb][1], f"ffnf_nb{nb}") for nb in MMV_NB})
            self._ready = True
        came = [v for (d, _, _), v in loaded_modules().items() if d == self.device.id]
        n_pre = sum(v.startswith("prebuilt") for v in came)
        log.info("cuda kernels for compute capability %s: core ready, %d quant types, %d modules prebuilt and "
                 "%d compiled with NVRTC so far; wider batches and sampling load in the background, the GEMVs "
                 "of float matrices on first use", self.device.compute_capability, len(self.qtypes), n_pre,
                 len(came) - n_pre)
        return self


_cache: dict[tuple, Kernels] = {}
_lock = threading.Lock()
_extra: dict[tuple, Future] = {}
_extra_lock = threading.Lock()      # taken inside Kernels() while get_kernels holds _lock


def _every_type(qtypes) -> bool:
    """qtypes (None: all) covers the GPU's quant table: the module needs no quant mask."""
    return qtypes is None or frozenset(qtypes) >= frozenset(QTYPES)


def _module_future(device_id: int, filename: str, qtypes=None, prebuilt: bool = True):
    qtypes = None if _every_type(qtypes) else frozenset(qtypes)
    key = (device_id, filename, qtypes)
    with _extra_lock:
        fut = _extra.get(key)
        if fut is None:
            def run():
                t0 = time.perf_counter()
                dev = cupy.cuda.Device(device_id)
                opts = catalog.base_options(dev.compute_capability)
                if qtypes is not None:
                    opts += (catalog.qmask_option(qtypes),)
                with dev:
                    mod = _module(device_id, filename, opts, prebuilt)
                log.debug("kernels %s ready in %.2f s", filename, time.perf_counter() - t0)
                return mod
            fut = _extra[key] = _pool.submit(run)
        return fut


def load_module(device_id: int, filename: str, qtypes=None) -> cupy.RawModule:
    """One more kernels/*.cu file (compiled once per process, device and quant-type set, on the
    compile threads; Kernels starts the ones the model will need), for kernel families that live
    beside the core table (prefill, sampling). Load every function you will launch before any
    graph capture: a capture must not load a module."""
    return _module_future(device_id, filename, qtypes).result()


def get_kernels(device_id: int = 0, qtypes=None, head_dim: int | None = None, wait: bool = True,
                prebuilt: bool = True) -> Kernels:
    """The kernels of a device, compiled for the quant types given (None: every type) and, for
    decode attention, the head size given (None: every size). wait=False returns while they
    load: call .ready() before using anything but the mappings built in Kernels.__init__.
    prebuilt=False compiles every module with NVRTC (Settings.prebuilt_kernels)."""
    types = None if _every_type(qtypes) else frozenset(q for q in qtypes if q in QTYPES)
    key = (device_id, types, head_dim, prebuilt)
    with _lock:
        k = _cache.get(key)
        if k is None:
            k = _cache[key] = Kernels(device_id, key[1], head_dim, prebuilt)
    return k.ready() if wait else k
