"""Constrained rows in the sampling twin (backends/sampling.py): an allowed-token bitmask (from a
grammar) and a logit bias change a row's logits before everything else, on the host's first
token, in the CPU backend's batched steps, and in the parameter block and packed buffers the GPU
kernels read. Rows without constraints are untouched."""

from __future__ import annotations

import math

import numpy as np
import pytest

from realizar_backend.backends.base import LogitBias, SampleRow
from realizar_backend.backends.sampling import (BIAS_ROW_WORDS, F_BIAS, F_MASK, allowed_tokens, kernel_params,
                                                mask_words, pack_bias, pack_masks, sample_logits, sample_rows)
from realizar_backend.engine.sampling import Sampler, SamplingParams
from realizar_backend.errors import RequestError

KINDS = [dict(temperature=0.0), dict(), dict(temperature=0.7, top_p=0.9), dict(top_k=20, temperature=1.3),
         dict(min_p=0.05), dict(temperature=0.0, repetition_penalty=1.4), dict(frequency_penalty=1.0, top_p=0.8)]


def to_mask(allowed: np.ndarray) -> np.ndarray:
    words = np.zeros(mask_words(allowed.size) * 4, np.uint8)
    packed = np.packbits(allowed, bitorder="little")
    words[:packed.size] = packed
    return words.view(np.int32)


def llm_like(rng, V):
    x = rng.standard_normal(V) * 2
    x[rng.choice(V, 6, replace=False)] += rng.uniform(5, 12, 6)
    return x.astype(np.float32)


def counts_for(rng, V):
    c = np.zeros(V, np.int32)
    c[rng.integers(0, V, 40)] = 1
    np.add.at(c, rng.integers(0, V, 20), 2)
    return c


def test_mask_bits_follow_llguidance_layout():
    V = 70
    allowed = np.zeros(V, bool)
    allowed[[0, 31, 32, 69]] = True
    m = to_mask(allowed)
    assert m.shape == (3,) and m[0] == np.int32(-(1 << 31)) + 1 and m[1] == 1 and m[2] == 1 << 5
    assert np.array_equal(allowed_tokens(m, V), allowed)
    # a mask shorter than the vocabulary allows nothing past its end
    assert not allowed_tokens(m[:1], V)[32:].any()


@pytest.mark.parametrize("seed", range(4))
def test_masked_rows_never_draw_a_masked_token(seed):
    rng = np.random.default_rng(seed)
    V = 5003
    for kind in KINDS:
        for density in (0.0005, 0.02, 0.5):
            x = llm_like(rng, V)
            allowed = rng.random(V) < density
            allowed[np.argmax(x)] = False          # the favourite is forbidden
            allowed[rng.integers(0, V)] = True     # at least one token is allowed
            counts = counts_for(rng, V)
            for step in range(8):
                row = SampleRow(seed=seed, step=step, mask=to_mask(allowed), **kind)
                tok = sample_logits(x, row, counts if row.penalties else None)
                assert allowed[tok], (kind, density)
            if kind.get("temperature") == 0.0 and not SampleRow(**kind).penalties:
                # greedy: the argmax among the allowed tokens
                assert tok == int(np.flatnonzero(allowed)[np.argmax(x[allowed])])


def test_masked_draws_follow_the_renormalised_distribution():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(16) * 1.2).astype(np.float32)
    allowed = np.zeros(16, bool)
    allowed[[1, 4, 5, 11]] = True
    n = 8000
    got = np.bincount([sample_logits(x, SampleRow(seed=3, step=s, mask=to_mask(allowed))) for s in range(n)],
                      minlength=16)
    p = np.where(allowed, np.exp(x.astype(np.float64) - x.max()), 0.0)
    p /= p.sum()
    assert got[~allowed].sum() == 0
    chi2 = float(np.sum((got[allowed] - n * p[allowed]) ** 2 / (n * p[allowed])))
    assert chi2 < 21.1                       # chi-square, 3 degrees of freedom, p = 1e-4


def test_unconstrained_rows_are_unchanged_bit_for_bit():
    rng = np.random.default_rng(8)
    V = 4001
    x = np.stack([llm_like(rng, V) for _ in range(2 * len(KINDS))])
    plain = [SampleRow(seed=5, step=i, logprobs=True, **k) for i, k in enumerate(KINDS)]
    counts = [counts_for(rng, V) if r.penalties else None for r in plain]
    alone = sample_rows(x[:len(KINDS)], plain, counts)
    allowed = rng.random(V) < 0.1
    constrained = [SampleRow(seed=6, step=i, mask=to_mask(allowed),
                             logit_bias=LogitBias(np.array([3, 9], np.int32), np.array([50, -50], np.float32)), **k)
                   for i, k in enumerate(KINDS)]
    mixed = sample_rows(x, plain + constrained, counts + counts)
    for a, b in ((alone.tokens, mixed.tokens[:len(KINDS)]), (alone.logprobs, mixed.logprobs[:len(KINDS)]),
                 (alone.top_ids, mixed.top_ids[:len(KINDS)])):
        assert a.tobytes() == b.tobytes()
    # an all-allowed mask and an empty bias draw exactly what no constraint draws
    full = to_mask(np.ones(V, bool))
    for i, r in enumerate(plain):
        c = counts[i]
        free = SampleRow(**{**r.__dict__, "mask": full, "logit_bias": LogitBias(np.zeros(0, np.int32),
                                                                                np.zeros(0, np.float32))})
        assert sample_logits(x[i], free, c) == sample_logits(x[i], r, c)


