"""The host cost of the CUDA backend's prompt and decode steps, measured on a machine without a GPU.

A prompt step whose graph key is new runs its launches from Python (eagerly, then once more while a
CUDA graph captures it): its time to first token is the host's. This tool runs the backend's real
Python path (CUDABackend._prefill_forward, Forward.decode_step) in a process of its own against a
stand-in `cupy` whose arrays are NumPy arrays (device pointers: their host addresses), whose kernel
launches and cuBLAS calls do nothing but count (and, with --record, log themselves), and whose
streams capture nothing. What it times is therefore the Python above the launches: the model's
operations, the dispatcher, the families' argument packing; CuPy's own per-launch cost (a few us a
launch on a real GPU machine) comes on top, in proportion to the launches counted.

    python3 benchmarks/host_cost.py                          # this tree
    python3 benchmarks/host_cost.py --tree /work/baseline    # another checkout (its own process)
    python3 benchmarks/host_cost.py --record launches.json   # also log every launch of each step
    python3 benchmarks/host_cost.py --check launches.json    # ... and compare with a log made before

Steps: a 128-token prompt of one sequence and a 2048-token step of 16 sequences of 128 (both on the
split16 GEMMs, where the dispatcher sends them), each run eagerly (cuda_graphs off: the host cost
of one pass of launches) and as a new graph key is paid (graphs on, key forgotten: the pass and
its capture pass); a decode step's eager pass per bucket (1, 16). --record also logs the engine's
steps through the backend's public calls, greedy and sampled (penalties, a mask, a bias, logprobs):
decode steps pipelined as engine/pipeline.py runs them (the next step started on the device's
tokens, a prompt step behind a decode step, a continuation over another batch) and prompt steps
that draw a first token; a tree from before the model runner's calls runs them on its own. The model: a Qwen2.5-shaped
synthetic GGUF (qwen2, 28 layers, Q4_K with Q6_K V/down/head, head size 128, small widths: the
launches per step are a 7B's). --record logs launches with device pointers as (allocation number,
offset), so that two runs of code that allocates in the same order compare equal; --check fails
(exit 1) on the first launch that differs.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from bisect import bisect_right
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np

HERE = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------- stand-in cupy
_allocs: list[tuple[int, int, int]] = []       # (start, end, number) of every device allocation, by start
_starts: list[int] = []
_nalloc = 0
_held: list = []        # every allocation's buffer, never freed: no address is reused, so it names one allocation
LOG: list | None = None                        # launches when recording
COUNT = [0]                                    # launches (kernels and cuBLAS calls) so far


def _register(start: int, nbytes: int) -> None:
    global _nalloc
    i = bisect_right(_starts, start)
    _starts.insert(i, start)
    _allocs.insert(i, (start, start + max(nbytes, 1), _nalloc))
    _nalloc += 1


def _name(v: int) -> str:
    """A pointer as "a<allocation>+<offset>", stable across runs that allocate in the same order."""
    i = bisect_right(_starts, v) - 1
    if i >= 0 and v < _allocs[i][1]:
        return f"a{_allocs[i][2]}+{v - _allocs[i][0]}"
    return "ptr?"


def _arg(a):
    if isinstance(a, np.generic):
        v = a.item()
        if a.dtype == np.uint64 and v > 1 << 20:
            return [a.dtype.str, _name(v)]
        return [a.dtype.str, v]
    return [type(a).__name__, a if isinstance(a, (int, float, bool)) else repr(a)]


class _Mem:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def copy_from_host(self, src, nbytes):
        ctypes.memmove(self.ptr, src, nbytes)

    def copy_from_host_async(self, src, nbytes, stream=None):
        ctypes.memmove(self.ptr, src, nbytes)

    def copy_to_host(self, dst, nbytes):
        ctypes.memmove(dst, self.ptr, nbytes)

    def copy_from_device(self, src, nbytes):
        ctypes.memmove(self.ptr, src.ptr, nbytes)

    def __add__(self, off: int):
        return _Mem(self.ptr + off)


class ndarray(np.ndarray):
    """A NumPy array that answers as a CuPy array does: .data.ptr (its address), .set, .get."""

    def __array_finalize__(self, obj):
        self._mem = _Mem(self.__array_interface__["data"][0])

    @property
    def data(self):
        return self._mem

    def set(self, arr, stream=None):
        np.ndarray.__setitem__(self, Ellipsis, arr)

    def get(self, stream=None, out=None, blocking=True):
        if out is not None:
            np.copyto(out, self)
            return out
        return np.array(self, copy=True).view(np.ndarray)


def _empty(shape, dtype=np.float32, order="C"):
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) if not isinstance(shape, int) else shape
    raw = np.empty(n * dt.itemsize + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    _held.append(raw)
    a = raw[off:off + n * dt.itemsize].view(dt).reshape(shape).view(ndarray)
    _register(a.data.ptr, a.nbytes)
    return a


def _zeros(shape, dtype=np.float32):
    a = _empty(shape, dtype)
    np.ndarray.fill(a, 0)
    return a


def _full(shape, value, dtype=np.float32):
    a = _empty(shape, dtype)
    np.ndarray.fill(a, value)
    return a


def _asarray(x, dtype=None):
    x = np.asarray(x, dtype)
    a = _empty(x.shape, x.dtype)
    np.ndarray.__setitem__(a, Ellipsis, x)
    return a


class _Kernel:
    """A RawKernel whose launches count (and log, when recording)."""

    num_regs, shared_size_bytes = 64, 0

    def __init__(self, name: str):
        self.name = name
        self.kernel = NS(ptr=id(self))
        self.max_dynamic_shared_size_bytes = 0

    @property
    def attributes(self):
        return {"num_regs": 64, "shared_size_bytes": 0, "max_threads_per_block": 1024}

    def __call__(self, grid, block, args, shared_mem=0, **kw):
        COUNT[0] += 1
        if LOG is not None:
            LOG.append([self.name, [int(g) for g in grid], [int(b) for b in block], [_arg(a) for a in args],
                        int(shared_mem)])


class _Module:
    def __init__(self, code=None, options=(), path=None, **kw):
        pass

    def compile(self, *a, **kw):
        pass

    def get_function(self, name):
        return _Kernel(name)


class _Graph:
    def launch(self, stream=None):
        pass

    def upload(self, stream=None):
        pass


_stack: list = []


class _Stream:
    _n = 0

    def __init__(self, null=False, non_blocking=False, ptr=None):
        _Stream._n += 1
        self.ptr = 0 if null else 0x5000 + _Stream._n

    def __enter__(self):
        _stack.append(self)
        return self

    def __exit__(self, *exc):
        _stack.pop()

    def use(self):
        _stack.append(self)
        return self

    def synchronize(self):
        pass

    def begin_capture(self, mode=None):
        pass

    def end_capture(self):
        return _Graph()

    def record(self, event=None):
        return event or _Event()

    def wait_event(self, event):
        pass


_NULL = _Stream(null=True)


def _current_stream():
    return _stack[-1] if _stack else _NULL


class _Event:
    done = True

    def __init__(self, *a, **kw):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Device:
    def __init__(self, device=None):
        self.id = device or 0
        self.compute_capability = "90"
        self.attributes = {"MultiProcessorCount": 132}

    def use(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def synchronize(self):
        pass


class _Pinned:
    def __init__(self, size, flags=0):
        self.buf = bytearray(size)
        _held.append(self.buf)
        self.ptr = np.frombuffer(self.buf, np.uint8).ctypes.data
        _register(self.ptr, size)

    def __buffer__(self, flags):          # np.frombuffer(pinned memory)
        return memoryview(self.buf)


def _pinned_pointer(mem, offset):
    return memoryview(mem.buf)[offset:]


def _alloc_pinned(size):
    return _Pinned(size).buf


def _runtime():
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.memGetInfo = lambda: (100 << 30, 140 << 30)
    rt.deviceSynchronize = lambda: None
    rt.getDeviceProperties = lambda d: {"name": b"host stand-in", "multiProcessorCount": 132}
    rt.driverGetVersion = lambda: 12080
    rt.runtimeGetVersion = lambda: 12080
    rt.getDeviceCount = lambda: 1
    rt.setDevice = lambda d: None
    rt.free = lambda p: None
    rt.deviceGetAttribute = lambda attr, dev: 232448
    rt.cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
    rt.streamCaptureModeRelaxed = 2
    rt.streamCaptureModeGlobal = 0
    rt.hostAllocMapped, rt.hostAllocPortable = 2, 1
    rt.memcpyHostToDevice, rt.memcpyDeviceToHost = 1, 2
    rt.memsetAsync = lambda *a: None
    rt.memcpyAsync = lambda *a: None
    rt.memcpy2DAsync = lambda *a: None
    return rt


def install_cupy() -> None:
    """Put the stand-in `cupy` in sys.modules (before anything imports the CUDA backend)."""
    cp = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cp.__version__ = "13.0.0-host-stand-in"
    cp.ndarray = ndarray
    for n in ("float32", "float16", "int32", "uint32", "uint64", "uint8", "int8", "uint16", "int64"):
        setattr(cp, n, getattr(np, n))
    cp.empty, cp.zeros, cp.full, cp.asarray = _empty, _zeros, _full, _asarray
    cp.RawModule = _Module
    cp.RawKernel = lambda code, name, **kw: _Kernel(name)
    cp.get_default_memory_pool = lambda: NS(free_bytes=lambda: 0, free_all_blocks=lambda: None,
                                            used_bytes=lambda: 0)
    cuda.Stream, cuda.Event, cuda.Device = _Stream, _Event, _Device
    cuda.get_current_stream = _current_stream
    cuda.alloc_pinned_memory = _alloc_pinned
    cuda.PinnedMemory = _Pinned
    cuda.PinnedMemoryPointer = _pinned_pointer
    cuda.get_elapsed_time = lambda a, b: 0.0
    cuda.runtime = _runtime()
    cuda.memory = types.ModuleType("cupy.cuda.memory")
    cuda.memory.OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})
    cuda.compiler = types.ModuleType("cupy.cuda.compiler")
    cuda.device = types.ModuleType("cupy.cuda.device")
    cuda.device.get_cublas_handle = lambda: 0
    cuda.Device.__module__ = "cupy.cuda"
    cp.cuda = cuda
    sys.modules.update({"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": cuda.runtime,
                        "cupy.cuda.memory": cuda.memory, "cupy.cuda.compiler": cuda.compiler,
                        "cupy.cuda.device": cuda.device})


def install_blas() -> None:
    """The backend's own cuBLAS handle (blas.py), its Python kept, its library calls counted."""
    from realizar_backend.backends.cuda import blas as B

    b = B.Blas.__new__(B.Blas)
    b.handle, b._stream = 1, None
    b.workspace = _empty(B.WORKSPACE_BYTES, np.uint8)
    b._set_stream = b._set_workspace = lambda *a: 0

    def gemm(*a):
        COUNT[0] += 1
        if LOG is not None:
            LOG.append(["cublasGemmEx", [x if not (isinstance(x, int) and x > 1 << 20) else _name(x) for x in a[1:]]])
        return 0
    b._gemm = gemm
    B._handles[0] = b


