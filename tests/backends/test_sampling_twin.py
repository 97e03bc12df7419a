"""The sampling algorithm's NumPy twin (backends/sampling.py), which the CPU backend runs and the GPU
kernels (kernels/sampling.cu) reproduce: its filters, penalties, seeding, and that its draws
follow the filtered softmax distribution."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from realizar_backend.backends import Step, run_step
from realizar_backend.backends.base import SampleRow
from realizar_backend.backends.sampling import (EXP_POLY, LN2_HI, LN2_LO, LOG2E, draw_detail, draw_u64, f32_keys,
                                                fx_weights, kernel_params, penalize, philox4x32_10, row_constants,
                                                sample_logits, sample_rows)
from realizar_backend.engine.sampling import Sampler, SamplingParams

KERNEL = Path(__file__).resolve().parents[2] / "realizar_backend" / "kernels" / "sampling.cu"


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty; ample for a 1e-4 threshold)."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def draws(logits, n=4000, **kw):
    return np.array([sample_logits(logits, SampleRow(seed=5, step=s, **kw)) for s in range(n)])


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The textbook definition in float64 (no fixed point): what the draws must follow."""
    z = logits.astype(np.float64) / temperature
    order = np.lexsort((np.arange(len(z)), -z))          # z descending, ties by index
    p = np.exp(z - z.max())
    keep = np.ones(len(z), bool)
    if 0 < top_k < len(z):
        keep &= z >= z[order[top_k - 1]]
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)[order]
        csum = np.cumsum(q / q.sum())
        cut = np.zeros(len(z), bool)
        cut[order[: int(np.searchsorted(csum, top_p)) + 1]] = True
        keep &= cut
    if min_p > 0:
        keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def test_philox_known_answers():
    # Random123's known-answer vectors for Philox4x32-10
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_random_bits_are_uniform_and_keyed():
    n = 20000
    u = np.sort(np.array([draw_u64(123, s) for s in range(n)], dtype=np.float64) / 2.0 ** 64)
    ks = max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))
    assert ks < 1.95 / math.sqrt(n)                            # Kolmogorov-Smirnov at about 0.1 %
    assert draw_u64(1, 7) != draw_u64(2, 7) and draw_u64(1, 7) != draw_u64(1, 8)
    assert draw_u64(-1, 0) == draw_u64((1 << 64) - 1, 0)


def test_fixed_point_weights_follow_exp():
    d = np.linspace(-31.0, 0.0, 200001).astype(np.float32)
    w = fx_weights(d)
    assert w[-1] == 1 << 40                                    # the max weighs exactly 2**40
    assert np.all(np.diff(w.astype(np.int64)) >= 0)            # monotone on this grid
    ref = np.exp(d.astype(np.float64)) * 2.0 ** 40
    big = ref > 1e6
    assert np.abs(w[big] / ref[big] - 1).max() < 2e-6
    assert np.all(w[d < -27.8] == 0) and fx_weights(np.float32([-np.inf, np.nan]))[0] == 0


def test_kernel_spells_the_same_constants():
    src = KERNEL.read_text()

    def bits(x):
        return f"0x{int(np.float32(x).view(np.uint32)):08X}u"
    for c in (LOG2E, LN2_HI, LN2_LO, *EXP_POLY):
        assert bits(c) in src, bits(c)
    for word, value in {"SAMPLE_PW": 16, "F_GREEDY": 1, "F_PEN": 2, "F_LP": 4, "F_TOPP": 8, "F_MINP": 16,
                        "F_MASK": 32, "F_BIAS": 64, "PW_MASK": 14, "PW_BIAS": 15}.items():
        assert re.search(rf"#define {word} {value}\b", src), word


