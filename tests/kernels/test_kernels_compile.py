"""Compile every kernels/*.cu with the local nvcc for sm_80 and sm_90 (runs on the CPU in CI),
so a syntax error in a kernel never lands. Skipped where nvcc is absent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "realizar_backend" / "kernels"
SOURCES = sorted(KERNELS.glob("*.cu"))
NVCC = shutil.which("nvcc")


def test_kernel_sources_present():
    names = {p.name for p in SOURCES}
    assert {"gemv.cu", "dequant.cu", "norm.cu", "rope.cu", "attention.cu", "elementwise.cu"} <= names
    assert (KERNELS / "common.cuh").exists()


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles(src, arch, tmp_path):
    out = tmp_path / (src.stem + ".cubin")
    r = subprocess.run([NVCC, f"-arch={arch}", "-cubin", "-std=c++17", "-I", str(KERNELS),
                        "-o", str(out), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 0
    # warnings are errors in waiting: a kernel must compile clean
    assert "warning" not in r.stderr.lower(), r.stderr
