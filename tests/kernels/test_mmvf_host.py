"""The fp32-activation decoders of common.cuh (load_funit / funit_dot, used by mmvf.cu) run on the
CPU: tests/host/mmvf_decode.cpp compiles the header with g++ through shims of the CUDA intrinsics
it uses and compares every type's decoded weights (must be exact) and unit dot products
(fp32 accumulation) with the plain decoders (load_unit). The device layouts of the regrouped
types (formats/gpu_layout.py) are decoded by all three decoders and compared with gguf's
dequantize of the GGUF bytes. Skipped where g++ is absent."""

from __future__ import annotations

import subprocess

import pytest

from support import host_emu
from support.host_emu import GXX
# the types the self-check compares on C++ random blocks (the others: test_decoders_give_gguf_values)
TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return host_emu.build("mmvf_decode.cpp", tmp_path_factory.mktemp("mmvf") / "mmvf_decode")


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
def test_funit_decoders_match_load_unit(exe):
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    seen = set()
    for line in out.splitlines():
        name, werr, derr = line.split()
        seen.add(name)
        assert float(werr) == 0.0, line      # a f + c reproduces every weight exactly
        assert float(derr) <= 5e-6, line     # relative to sum |w x| of the unit
    assert seen == TYPES


# every quantized type of the GPU's table, at row lengths of one block, of several, and of an odd
# number of blocks (rows then start at every alignment the device's arena gives them)
SHAPES = {32: [(3, 32), (3, 896), (2, 4864), (5, 160)], 256: [(3, 256), (2, 1536), (2, 4864), (3, 768)]}


def _cases():
    from realizar_backend.backends.cuda.matrices import QTYPES
    return [(q.name, rows, cols) for q, info in QTYPES.items() if info.blocks for rows, cols in SHAPES[info.block]]


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
@pytest.mark.parametrize("qname,rows,cols", _cases())
def test_decoders_give_gguf_values(exe, tmp_path, qname, rows, cols):
    """GGUF bytes of fresh random blocks -> the type's device layout (formats/gpu_layout.py, the
    NumPy twin of repack.cu) -> common.cuh's decoders: every weight equals gguf's own dequantize
    through load_unit (dequantize, embed, split16) and load_funit (mmvf.cu; load_qunit too where
    the type has one), and funit_dot holds fp32 accuracy against float64."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from realizar_backend.formats.gpu_layout import dequantize_device, device_row_bytes, to_device
    from realizar_backend.formats.quants import dequantize, random_matrix

    qt = Q[qname]
    rng = np.random.default_rng(rows * cols + int(qt))
    raw = random_matrix(qt, rows, cols, rng)
    ref = dequantize(raw, qt, (rows, cols)).astype(np.float64)
    assert np.all(np.isfinite(ref)) and np.abs(ref).max() > 0
    dev = to_device(qt, raw, cols)
    rb = device_row_bytes(qt, cols)
    assert dev.shape == (rows, rb)
    assert np.array_equal(dequantize_device(qt, dev, rows, cols), ref)
    path = tmp_path / "w.bin"
    path.write_bytes(dev.tobytes())
    out = subprocess.run([str(exe), str(path), str(cols), qname, str(rb)], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    dot = out[-2].split()
    assert dot[0] == "DOT" and float(dot[1]) <= 5e-6, out[-2]
    cells = [line.split() for line in out[:-2]]
    got = np.array([[float(c[0]), float(c[1])] for c in cells]).reshape(rows, cols, 2)
    for i, name in enumerate(("load_unit", "load_funit")):
        assert np.array_equal(got[..., i], ref), name
    if cells[0][2] != "-":
        assert np.array_equal(np.array([float(c[2]) for c in cells]).reshape(rows, cols), ref), "load_qunit"