def test_keys_preserve_order():
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.standard_normal(1000) * 50, [0.0, -np.inf, np.inf, 1e-40, -1e-40]]).astype(np.float32)
    k = f32_keys(z)
    assert np.array_equal(np.argsort(z, kind="stable"), np.argsort(k, kind="stable"))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_and_top_k_1_are_argmax(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(3001) * 3).astype(np.float32)
    best = int(np.argmax(logits))
    for step in range(20):
        assert sample_logits(logits, SampleRow(temperature=0.0, seed=seed, step=step)) == best
        assert sample_logits(logits, SampleRow(top_k=1, temperature=1.7, seed=seed, step=step)) == best
        assert sample_logits(logits, SampleRow(min_p=1.0, seed=seed, step=step)) == best
        assert sample_logits(logits, SampleRow(top_p=1e-9, seed=seed, step=step)) == best


def test_greedy_takes_the_first_of_equal_maxima_and_ignores_nan():
    x = np.array([1.0, np.nan, 3.0, 3.0, -np.inf], np.float32)
    assert sample_logits(x, SampleRow(temperature=0.0)) == 2
    assert sample_logits(np.full(4, -np.inf, np.float32), SampleRow(temperature=1.0)) == 0


def test_top_k_keeps_ties_at_the_kth_value():
    x = np.array([5.0, 4.0, 4.0, 4.0, 1.0, 0.0], np.float32)
    dr = draw_detail(x, SampleRow(top_k=2))
    assert sorted(dr.order[: dr.n_kept].tolist()) == [0, 1, 2, 3]
    assert set(draws(x, 3000, top_k=2)) == {0, 1, 2, 3}


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    p = np.array([0.05, 0.4, 0.3, 0.15, 0.1])
    x = np.log(p).astype(np.float32)
    for top_p, want in [(0.39, {1}), (0.41, {1, 2}), (0.69, {1, 2}), (0.71, {1, 2, 3}), (0.86, {1, 2, 3, 4}),
                        (0.999, {0, 1, 2, 3, 4})]:
        dr = draw_detail(x, SampleRow(top_p=top_p))
        assert set(dr.order[: dr.n_kept].tolist()) == want, top_p
    # equal probabilities at the cut: the lower index goes first
    x = np.log(np.array([0.1, 0.3, 0.3, 0.3], np.float64)).astype(np.float32)
    dr = draw_detail(x, SampleRow(top_p=0.5))
    assert dr.order[: dr.n_kept].tolist() == [1, 2]


def test_min_p_removes_exactly_the_unlikely():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(500) * 2).astype(np.float32)
    p = np.exp(x.astype(np.float64) - x.max())
    for min_p in (0.01, 0.1, 0.5):
        dr = draw_detail(x, SampleRow(min_p=min_p))
        kept = set(dr.order[: dr.n_kept].tolist())
        clear = np.abs(p / min_p - 1) > 1e-5             # away from float rounding at the boundary
        assert kept & set(np.flatnonzero(clear)) == set(np.flatnonzero(clear & (p >= min_p)))


def test_filters_combine_as_the_smallest_prefix():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(2000) * 2.5).astype(np.float32)
    row = SampleRow(top_k=50, top_p=0.8, min_p=0.02, temperature=0.9)
    ref = filtered_probs(x, 0.9, 50, 0.8, 0.02)
    dr = draw_detail(x, row)
    assert set(dr.order[: dr.n_kept].tolist()) == set(np.flatnonzero(ref))


def test_penalties_formula():
    x = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    counts = np.array([1, 1, 4, 0, 2], np.int32)        # bit 0: prompt; the rest: times generated
    rc = row_constants(SampleRow(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5), 5)
    y = penalize(x, counts, rc)
    want = [2.0 / 1.5, -1.5, 0.5 / 1.5 - (0.25 * 2 + 0.5), 3.0, -3.0 - (0.25 + 0.5)]
    assert y == pytest.approx(want, rel=1e-6)
    # a greedy row with penalties takes the argmax of the penalised logits
    row = Sampler(SamplingParams(temperature=0, repetition_penalty=10.0), 5).row(0)
    assert sample_logits(x, row, np.array([0, 0, 0, 1, 0], np.int32)) == 0


