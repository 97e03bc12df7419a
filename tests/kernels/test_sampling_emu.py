"""kernels/sampling.cu run on the CPU (tests/host/sampling_emu.cpp: a thread per CUDA thread,
barriers for __syncthreads and warp exchanges) against the NumPy twin: the same token on every
row, on every path of the kernels (shared-memory gathers of one or many bins, the radix select
of a bin too dense to gather, ties by index order, penalties with counts kept between steps),
and the per-row scratch left zeroed. The GPU tests (tests/gpu/test_sampling_gpu.py) check the
same on the device. Skipped where g++ (with C++20's <barrier>) is absent."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from realizar_backend.backends.base import SampleRow
from realizar_backend.backends.sampling import (BIAS_ROW_WORDS, kernel_params, mask_words, pack_bias, pack_masks,
                                                raw_logprobs, sample_logits)
from support import host_emu
from support.host_emu import GXX

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return host_emu.build("sampling_emu.cpp", tmp_path_factory.mktemp("emu") / "sampling_emu",
                          flags=("-std=c++20", "-O2", "-ffp-contract=off", "-pthread"), lacks=("barrier", "<barrier>"))


def run_emu(exe, tmp, logits, rows, slots, counts, tokens_in, cap=8192, threads=(128, 256), slice_=None):
    n, V = logits.shape
    slice_ = slice_ or max(1024, -(-V // 4))
    G = -(-V // slice_)
    masks = np.zeros((n, mask_words(V)), np.int32)
    n_masks = pack_masks(rows, masks)
    bias = np.zeros(n * BIAS_ROW_WORDS, np.int32)
    n_bias = pack_bias(rows, bias)
    hdr = np.array([V, n, counts.shape[0], G, slice_, cap, *threads, n_masks, n_bias], np.int32)
    fin, fout = tmp / "in.bin", tmp / "out.bin"
    with open(fin, "wb") as f:
        for a in (hdr, logits.astype(np.float32), kernel_params(rows, V, slots, tokens_in), counts.astype(np.int32),
                  masks[:n_masks], bias[:n_bias]):
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



def as_words(allowed_bytes, V):
    words = np.zeros(-(-V // 32) * 4, np.uint8)
    words[:allowed_bytes.size] = allowed_bytes
    return words.view(np.int32)


def test_masks_and_biases(emu, tmp_path):
    """Constrained rows (grammar masks, logit biases, both, with penalties) among plain ones: the
    kernels pick the twin's token on every row, greedy and sampled."""
    from realizar_backend.backends.base import LogitBias
    rng = np.random.default_rng(6)
    V = 3001
    lg = (rng.standard_normal((10, V)) * 3).astype(np.float32)
    best = np.argmax(lg, axis=1)

    def mask(r, density, force=()):
        allowed = rng.random(V) < density
        allowed[best[r]] = False                         # the raw argmax is never allowed
        allowed[list(force)] = True
        return as_words(np.packbits(allowed, bitorder="little"), V)

    def bias(n, lo=-100, hi=100):
        ids = rng.choice(V, n, replace=False).astype(np.int32)
        return LogitBias(ids, rng.uniform(lo, hi, n).astype(np.float32))

    combos = [dict(temperature=0.0, mask=mask(0, 0.3)), dict(mask=mask(1, 0.01)),
              dict(top_p=0.9, mask=mask(2, 0.5)), dict(temperature=0.0, mask=mask(3, 0.0, force=[17])),
              dict(), dict(temperature=0.0),
              dict(temperature=0.0, logit_bias=bias(5, 20, 40)), dict(top_k=5, logit_bias=bias(40)),
              dict(temperature=0.8, mask=mask(8, 0.2), logit_bias=bias(300), repetition_penalty=1.3,
                   frequency_penalty=0.4, logprobs=True),
              dict(temperature=0.0, mask=mask(9, 0.05), presence_penalty=1.5)]
    counts = np.zeros((10, V), np.int32)
    counts[:, rng.integers(0, V, 200)] = 1
    tokens_in = [int(t) for t in rng.integers(0, V, 10)]
    rows = _rows(rng, combos)
    check(emu, tmp_path, lg, rows, counts=counts, tokens_in=tokens_in, cap=512)
    # the twin itself: no row drew a token its mask forbids
    from realizar_backend.backends.sampling import allowed_tokens
    for i, row in enumerate(rows):
        if row.mask is not None:
            tok = sample_logits(lg[i], row, counts[i] + (2 * (np.arange(V) == tokens_in[i]) if row.penalties else 0))
            assert allowed_tokens(row.mask, V)[tok], i