# ---------------------------------------------------------------------------------------- the model
MODEL_DIMS = {"n_layers": 28, "hidden": 256, "n_heads": 2, "n_kv_heads": 1, "head_dim": 128, "ffn": 512, "tied": False,
              "seed": 1}


def write_model(path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from gguf import GGMLQuantizationType as Q

    from tests.support.synth import write_gguf

    def qt(name: str):
        if name.endswith(("attn_v.weight", "ffn_down.weight")) or name == "output.weight":
            return Q.Q6_K
        return Q.Q4_K if name.endswith(".weight") and "norm" not in name else None
    write_gguf(path, "qwen2", qtypes=qt, context_length=4096, **MODEL_DIMS)


# ---------------------------------------------------------------------------------------- the child
def _median_us(fn, reps: int) -> tuple[float, int]:
    """Median host microseconds of fn() and the launches one call makes."""
    fn()
    n0 = COUNT[0]
    fn()
    per = COUNT[0] - n0
    ts = []
    gc.collect()
    gc.disable()            # a collection inside one repetition is noise, not the step's cost
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return statistics.median(ts) * 1e6, per


def child(model: str, reps: int, record: str | None, profile: str | None) -> None:
    global LOG
    install_cupy()
    import logging
    logging.basicConfig(level=logging.WARNING)
    install_blas()
    from realizar_backend.backends import PrefillItem
    from realizar_backend.backends.cuda.backend import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings

    def backend(graphs: bool):
        s = Settings(self_check=False, prebuilt_kernels=False, cuda_graphs=graphs, max_num_seqs=256,
                     context_length=4096, kv_cache_tokens=8192)
        return CUDABackend(open_model(model), settings=s)

    rng = np.random.default_rng(0)
    steps = {"prompt 128 x1": [PrefillItem(0, rng.integers(3, 200, 128).astype(np.int32), 0)],
             "prompt 2048 x16": [PrefillItem(s, rng.integers(3, 200, 128).astype(np.int32), 0) for s in range(16)]}
    eager, graphed = backend(False), backend(True)
    for be in (eager, graphed):
        for s in range(16):
            be.set_block_table(s, list(range(s * 16, s * 16 + 16)))
    out: dict = {}
    for name, items in steps.items():
        def run(be=eager, items=items):
            with be.device, be.stream:
                be.prefill(items)

        def capture_step(be=graphed, items=items):
            # a split16 key's first step runs eagerly and is remembered; its second runs eagerly and
            # is captured: the step timed (the median repetition of `realizar bench`'s prompt figure)
            with be.device, be.stream:
                be.prefill_graphs.graphs.clear()
                be.prefill_graphs.status.clear()
                be.prefill_graphs._seen.clear()
                be.prefill(items)
                n0 = COUNT[0]
                t0 = time.perf_counter()
                be.prefill(items)
                return time.perf_counter() - t0, COUNT[0] - n0
        us, n = _median_us(run, reps)
        cap = [capture_step() for _ in range(max(3, reps // 2))]
        out[name] = {"eager_us": round(us), "launches": n,
                     "capture_step_us": round(statistics.median(t for t, _ in cap) * 1e6),
                     "capture_step_launches": cap[-1][1]}
    for b in (1, 16):
        def dec(be=eager, b=b):
            with be.device, be.stream:
                be.fwd.decode_step(b, False)
        us, n = _median_us(dec, reps)
        out[f"decode {b} eager"] = {"eager_us": round(us), "launches": n}
    if profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            with eager.device, eager.stream:
                if profile.startswith("decode"):
                    eager.fwd.decode_step(int(profile.split()[1]), False)
                else:
                    eager.prefill(steps[profile])
        pr.disable()
        pstats.Stats(pr, stream=sys.stderr).sort_stats(os.environ.get("HC_SORT", "tottime")).print_stats(int(os.environ.get("HC_N", "30")))
    if record:
        logs = {}
        for name, items in steps.items():
            LOG = []
            with eager.device, eager.stream:
                eager.prefill(items)
            logs[name] = LOG
        for b in (1, 16):
            LOG = []
            with eager.device, eager.stream:
                eager.fwd.decode_step(b, False)
            logs[f"decode {b}"] = LOG
        from engine_steps import PIPELINED, pipelined
        for name in PIPELINED:
            LOG = []
            pipelined(eager, name, rng)
            logs[name] = LOG
        LOG = None
        Path(record).write_text(json.dumps(logs))
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------- the parent
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(HERE), help="the checkout whose backend runs (default: this one)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--record", help="write each step's launches here (JSON)")
    ap.add_argument("--check", help="a --record file from before: the launches must be the same")
    ap.add_argument("--profile", choices=("prompt 128 x1", "prompt 2048 x16", "decode 1", "decode 16"),
                    help="cProfile that eager step (20 runs) to stderr; HC_SORT, HC_N: pstats' order and rows")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.reps, a.record, a.profile)
        return
    tree = Path(a.tree).resolve()
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "qwen2-28L.gguf"
        write_model(model)
        record = a.record or (str(Path(d) / "launches.json") if a.check else None)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model), "--reps", str(a.reps)]
        cmd += ["--record", record] if record else []
        cmd += ["--profile", a.profile] if a.profile else []
        # the tree's package, not this one's: its own directory and PYTHONPATH (cwd shadows others)
        env = dict(os.environ, PYTHONPATH=str(tree))
        r = subprocess.run(cmd, check=False, cwd=tree, env=env, capture_output=True, text=True)
        sys.stderr.write(r.stderr)
        if r.returncode:
            sys.exit(r.returncode)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"tree {tree}")
        for name, v in res.items():
            print(f"  {name:18s} " + "  ".join(f"{k} {x}" for k, x in v.items()))
        if a.check:
            old, new = json.loads(Path(a.check).read_text()), json.loads(Path(record).read_text())
            for step in old:
                o, n = old[step], new.get(step, [])
                for i, (x, y) in enumerate(zip(o, n)):
                    if x != y:
                        print(f"launch {i} of {step} differs:\n  before {x}\n  after  {y}")
                        sys.exit(1)
                if len(o) != len(n):
                    print(f"{step}: {len(o)} launches before, {len(n)} after")
                    sys.exit(1)
            print(f"launches identical to {a.check} ({', '.join(f'{s}: {len(v)}' for s, v in old.items())})")


if __name__ == "__main__":
    main()