def test_sampler_says_which_requests_need_counts():
    assert Sampler(SamplingParams(presence_penalty=1.0, repetition_penalty=1.2), 6).needs_counts
    assert not Sampler(SamplingParams(), 6).needs_counts


def test_seeds_reproduce_and_steps_vary():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1000) * 1.5).astype(np.float32)
    a = [Sampler(SamplingParams(seed=77), 1000) for _ in range(2)]
    seq_a = [sample_logits(x, a[0].row(i)) for i in range(30)]
    assert seq_a == [sample_logits(x, a[1].row(i)) for i in range(30)]
    assert len(set(seq_a)) > 5
    b = Sampler(SamplingParams(seed=78), 1000)
    assert seq_a != [sample_logits(x, b.row(i)) for i in range(30)]
    assert Sampler(SamplingParams(seed=-1), 10).seed == (1 << 64) - 1
    # a draw depends on (seed, step) only, not on the rows beside it
    rows = [SampleRow(seed=9, step=3, top_p=0.9), SampleRow(seed=10, step=3)]
    both = sample_rows(np.stack([x, x[::-1]]), rows)
    assert both.tokens[0] == sample_rows(x[None], rows[:1]).tokens[0]


CASES = [dict(), dict(temperature=0.6), dict(temperature=1.5, top_k=5), dict(top_p=0.75), dict(min_p=0.1),
         dict(top_k=8, top_p=0.9, min_p=0.05, temperature=0.8)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_draws_follow_the_filtered_softmax(kw):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(12) * 1.2).astype(np.float32)
    want = filtered_probs(x, **{"temperature": 1.0, **kw})
    n = 20000
    got = np.bincount(draws(x, n, **kw), minlength=len(x))
    assert np.all(got[want == 0] == 0)
    live = want > 0
    chi2 = float(np.sum((got[live] - n * want[live]) ** 2 / (n * want[live])))
    dof = int(live.sum()) - 1
    if dof:
        assert chi2_sf(chi2, dof) > 1e-4, (chi2, dof, got, n * want)


def test_logprobs_and_kept_logits():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((2, 50)) * 2).astype(np.float32)
    res = sample_rows(x, [SampleRow(logprobs=True, seed=1), SampleRow(want_logits=True, temperature=0)])
    lp = x[0].astype(np.float64) - x[0].max()
    lp -= math.log(np.exp(lp).sum())
    assert res.logprobs[0] == pytest.approx(lp[res.tokens[0]], abs=1e-5)
    assert res.top_ids[0] == np.argmax(x[0]) and res.top_logprobs[0] == pytest.approx(lp.max(), abs=1e-5)
    assert np.isnan(res.logprobs[1]) and list(res.logits) == [1] and np.array_equal(res.logits[1], x[1])


def test_kernel_params_layout():
    rows = [SampleRow(temperature=0.5, top_k=7, top_p=0.25, min_p=0.5, repetition_penalty=1.1,
                      seed=(3 << 32) | 5, step=(1 << 32) | 2, logprobs=True),
            SampleRow(temperature=0.0)]
    P = kernel_params(rows, 100, [4, 1], [42, 43])
    u = P.view(np.uint32)
    assert P[0, 0] == 4 and u[0, 1] == 2 | 4 | 8 | 16 and P[0, 2] == 7 and u[0, 3] == 1 << 30
    assert u[0, 4:9].view(np.float32).tolist() == pytest.approx([2.0, 1.1, 0.0, 0.0, math.log(0.5)])
    assert u[0, 9:13].tolist() == [5, 3, 2, 1] and P[0, 13] == 42
    assert u[1, 1] == 1 and P[1, 13] == -1 and P[1, 2] == 0