def test_logprobs_stay_those_of_the_raw_logits():
    rng = np.random.default_rng(9)
    x = llm_like(rng, 300)
    allowed = np.zeros(300, bool)
    allowed[[7, 8]] = True
    res = sample_rows(x[None], [SampleRow(temperature=0.0, logprobs=True, mask=to_mask(allowed))])
    lp = x.astype(np.float64) - x.max()
    lp -= math.log(np.exp(lp).sum())
    tok = int(res.tokens[0])
    assert tok in (7, 8) and res.logprobs[0] == pytest.approx(lp[tok], abs=1e-5)
    assert res.top_ids[0] == np.argmax(x)


def test_logit_bias_adds_before_the_penalties():
    x = np.array([1.0, 2.0, 3.0, -1.0], np.float32)
    # +100 makes a token certain, -100 rules it out (OpenAI's semantics)
    assert sample_logits(x, SampleRow(temperature=0.0, logit_bias=LogitBias(np.array([0], np.int32),
                                                                            np.array([100.0], np.float32)))) == 0
    ban = LogitBias(np.array([2], np.int32), np.array([-100.0], np.float32))
    assert all(sample_logits(x, SampleRow(seed=1, step=s, logit_bias=ban)) != 2 for s in range(200))
    # x + b first, then the repetition penalty divides the (now positive) logit
    row = SampleRow(temperature=0.0, repetition_penalty=3.0,
                    logit_bias=LogitBias(np.array([3], np.int32), np.array([9.5], np.float32)))
    counts = np.array([0, 0, 1, 1], np.int32)          # tokens 2 and 3 were in the prompt
    # token 2: 3 / 3 = 1; token 3: (-1 + 9.5) / 3 = 2.83; token 1: 2 (not seen)
    assert sample_logits(x, row, counts) == 3


def test_kernel_params_name_the_packed_constraints():
    V = 100
    a = np.ones(V, bool)
    a[50:] = False
    rows = [SampleRow(), SampleRow(mask=to_mask(a)), SampleRow(temperature=0.0),
            SampleRow(logit_bias=LogitBias(np.array([5, 6, 7], np.int32), np.array([1.5, -2, 3], np.float32))),
            SampleRow(mask=to_mask(~a), logit_bias=LogitBias(np.array([1], np.int32), np.array([0.25], np.float32)))]
    P = kernel_params(rows, V, range(5), None)
    flags = P[:, 1]
    assert [bool(f & F_MASK) for f in flags] == [False, True, False, False, True]
    assert [bool(f & F_BIAS) for f in flags] == [False, False, False, True, True]
    masks = np.full((5, mask_words(V)), -7, np.int32)
    assert pack_masks(rows, masks) == 2
    assert np.array_equal(allowed_tokens(masks[P[1, 14]], V), a)
    assert np.array_equal(allowed_tokens(masks[P[4, 14]], V), ~a)
    flat = np.zeros(5 * BIAS_ROW_WORDS, np.int32)
    assert pack_bias(rows, flat) == (1 + 6) + (1 + 2)
    off = P[3, 15]
    assert flat[off] == 3 and flat[off + 1:off + 4].tolist() == [5, 6, 7]
    assert flat[off + 4:off + 7].view(np.float32).tolist() == [1.5, -2.0, 3.0]
    off = P[4, 15]
    assert flat[off] == 1 and flat[off + 1] == 1 and flat[off + 2:off + 3].view(np.float32)[0] == 0.25


def test_sampling_params_logit_bias():
    p = SamplingParams(logit_bias={"7": 5, 3: -100.0, "11": 0.5}).validate(50)
    s = Sampler(p, 50)
    b = s.row(0).logit_bias
    assert b.ids.tolist() == [3, 7, 11] and b.values.tolist() == [-100.0, 5.0, 0.5]
    assert not Sampler(SamplingParams().validate(50), 50).row(0).constrained
    x = np.zeros(50, np.float32)
    drawn = np.bincount([sample_logits(x, s.row(i)) for i in range(300)], minlength=50)
    assert drawn[3] == 0 and np.argmax(drawn) == 7      # e^5 against 49 others near e^0
    for bad in ({"x": 1}, {"50": 1}, {"-1": 1}, {"3": 101}, {"3": float("nan")}, {"3": "big"}, [1, 2],
                {str(i): 1 for i in range(2000)}):
        with pytest.raises(RequestError) as e:
            SamplingParams(logit_bias=bad).validate(50)
        assert e.value.param == "logit_bias"


def test_a_sequences_rows_take_the_mask():
    """A sequence's draws (the first, from its prompt's last row, as the rest) take its mask,
    sampled and greedy."""
    rng = np.random.default_rng(10)
    x = llm_like(rng, 1000)
    allowed = np.zeros(1000, bool)
    allowed[[10, 20, 30]] = True
    s = Sampler(SamplingParams(seed=4, temperature=0.9).validate(1000), 1000)
    toks = [sample_logits(x, s.row(i, mask=to_mask(allowed))) for i in range(30)]
    assert set(toks) <= {10, 20, 30} and len(set(toks)) > 1
    g = Sampler(SamplingParams(temperature=0.0).validate(1000), 1000)
    assert sample_logits(x, g.row(0, mask=to_mask(allowed))) == [10, 20, 30][int(np.argmax(x[[10, 20, 30]]))]
