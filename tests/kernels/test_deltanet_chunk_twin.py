"""The chunked form of the gated delta rule (backends/cuda/deltanet_twin.py chunk_step, deltanet.cu
dn_chunk's math in float64) against the rule token by token (the same twin with chunk_min None, itself
checked against the NumPy backend in test_deltanet_host.py): segments of 64, 65, 127 and 200 rows in
chunks of 64 (a whole chunk, then a tail of one, of 63, three chunks and a tail) and of the kernel's
DN_CHUNK, continuing a non-zero state, a sequence's first segment, decode rows and padding rows beside
them, under strong and weak decays, at head counts up to Qwen3.6-27B's (16 key heads, 48 value heads
of 128 x 128). (The emulated kernel's tests, test_deltanet_host.py, hold the chunked kernel to this
twin and check that slips of the form fail.)"""

from __future__ import annotations

import numpy as np
import pytest

from realizar_backend.backends.cuda import deltanet_twin as twin
from realizar_backend.backends.cuda.support import DN_CHUNK

SLOTS = 4
SCRATCH = SLOTS
TOL = 1e-9          # float64 against float64: the forms differ in rounding only


def _inputs(rng, n, nk, dk, nv, dv, decay):
    """decay: "strong" (per-row decays down to e^-8: a chunk's product underflows a float32) or "weak"
    (decays near 1: the state carries across the whole segment)."""
    C = 2 * nk * dk + nv * dv
    lo, hi = {"strong": (0.5, 2.0), "weak": (-5.0, -3.0)}[decay]
    return dict(cv=rng.standard_normal((n, C)) * 0.7, alpha=rng.standard_normal((n, nv)),
                beta=rng.standard_normal((n, nv)) * 2, z=rng.standard_normal((n, nv * dv)),
                a_coef=-np.exp(rng.uniform(lo, hi, nv)), dt_bias=rng.uniform(-1, 1, nv),
                out_norm=rng.uniform(0.5, 1.5, dv), state=rng.standard_normal((SLOTS, nv, dk, dv)) * 0.3)


def _rows(step):
    slots = np.concatenate([np.full(n, s) for s, _, n in step]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in step]).astype(np.int32)
    return slots, pos


def _run(a, step, nk, dk, nv, dv, chunk_min, chunk=DN_CHUNK):
    slots, pos = _rows(step)
    return twin.delta(a["cv"], a["alpha"], a["beta"], a["z"], a["a_coef"], a["dt_bias"], a["out_norm"], a["state"],
                      slots, pos, SCRATCH, nk, dk, nv, dv, 1e-6, chunk_min=chunk_min, chunk=chunk)


SHAPES = {"tiny": (2, 32, 4, 32), "odd": (1, 16, 3, 40), "qwen36-27b": (16, 128, 48, 128)}
# (shape, segment length, decay, chunk): every length at the small shapes in the kernel's chunks
# (deltanet.cu DN_CHUNK) and in the literature's 64; the real heads at a tail of one and at whole
# chunks with a tail
CASES = [(s, n, d, c) for s in ("tiny", "odd") for n in (64, 65, 127, 200) for d in ("strong", "weak")
         for c in sorted({DN_CHUNK, 64})] \
    + [("qwen36-27b", 65, "strong", DN_CHUNK), ("qwen36-27b", 200, "weak", DN_CHUNK)]


@pytest.mark.parametrize("shape,tokens,decay,chunk", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_chunked_is_the_serial_rule(shape, tokens, decay, chunk):
    nk, dk, nv, dv = SHAPES[shape]
    rng = np.random.default_rng(tokens + dk + nv)
    # a continued segment, decode rows of other slots, a first segment, padding on the scratch slot
    step = [(2, 9, tokens), (0, 5, 1), (3, 0, tokens), (SCRATCH, 0, 3)]
    a = _inputs(rng, sum(s[2] for s in step), nk, dk, nv, dv, decay)
    ref, ref_st = _run(a, step, nk, dk, nv, dv, None)
    got, got_st = _run(a, step, nk, dk, nv, dv, 64, chunk)
    assert np.max(np.abs(got - ref)) < TOL * max(1.0, np.abs(ref).max())
    assert np.max(np.abs(got_st - ref_st)) < TOL * max(1.0, np.abs(ref_st).max())
    # the continued segment's state matters: from zero it gives other outputs
    zero = dict(a, state=np.zeros_like(a["state"]))
    assert np.max(np.abs(_run(zero, step, nk, dk, nv, dv, 64, chunk)[0][:tokens] - ref[:tokens])) > 1e-3


def test_a_segment_below_the_rule_runs_token_by_token(monkeypatch):
    """chunk_min 128 in chunks of 64: the 127-row segment never reaches chunk_step, the 200-row one
    does (3 chunks); a chunk_min below the chunk is refused."""
    nk, dk, nv, dv = SHAPES["tiny"]
    calls = []
    real = twin.chunk_step
    monkeypatch.setattr(twin, "chunk_step", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(3)
    step = [(1, 4, 127), (2, 0, 200)]
    a = _inputs(rng, 327, nk, dk, nv, dv, "weak")
    ref = _run(a, step, nk, dk, nv, dv, None)[0]
    assert np.max(np.abs(_run(a, step, nk, dk, nv, dv, 128, 64)[0] - ref)) < TOL * max(1.0, np.abs(ref).max())
    assert len(calls) == 3
    with pytest.raises(ValueError):
        _run(a, step, nk, dk, nv, dv, 32, 64)
