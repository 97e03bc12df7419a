"""Prebuilt kernel modules (kernels/cubin, tools/build_kernels.py) on the GPU: a prebuilt module
computes what the NVRTC-compiled one does, the loader takes prebuilt modules for everything a
model start needs on this GPU, and a cubin the driver refuses falls back to NVRTC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cc():
    cupy = pytest.importorskip("cupy")
    from realizar_backend.backends.cuda import modules
    from realizar_backend.kernels import catalog
    dev = cupy.cuda.Device(0)
    if catalog.find_prebuilt(catalog.source("norm.cu"), catalog.base_options(dev.compute_capability)) is None:
        pytest.skip(f"no prebuilt kernels for compute capability {dev.compute_capability}")
    if not modules._prebuilt_usable():
        pytest.skip("the driver is older than the CUDA of the prebuilt kernels")
    return dev.compute_capability


def _both(cc, filename: str, extra=()):
    """The module loaded from its prebuilt cubin and compiled with NVRTC."""
    from realizar_backend.backends.cuda import modules
    from realizar_backend.kernels import catalog
    opts = catalog.base_options(cc) + tuple(extra)
    pre = modules._module(0, filename, opts, prebuilt=True)
    assert modules.loaded_modules()[(0, filename, opts)].startswith("prebuilt"), "the cubin was not used"
    nvrtc = modules._module(0, filename, opts, prebuilt=False)
    assert pre.file_path and nvrtc.code, "one module of each kind"
    return pre, nvrtc


@pytest.mark.parametrize("rows,width", [(1, 896), (5, 576), (3, 2048), (2, 33)])
def test_prebuilt_rms_norm_equals_nvrtc(cc, rng, rows, width):
    import cupy
    from realizar_backend.model.math import rms_norm
    pre, nvrtc = _both(cc, "norm.cu")
    x = rng.standard_normal((rows, width)).astype(np.float32) * 3
    w = rng.standard_normal(width).astype(np.float32)
    dx, dw = cupy.asarray(x), cupy.asarray(w)
    outs = []
    for mod in (pre, nvrtc):
        fn = mod.get_function("rms_norm")
        out = cupy.full((rows, width), np.nan, np.float32)
        threads = 256 if width >= 256 else max(32, (width + 31) // 32 * 32)
        fn((rows,), (threads,), (dx, np.int32(width), dw, out, np.int32(width), np.int32(rows), np.int32(width),
                                 np.float32(1e-6), np.int32(0)))
        outs.append(cupy.asnumpy(out))
        print(f"{'prebuilt' if mod is pre else 'nvrtc':8} rms_norm: {fn.attributes['num_regs']} registers")
    np.testing.assert_allclose(outs[0], rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    diff = np.abs(outs[0] - outs[1]).max()
    assert np.array_equal(outs[0], outs[1]), f"prebuilt and NVRTC differ by up to {diff:g}"


def _act_mul(mod, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """elementwise.cu's act_mul (SiLU) on the device: a plain kernel to tell two modules apart."""
    import cupy
    n = g.size
    a = cupy.full(n, np.nan, cupy.float32)
    mod.get_function("act_mul")(((n + 255) // 256,), (256,), (cupy.asarray(g), cupy.asarray(u), a, np.int64(n),
                                                              np.int32(0)))
    return cupy.asnumpy(a)


def test_prebuilt_act_mul_equals_nvrtc(cc, rng):
    from realizar_backend.model.math import silu
    pre, nvrtc = _both(cc, "elementwise.cu")
    n = 100_003
    g, u = rng.standard_normal((2, n)).astype(np.float32) * 4
    outs = [_act_mul(mod, g, u) for mod in (pre, nvrtc)]
    np.testing.assert_allclose(outs[0], silu(g.astype(np.float64)) * u, rtol=1e-5, atol=1e-6)
    assert np.array_equal(outs[0], outs[1])


