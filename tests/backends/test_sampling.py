"""The sampling algorithm's NumPy twin on controlled logits, through a request's parameters."""

import numpy as np
import pytest

from realizar_backend.backends.sampling import log_softmax, penalize, row_constants, sample_logits
from realizar_backend.engine.sampling import Sampler, SamplingParams, token_logprobs
from realizar_backend.errors import RequestError


def draws(params, logits, n=4000):
    """Token counts of a sequence's first n draws from the same logits."""
    s = Sampler(params, len(logits))
    return np.bincount([sample_logits(logits, s.row(step)) for step in range(n)], minlength=len(logits))


def test_temperature_one_follows_the_softmax():
    rng = np.random.default_rng()
    logits = rng.standard_normal(6).astype(np.float32)
    counts = draws(SamplingParams(temperature=1.0, seed=7), logits)
    p = np.exp(log_softmax(logits))
    assert np.abs(counts / counts.sum() - p).max() < 0.04


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_are_greedy(kw):
    rng = np.random.default_rng()
    logits = rng.standard_normal(50).astype(np.float32)
    kw.setdefault("temperature", 1.0)
    counts = draws(SamplingParams(seed=1, **kw), logits, n=200)
    assert counts[np.argmax(logits)] == 200


def test_top_k_and_top_p_keep_only_the_head():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    assert set(np.nonzero(draws(SamplingParams(top_k=2, seed=2), logits))[0]) == {0, 1}
    assert set(np.nonzero(draws(SamplingParams(top_p=0.7, seed=2), logits))[0]) == {0, 1}
    assert set(np.nonzero(draws(SamplingParams(min_p=0.4, seed=2), logits))[0]) == {0, 1}


def test_penalties_push_seen_tokens_down():
    logits = np.array([2.0, 1.9, -1.0, -1.1], dtype=np.float32)
    row = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5), 4).row(0)
    prompt = np.array([1, 0, 1, 0], np.int32)            # tokens 0 and 2 in the prompt
    out = penalize(logits, prompt, row_constants(row, 4))
    assert out[0] == pytest.approx(2.0 / 1.5) and out[2] == pytest.approx(-1.5)
    assert sample_logits(logits, row, prompt) == 1
    row = Sampler(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.2), 4).row(2)
    twice = np.array([4, 0, 0, 0], np.int32)             # token 0 generated twice
    assert penalize(logits, twice, row_constants(row, 4))[0] == pytest.approx(2.0 - 1.0 - 0.2)


def test_same_seed_same_draws():
    logits = np.random.default_rng().standard_normal(100).astype(np.float32)
    a = [sample_logits(logits, Sampler(SamplingParams(seed=99), 100).row(0)) for _ in range(5)]
    assert len(set(a)) == 1


def test_token_logprobs():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    lp, top = token_logprobs(logits, 2, 2)
    ref = log_softmax(logits)
    assert lp == pytest.approx(ref[2])
    assert [i for i, _ in top] == [1, 2]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 3.0), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("max_tokens", 0), ("max_tokens", 1.5),
    ("presence_penalty", 5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logprobs", 21),
    ("temperature", "hot"), ("seed", 1.5), ("stop_token_ids", [-1]),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=100)
    assert e.value.param == field and e.value.status == 400
