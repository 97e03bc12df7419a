"""The fp32-activation decoders of common.cuh (load_funit / funit_dot, used by mmvf.cu) run on the
CPU: tests/host/mmvf_decode.cpp compiles the header with g++ through shims of the CUDA intrinsics
it uses and compares every type's decoded weights (must be exact) and unit dot products
(fp32 accumulation) with the plain decoders (load_unit). The device layouts of the regrouped
types (formats/gpu_layout.py) are decoded by all three decoders and compared with gguf's
dequantize of the GGUF bytes. Skipped where g++ is absent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GXX = shutil.which("g++")
TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


def _build(tmp_path) -> Path:
    exe = tmp_path / "mmvf_decode"
    r = subprocess.run([GXX, "-std=c++17", "-O1", "-w", "-I", str(ROOT / "realizar_backend" / "kernels"),
                        "-o", str(exe), str(ROOT / "tests" / "host" / "mmvf_decode.cpp")],
                       capture_output=True, text=True)
    if r.returncode != 0 and "_Float16" in r.stderr:
        pytest.skip("this g++ has no _Float16")
    assert r.returncode == 0, r.stderr
    return exe


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
def test_funit_decoders_match_load_unit(tmp_path):
    exe = _build(tmp_path)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    seen = set()
    for line in out.splitlines():
        name, werr, derr = line.split()
        seen.add(name)
        assert float(werr) == 0.0, line      # a f + c reproduces every weight exactly
        assert float(derr) <= 5e-6, line     # relative to sum |w x| of the unit
    assert seen == TYPES


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
@pytest.mark.parametrize("qname,rows,cols", [("Q5_0", 3, 896), ("Q5_0", 2, 4864), ("Q8_0", 3, 896), ("Q8_0", 2, 1536),
                                             ("Q6_K", 3, 256), ("Q6_K", 2, 1536), ("Q6_K", 2, 4864)])
def test_device_layout_decodes_to_gguf_values(tmp_path, qname, rows, cols):
    """GGUF bytes -> the type's device layout (NumPy twin of repack.cu) -> common.cuh's decoders:
    every weight equals gguf's own dequantize, through load_unit, load_qunit and load_funit."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    from realizar_backend.formats.gpu_layout import dequantize_device, to_device
    from realizar_backend.formats.quants import dequantize

    qt = Q[qname]
    block, nbytes = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(rows * cols)
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    d_at = nbytes - 2 if qt == Q.Q6_K else 0
    blocks[:, d_at:d_at + 2] = (rng.random(n) * 0.02 + 0.005).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(rows, -1)
    ref = dequantize(raw, qt, (rows, cols)).astype(np.float64)
    dev = to_device(qt, raw, cols)
    assert np.array_equal(dequantize_device(qt, dev, rows, cols), ref)
    path = tmp_path / "w.bin"
    path.write_bytes(dev.tobytes())
    exe = _build(tmp_path)
    out = subprocess.run([str(exe), str(path), str(cols), qname], capture_output=True, text=True, check=True).stdout
    got = np.array(out.split(), np.float64).reshape(rows, cols, 3)
    for i, name in enumerate(("load_unit", "load_qunit", "load_funit")):
        assert np.array_equal(got[..., i], ref), name