def test_prebuilt_modules_match_nvrtc_resources(cc):
    """Registers and local memory of every kernel of the prebuilt modules a start loads against
    NVRTC's: a spill only the prebuilt side has would be a loss of speed that the faster start must
    not hide. nvcc and NVRTC of one CUDA release do not make the same code kernel by kernel (with nvcc
    and NVRTC both 13.0.88 on an H200, 19 of 207 kernels have other register counts, and a kernel at
    its register cap, mmv8.cu's 64, spills a few bytes more under one or the other, either way round),
    so the prebuilt set is held to NVRTC's spills in total, of the same major release."""
    import cupy
    from realizar_backend.kernels import catalog
    served = catalog.find_prebuilt(catalog.source("norm.cu"), catalog.base_options(cc))[1][1]   # -DREALIZAR_CC=..
    arch = "sm_" + served.split("=")[1]
    built = divmod(catalog.manifest()["cuda_version"] // 10, 100)       # 13000 -> (13, 0)
    nvrtc_release = tuple(cupy.cuda.nvrtc.getVersion())
    wanted = [m for m in catalog.manifest()["modules"]
              if m["arch"] == arch and m["file"] != "gemv.cu"]          # gemv.cu: float matrices, loaded on first use

    def both(m):   # NVRTC releases the GIL: the modules compile side by side, as a start's do
        with cupy.cuda.Device(0):
            return m, _both(cc, m["file"], tuple(m["options"][2:]))

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        pairs = list(pool.map(both, wanted))
    rows = []
    for m, (pre, nvrtc) in pairs:
        for name in m["kernels"]:
            a, b = pre.get_function(name).attributes, nvrtc.get_function(name).attributes
            rows.append((m["file"], " ".join(m["options"][2:]), name, a["num_regs"], b["num_regs"],
                         a["local_size_bytes"], b["local_size_bytes"]))
    print(f"prebuilt: nvcc {catalog.manifest()['nvcc']}, NVRTC {nvrtc_release[0]}.{nvrtc_release[1]}")
    for r in rows:
        print("%-14s %-34s %-18s regs %3d / %3d  local %4d / %4d" % r)
    assert rows
    assert nvrtc_release[0] == built[0], f"prebuilt with CUDA {built}, NVRTC is {nvrtc_release}"
    pre_local, nvrtc_local = sum(r[5] for r in rows), sum(r[6] for r in rows)
    assert pre_local <= nvrtc_local, (f"the prebuilt kernels spill {pre_local} bytes of local memory in all, "
                                      f"NVRTC {nvrtc_release}'s {nvrtc_local}")

START = r"""
import json, sys, time
from gguf import GGMLQuantizationType as Q
from realizar_backend.backends.cuda import modules
t0 = time.perf_counter()
qtypes = {getattr(Q, n) for n in sys.argv[1].split(",")}
k = modules.get_kernels(0, qtypes, int(sys.argv[2]), wait=False)
k.ready(max_batch=int(sys.argv[3]))
modules.load_module(0, "prefill.cu", k.qtypes)
modules.load_module(0, "sampling.cu")
_ = [k.gemv[q] for q in k.gemv]                              # the families loaded on first use
_ = [(k.mmvf[nb], k.ffnf[nb]) for nb in modules.MMV_NB]      # and those loading in the background
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "loaded": [[f, list(o), v] for (d, f, o), v in modules.loaded_modules().items()]}))
"""


@pytest.mark.parametrize("mix,head_dim", [("Q4_K,Q6_K", 128), ("Q4_1,Q8_0", 64), ("Q4_K,Q6_K,Q8_0,F32", 128),
                                          ("Q4_K,Q6_K,BF16", 256), ("Q4_0", 96)])
def test_a_model_start_loads_only_prebuilt_modules(cc, mix, head_dim):
    """In a fresh process (as a start is), every module a model of this quant mix and head size
    asks for comes prebuilt, exactly or as the general module; nothing goes to NVRTC except the
    decode GEMVs (catalog.QMASK_EXACT) of a quant mask that ships none of its own."""
    from gguf import GGMLQuantizationType as Q

    from realizar_backend.backends.cuda.modules import QTYPES
    from realizar_backend.kernels import catalog
    mask = catalog.qmask_option({getattr(Q, n) for n in mix.split(",")} & set(QTYPES))
    shipped = mask in {catalog.qmask_option(m) for m in catalog.PREBUILT_QMASKS}
    r = subprocess.run([sys.executable, "-c", START, mix, str(head_dim), "256"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for f, opts, how in got["loaded"]:
        print(f"{f:14} {' '.join(opts[1:]):50} {how}")
    print(f"all kernels of the start in {got['seconds']:.2f} s")
    nvrtc = [(f, o) for f, o, how in got["loaded"] if not how.startswith("prebuilt")]
    own = [(f, o) for f, o in nvrtc if f in catalog.QMASK_EXACT and mask in o]
    assert bool(own) == (not shipped), (mask, own)
    others = [n for n in nvrtc if n not in own]
    assert not others, f"compiled with NVRTC although prebuilt kernels ship for sm_{cc}: {others}"
    assert {f for f, _, _ in got["loaded"]} >= {"mmvf.cu", "attention.cu", "dequant.cu", "prefill.cu",
                                                 "sampling.cu"}


def test_a_cubin_the_driver_refuses_falls_back_to_nvrtc(cc, rng, tmp_path, monkeypatch):
    import lzma

    from realizar_backend.backends.cuda import modules
    from realizar_backend.kernels import catalog
    # a manifest whose cubin for elementwise.cu (with an option no other test asks for) is garbage
    opts = catalog.base_options(cc) + ("-DREALIZAR_TEST_FALLBACK=1",)
    bad = tmp_path / "elementwise-bad.cubin.xz"
    bad.write_bytes(lzma.compress(b"\x7fELF not a module" * 64))
    monkeypatch.setattr(catalog, "_by_key", lambda: {catalog.module_key(catalog.source("elementwise.cu"), opts): bad})
    mod = modules._module(0, "elementwise.cu", opts, prebuilt=True)
    assert modules.loaded_modules()[(0, "elementwise.cu", opts)] == "nvrtc"
    from realizar_backend.model.math import silu
    g, u = rng.standard_normal((2, 1000)).astype(np.float32)
    np.testing.assert_allclose(_act_mul(mod, g, u), silu(g.astype(np.float64)) * u, rtol=1e-5, atol=1e-6)
