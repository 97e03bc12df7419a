"""Every Python file of the package, its tools and its benchmarks parses. The CUDA backend's modules
are imported only on a machine with a GPU, so without this a syntax error there would pass the CPU
suite."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for d in ("realizar_backend", "tools", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_parses(path):
    compile(path.read_text(), str(path), "exec", dont_inherit=True)