def test_cpu_backend_counts_the_fed_token(smol_model):
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cpu import CPUBackend
    from support.paging import contiguous_tables
    be = contiguous_tables(CPUBackend(smol_model, max_slots=2, max_context=32))
    prompt = np.array([1, 9690, 314, 253], np.int32)
    logits = be.prefill([PrefillItem(1, prompt)])[0]
    be.reset_counts(1, prompt)
    row = SampleRow(repetition_penalty=1.3, frequency_penalty=0.4, seed=3, step=1)
    first = int(np.argmax(logits))
    res = run_step(be, Step(slots=[1], tokens=[first], positions=[4]), [row])
    want = np.zeros(be.config.vocab_size, np.int32)
    want[prompt] = 1
    want[first] += 2
    assert np.array_equal(be.counts[1], want)
    ref = be.decode([1], [first], [4])[0]
    assert res.tokens[0] == sample_logits(ref, row, want)


def test_cpu_prefill_samples_each_finished_prompt(smol_model):
    """A prompt step draws each finished prompt's first token from its last row as the twin draws
    it from prefill's logits (greedy with a bias, sampled with penalties on the slot's prompt
    counts and filters, masked): only tokens, logprobs and the asked-for logits come back; a
    chunk in the middle of a prompt draws nothing, and its prompt's last chunk draws the token
    the whole prompt gives."""
    from realizar_backend.backends.base import LogitBias, PrefillItem
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.backends.sampling import mask_words, raw_logprobs
    from support.paging import contiguous_tables
    be = contiguous_tables(CPUBackend(smol_model, max_slots=4, max_context=32))
    V = be.config.vocab_size
    prompts = [np.array(p, np.int32) for p in ([1, 9690, 314, 253], [1, 504, 3458, 314, 1523, 30],
                                               [1, 2, 3, 4, 5], [1, 9690, 314, 253, 4000, 17])]
    items = [PrefillItem(s, p) for s, p in enumerate(prompts)]
    logits = be.prefill(items)[:, :V]
    allowed = np.argsort(-logits[3])[5:40]                    # the head of the row, its top five banned
    mask = np.zeros(mask_words(V), np.int32)
    np.bitwise_or.at(mask, allowed >> 5, (np.uint32(1) << (allowed & 31).astype(np.uint32)).view(np.int32))
    bias = LogitBias(np.array([int(np.argsort(-logits[0])[3])], np.int32), np.array([30.0], np.float32))
    rows = [SampleRow(temperature=0.0, logit_bias=bias),
            SampleRow(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                      seed=5, logprobs=True),
            None,
            SampleRow(temperature=1.2, min_p=0.01, seed=7, mask=mask, want_logits=True)]
    be.reset_counts(1, prompts[1])
    res = run_step(be, Step(prompts=items), rows)
    prompt_counts = np.zeros(V, np.int32)
    prompt_counts[prompts[1]] = 1
    assert int(res.tokens[0]) == bias.ids[0]
    assert [int(t) for t in res.tokens] == [sample_logits(logits[0], rows[0]),
                                            sample_logits(logits[1], rows[1], prompt_counts), -1,
                                            sample_logits(logits[3], rows[3])]
    assert int(res.tokens[3]) in allowed
    lp, top, top_lp = raw_logprobs(logits[1], int(res.tokens[1]))
    assert res.logprobs[1] == pytest.approx(lp) and res.top_ids[1] == top
    assert res.top_logprobs[1] == pytest.approx(top_lp)
    assert np.isnan(res.logprobs[[0, 2, 3]]).all()
    assert set(res.logits) == {3} and np.array_equal(res.logits[3], logits[3])
    # the same prompt in two chunks: the first draws nothing, the last draws from its last row
    p = prompts[1]
    assert run_step(be, Step(prompts=[PrefillItem(2, p[:4])]), [None]).tokens.tolist() == [-1]
    be.reset_counts(2, p)
    last = run_step(be, Step(prompts=[PrefillItem(2, p[4:], 4)]), [rows[1]])
    tail = be.prefill([PrefillItem(2, p[4:], 4)])[0, :V]
    assert np.allclose(tail, logits[1], atol=1e-3)
    assert int(last.tokens[0]) == sample_logits(tail, rows[1], prompt_counts)


