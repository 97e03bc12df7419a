"""The host emulators of tests/host/ (CUDA kernels compiled with g++ and run on the CPU), from the
Python side: `build` compiles one (the tests' module fixtures), `launch` runs one launch of an
emulator that reads a directory (attention_emu, deltanet_emu, flash_emu, moe_emu, moe_grouped_emu
through tests/host/emu_io.h): params.txt, each input array as NAME.bin, each output read back from
NAME_after.bin. The tests skip themselves where GXX is None."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "realizar_backend" / "kernels"
HOST = ROOT / "tests" / "host"
GXX = shutil.which("g++")


def build(source: str, exe: Path, *, flags=("-std=c++17", "-O1"), include_first: Path | None = None,
          lacks: tuple[str, str] = ("_Float16", "_Float16")) -> Path:
    """Compiles tests/host/SOURCE into exe, against the kernels (include_first: a folder searched
    before them, for a changed copy of a kernel source). lacks = (word, what): skips the test where
    the compiler's error names the word (a g++ without _Float16, or without C++20's <barrier>)."""
    inc = ([include_first] if include_first else []) + [KERNELS]
    r = subprocess.run([GXX, *flags, "-w", *[a for d in inc for a in ("-I", str(d))], "-o", str(exe),
                        str(HOST / source)], capture_output=True, text=True)
    if r.returncode != 0 and lacks[0] in r.stderr:
        pytest.skip(f"this g++ has no {lacks[1]}")
    assert r.returncode == 0, r.stderr
    return exe


def launch(exe: Path, d: Path, params: dict, arrays: dict, outputs: dict, *, env: dict | None = None,
           timeout: int = 600, label: str = "") -> dict[str, np.ndarray]:
    """One launch in the directory d (made here where it is not there yet): params (name -> value,
    written with str), arrays (name -> ndarray), outputs (name -> dtype, read back flat, or (dtype,
    shape)). env: added to the environment (EMU_SEED, EMU_CP_EAGER). label heads the message where
    the emulator fails."""
    d.mkdir(exist_ok=True)
    (d / "params.txt").write_text("".join(f"{k} {v}\n" for k, v in params.items()))
    for name, a in arrays.items():
        np.ascontiguousarray(a).tofile(d / f"{name}.bin")
    r = subprocess.run([str(exe), str(d)], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **env) if env else None)
    assert r.returncode == 0, f"{label}: emulator failed ({r.returncode}): {r.stderr[-3000:]}"
    res = {}
    for n, dt in outputs.items():
        dt, shape = dt if isinstance(dt, tuple) else (dt, -1)
        res[n] = np.fromfile(d / f"{n}_after.bin", dt).reshape(shape)
    return res
