"""The fp32-activation decoders of common.cuh (load_funit / funit_dot, used by mmvf.cu) run on the
CPU: tests/host/mmvf_decode.cpp compiles the header with g++ through shims of the CUDA intrinsics
it uses and compares every type's decoded weights (must be exact) and unit dot products
(fp32 accumulation) with the plain decoders (load_unit). Skipped where g++ is absent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GXX = shutil.which("g++")
TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
def test_funit_decoders_match_load_unit(tmp_path):
    exe = tmp_path / "mmvf_decode"
    r = subprocess.run([GXX, "-std=c++17", "-O1", "-w", "-I", str(ROOT / "realizar_backend" / "kernels"),
                        "-o", str(exe), str(ROOT / "tests" / "host" / "mmvf_decode.cpp")],
                       capture_output=True, text=True)
    if r.returncode != 0 and "_Float16" in r.stderr:
        pytest.skip("this g++ has no _Float16")
    assert r.returncode == 0, r.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    seen = set()
    for line in out.splitlines():
        name, werr, derr = line.split()
        seen.add(name)
        assert float(werr) == 0.0, line      # a f + c reproduces every weight exactly
        assert float(derr) <= 5e-6, line     # relative to sum |w x| of the unit
    assert seen == TYPES