def _params_from_row_constants(rows, vocab, slots, tokens_in):
    """kernel_params' layout spelled through row_constants, one numpy store a word."""
    out = np.zeros((len(rows), 16), np.int32)
    u = out.view(np.uint32)
    n_mask = bias_off = 0
    for i, row in enumerate(rows):
        rc = row_constants(row, vocab)
        flags = ((1 if rc.greedy else 0) | (2 if rc.penalties else 0) | (4 if row.logprobs else 0)
                 | (8 if rc.top_p_fx < (1 << 32) else 0) | (16 if rc.min_p_log is not None else 0))
        if row.mask is not None:
            flags |= 32
            out[i, 14] = n_mask
            n_mask += 1
        if row.logit_bias is not None and len(row.logit_bias):
            flags |= 64
            out[i, 15] = bias_off
            bias_off += 1 + 2 * len(row.logit_bias)
        u[i, 0], u[i, 1], u[i, 2], u[i, 3] = int(slots[i]), flags, rc.top_k, rc.top_p_fx & 0xFFFFFFFF
        for w, v in ((4, rc.inv_temp), (5, rc.rep), (6, rc.freq), (7, rc.pres),
                     (8, rc.min_p_log if rc.min_p_log is not None else np.float32(0.0))):
            u[i, w] = np.float32(v).view(np.uint32)
        u[i, 9], u[i, 10] = rc.seed & 0xFFFFFFFF, rc.seed >> 32
        u[i, 11], u[i, 12] = rc.step & 0xFFFFFFFF, rc.step >> 32
        out[i, 13] = int(tokens_in[i]) if rc.penalties and tokens_in is not None else -1
    return out


def test_kernel_params_match_row_constants():
    """kernel_params (plain ints, built on every launch) gives row_constants' words for every
    kind of row: greedy, sampled with each filter, penalties, extreme temperatures, masks, biases."""
    from realizar_backend.backends.base import LogitBias
    rng = np.random.default_rng(5)
    mask = np.zeros(4, np.int32)
    rows = []
    for i in range(400):
        temp = float(rng.choice([0.0, 1.0, 0.7, 1e-3, 1e-45, 3.3, float(rng.uniform(0.01, 2))]))
        rows.append(SampleRow(
            temperature=temp, top_k=int(rng.choice([0, -1, 1, 5, 100, 1000])),
            top_p=float(rng.choice([1.0, 0.9, float(rng.uniform(0, 1)), 1.5])),
            min_p=float(rng.choice([0.0, 0.05, float(rng.uniform(0, 1))])),
            repetition_penalty=float(rng.choice([1.0, 1.1, float(rng.uniform(0.5, 2))])),
            presence_penalty=float(rng.choice([0.0, -0.5, float(rng.uniform(-2, 2))])),
            frequency_penalty=float(rng.choice([0.0, 0.3, float(rng.uniform(-2, 2))])),
            seed=int(rng.integers(0, 2**63)) * int(rng.choice([1, 2])), step=int(rng.integers(0, 2**40)),
            logprobs=bool(rng.integers(2)), mask=mask if rng.integers(3) == 0 else None,
            logit_bias=LogitBias(np.array([3, 9], np.int32), np.array([1.5, -2.0], np.float32))
            if rng.integers(4) == 0 else None))
    slots = rng.integers(0, 64, size=len(rows)).tolist()
    tokens_in = rng.integers(0, 1000, size=len(rows)).tolist()
    for vocab in (1000, 151936):
        assert np.array_equal(kernel_params(rows, vocab, slots, tokens_in),
                              _params_from_row_constants(rows, vocab, slots, tokens_in))
        assert np.array_equal(kernel_params(rows, vocab, slots, None),
                              _params_from_row_constants(rows, vocab, slots, None))
    assert kernel_params([], 10, [], None).shape == (0, 16)
