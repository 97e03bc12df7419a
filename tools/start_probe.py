"""Where a cold start's time goes before the first kernel runs, on the GPU machine.

    T0=$(date +%s.%N) CUPY_CACHE_DIR=$(mktemp -d) python3 tools/start_probe.py MODE MODEL.gguf

MODE phases:    imports, open_model, CUDA runtime init, primary context creation, one allocation
MODE nvrtc:     the start-up kernel modules compiled with NVRTC on 16 threads before any CUDA
                context exists (does NVRTC need one?), then the context
MODE overlap:   the same compiles with the context created on another thread at the same time
Prints one line per step: seconds since T0 (the shell's launch of python) and the step's own time.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

T0 = float(os.environ.get("T0", time.time()))


def mark(what: str, t_start: float) -> float:
    now = time.time()
    print(f"{now - T0:6.2f} s  {what:<48} {now - t_start:6.2f} s", flush=True)
    return now


def main() -> None:
    mode, model_path = sys.argv[1], sys.argv[2]
    t = mark("python up", T0)
    import cupy
    t = mark("import cupy", t)
    from realizar_backend.backends.cuda import backend, modules  # noqa: F401  (the real import chain)
    from realizar_backend.engine.engine import Engine  # noqa: F401
    from realizar_backend.formats import open_model
    t = mark("import realizar engine + cuda backend", t)
    model = open_model(model_path)
    t = mark("open_model", t)
    if mode == "phases":
        dev = cupy.cuda.Device(0)
        cc = dev.compute_capability
        t = mark(f"runtime init, compute capability {cc}", t)
        _ = dev.attributes["MultiProcessorCount"]
        t = mark("device attributes", t)
        dev.use()
        t = mark("cudaSetDevice (primary context)", t)
        cupy.cuda.runtime.free(0)
        t = mark("cudaFree(0)", t)
        cupy.empty(1 << 20, dtype=cupy.uint8)
        mark("first allocation", t)
        return
    qtypes = {x.qtype for x in model.tensors.values() if len(x.shape) == 2}
    jobs = core_jobs(modules, qtypes, model.config.head_dim)
    arch = "90"
    ctx_done = {}

    def context():
        t1 = time.time()
        cupy.cuda.runtime.setDevice(0)
        cupy.cuda.runtime.free(0)
        ctx_done["t"] = mark("context created (thread)", t1)

    th = None
    if mode == "overlap":
        th = threading.Thread(target=context)
        th.start()

    def compile_one(job):
        name, src, opts = job
        t1 = time.time()
        cupy.cuda.compiler.compile_using_nvrtc(src, opts + ("-ftz=true",), arch=arch)
        mark(f"nvrtc {name}", t1)

    t_c = time.time()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(compile_one, jobs))
    t = mark(f"all {len(jobs)} start-up modules compiled", t_c)
    if th is not None:
        th.join()
    else:
        context()
    mark("compiles and context both done", t_c)


def core_jobs(modules, qtypes, head_dim):
    """The modules a batch-1 start waits for (modules.Kernels' core set plus prefill.cu), with the
    options Kernels gives them."""
    types = {q for q in modules.QTYPES if q in qtypes}
    mask = sum(1 << int(q) for q in types)
    base = ("-std=c++17", "-DREALIZAR_CC=90")
    typed = base + (f"-DREALIZAR_QMASK={mask:#x}ull",)
    src = modules._source
    jobs = [(f"mmvf kind {k}", src("mmvf.cu"), typed + ("-DMMVF_NB=1", f"-DMMVF_KIND={k}")) for k in (1, 2)]
    jobs.append(("prefill", src("prefill.cu"), typed))
    jobs += [(f"attention kind {k}", src("attention.cu"),
              base + (f"-DATT_KIND={k}",) + ((f"-DATT_HEAD_DIM={head_dim}",) if k == 1 else ()))
             for k in (1, 2, 3, 4)]
    jobs.append(("dequant", src("dequant.cu"), typed))
    if any(q in modules.REGROUPED for q in types):
        jobs.append(("repack", src("repack.cu"), base))
    jobs += [(f, src(f), base) for f in ("elementwise.cu", "norm.cu", "rope.cu")]
    return jobs


if __name__ == "__main__":
    main()
