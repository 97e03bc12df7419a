"""kernels/sampling.cu run on the CPU (tests/host/sampling_emu.cpp: a thread per CUDA thread,
barriers for __syncthreads and warp exchanges) against the NumPy twin: the same token on every
row, on every path of the kernels (shared-memory gathers of one or many bins, the radix select
of a bin too dense to gather, ties by index order, penalties with counts kept between steps),
and the per-row scratch left zeroed. The GPU tests (tests/gpu/test_sampling_gpu.py) check the
same on the device. Skipped where g++ (with C++20's <barrier>) is absent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from realizar_backend.backends.base import SampleRow
from realizar_backend.backends.sampling import kernel_params, raw_logprobs, sample_logits

ROOT = Path(__file__).resolve().parents[1]
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    exe = tmp_path_factory.mktemp("emu") / "sampling_emu"
    r = subprocess.run([GXX, "-std=c++20", "-O2", "-ffp-contract=off", "-w", "-pthread",
                        "-I", str(ROOT / "realizar_backend" / "kernels"), "-o", str(exe),
                        str(ROOT / "tests" / "host" / "sampling_emu.cpp")], capture_output=True, text=True)
    if r.returncode != 0 and "barrier" in r.stderr:
        pytest.skip("this g++ has no <barrier>")
    assert r.returncode == 0, r.stderr
    return exe


def run_emu(exe, tmp, logits, rows, slots, counts, tokens_in, cap=8192, threads=(128, 256), slice_=None):
    n, V = logits.shape
    slice_ = slice_ or max(1024, -(-V // 4))
    G = -(-V // slice_)
    hdr = np.array([V, n, counts.shape[0], G, slice_, cap, *threads], np.int32)
    fin, fout = tmp / "in.bin", tmp / "out.bin"
    with open(fin, "wb") as f:
        for a in (hdr, logits.astype(np.float32), kernel_params(rows, V, slots, tokens_in), counts.astype(np.int32)):
            a.tofile(f)
    r = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr)    # 3: the scratch was not left zeroed
    raw = np.fromfile(fout, np.int32)
    return raw[: n * 4].reshape(n, 4), raw[n * 4:].reshape(counts.shape)


def check(exe, tmp, logits, rows, counts=None, slots=None, tokens_in=None, **kw):
    n, V = logits.shape
    slots = list(range(n)) if slots is None else slots
    counts = np.zeros((n, V), np.int32) if counts is None else counts
    after = counts.copy()
    for i, row in enumerate(rows):
        if row.penalties and tokens_in is not None:
            after[slots[i], tokens_in[i]] += 2
    out, cnt = run_emu(exe, tmp, logits, rows, slots, counts.copy(), tokens_in, **kw)
    assert np.array_equal(cnt, after), "device counts"
    for i, row in enumerate(rows):
        want = sample_logits(logits[i], row, after[slots[i]] if row.penalties else None)
        assert out[i, 0] == want, (i, row)
        assert out[i, 1] == int(np.argmax(logits[i])) or np.isnan(logits[i]).any()
        if row.logprobs:
            lp, _, top_lp = raw_logprobs(logits[i], int(out[i, 0]))
            got = out[i, 2:].view(np.float32)
            assert got[0] == pytest.approx(lp, abs=1e-3) and got[1] == pytest.approx(top_lp, abs=1e-3)


def _rows(rng, combos):
    return [SampleRow(seed=int(rng.integers(0, 2 ** 63)), step=int(rng.integers(0, 10 ** 6)), **c) for c in combos]


COMBOS = [dict(), dict(temperature=0.7, top_p=0.9), dict(top_k=40, temperature=1.2), dict(min_p=0.05),
          dict(top_k=50, top_p=0.95, min_p=0.02, temperature=0.8), dict(top_p=0.5, logprobs=True),
          dict(top_k=700, top_p=0.99, temperature=1.5), dict(top_k=300), dict(temperature=2.0, top_p=0.97),
          dict(temperature=0.0), dict(temperature=0.0, logprobs=True), dict(top_k=1), dict(min_p=1.0)]


@pytest.mark.parametrize("V,cap", [(1000, 8192), (1000, 256), (5003, 256), (32001, 512)])
def test_random_rows(emu, tmp_path, V, cap):
    rng = np.random.default_rng(V + cap)
    logits = (rng.standard_normal((len(COMBOS), V)) * rng.uniform(0.5, 4, (len(COMBOS), 1))).astype(np.float32)
    check(emu, tmp_path, logits, _rows(rng, COMBOS), cap=cap)


def test_ties_and_dense_bins(emu, tmp_path):
    rng = np.random.default_rng(1)
    combos = [dict(), dict(top_k=10), dict(top_k=1000), dict(top_p=0.3), dict(top_p=0.9, top_k=2000),
              dict(min_p=0.5), dict(temperature=0.0), dict(top_k=1), dict(logprobs=True, top_p=0.8)]
    V = 4000
    lg = np.round(rng.standard_normal((len(combos), V)) * 1.5).astype(np.float32)
    lg[0] = 0.0                        # one value: every token ties
    lg[1] = 1.0
    lg[1, ::7] = 2.0
    check(emu, tmp_path, lg, _rows(rng, combos), cap=256)


def test_dense_bin_of_distinct_values(emu, tmp_path):
    # thousands of distinct values within 1/128 nat: the radix select takes several passes
    rng = np.random.default_rng(2)
    lg = (1.0 + rng.uniform(0, 0.0075, (5, 6000))).astype(np.float32)
    lg[:, 17] = 1.5
    combos = [dict(top_k=3000), dict(top_p=0.6), dict(), dict(top_k=2999, top_p=0.77), dict(min_p=0.9)]
    check(emu, tmp_path, lg, _rows(rng, combos), cap=256)


def test_penalties_with_device_counts(emu, tmp_path):
    rng = np.random.default_rng(3)
    V = 2000
    combos = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.3, top_p=0.9),
              dict(repetition_penalty=0.8, temperature=0.0), dict(presence_penalty=-1.0, temperature=0.0),
              dict(repetition_penalty=1.1, frequency_penalty=0.2, top_k=20, logprobs=True), dict()]
    lg = (rng.standard_normal((len(combos), V)) * 3).astype(np.float32)
    counts = np.zeros((8, V), np.int32)
    slots = [5, 2, 7, 0, 3, 1]
    for s in slots:
        counts[s, rng.integers(0, V, 50)] = 1
        np.add.at(counts[s], rng.integers(0, V, 30), 2)
    tokens_in = [int(t) for t in rng.integers(0, V, len(combos))]
    check(emu, tmp_path, lg, _rows(rng, combos), counts=counts, slots=slots, tokens_in=tokens_in, cap=512)


def test_infinities_and_nan(emu, tmp_path):
    rng = np.random.default_rng(4)
    lg = (rng.standard_normal((4, 1000)) * 3).astype(np.float32)
    lg[0] = -np.inf
    lg[1, ::3] = -np.inf
    lg[1, 5] = np.nan
    lg[2, 7] = np.inf
    lg[3] = np.nan
    lg[3, 500] = 1.0
    check(emu, tmp_path, lg, [SampleRow(seed=1, step=i, top_p=0.9) for i in range(4)], cap=256)


def test_production_block_sizes(emu, tmp_path):
    rng = np.random.default_rng(5)
    lg = (rng.standard_normal((2, 49152)) * 2.5).astype(np.float32)
    rows = [SampleRow(seed=9, step=1, top_p=0.95), SampleRow(seed=3, step=0, top_k=50, min_p=0.05)]
    check(emu, tmp_path, lg, rows, threads=(512, 1024), slice_=8192)
