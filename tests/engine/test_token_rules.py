"""The host's rules on the next token (engine/token_rules.py), in the engine on the CPU with a tiny
random qwen3 model whose template thinks (tests/support/thinking_model.py): min_tokens keeps the stop
tokens and stop strings from ending the output early, and a thinking budget forces the thought's
close tag once spent, with and without a grammar, on the greedy and the sampled path."""

from __future__ import annotations

import dataclasses

import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.engine.guidance import Constraint
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.engine.token_rules import Thinking
from realizar_backend.errors import RequestError
from realizar_backend.settings import Settings
from support.thinking_model import write_thinking_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_thinking_model(tmp_path_factory.mktemp("thinker") / "thinker.gguf")
    eng = Engine.from_settings(Settings(model=str(path), backend="cpu", max_num_seqs=4, context_length=1024))
    yield eng
    eng.shutdown()


def run(engine, params: SamplingParams, prompt="Hello", messages=None):
    ids = engine.prepare(None if messages else prompt, params, messages)
    outs = list(engine.generate_sync(ids, params))
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_holds_back_the_stop_tokens(engine, temperature):
    eos = engine.tokenizer.eos_id
    # "ab" pairs or the end (after a whole pair), the end biased to come first
    base = SamplingParams(max_tokens=40, temperature=temperature, seed=1, logit_bias={str(eos): 100},
                          constraint=Constraint("regex", "(ab){0,15}"))
    ids, text, last = run(engine, base, prompt="Count: 7")
    assert ids == [eos] and text == "" and last.finish_reason == "stop"
    # 7 tokens without the end; the 8th completes a pair, and the end comes next
    ids, text, last = run(engine, dataclasses.replace(base, min_tokens=7), prompt="Count: 7")
    assert text == "abababab" and ids[-1] == eos and eos not in ids[:-1] and last.finish_reason == "stop"
    assert last.completion_tokens == len(ids) == 9
    # a request's own stop token, without a grammar: the token this request draws first is one here
    first = run(engine, SamplingParams(max_tokens=1, temperature=temperature, seed=2))[0][0]
    plain = SamplingParams(max_tokens=20, temperature=temperature, seed=2, stop_token_ids=[first])
    assert run(engine, plain)[0] == [first]
    ids, _, last = run(engine, dataclasses.replace(plain, min_tokens=5))
    assert len(ids) > 5 and first not in ids[:5]


def test_min_tokens_holds_back_stop_strings(engine):
    base = SamplingParams(max_tokens=40, temperature=0, stop=["y"], constraint=Constraint("regex", "(xy){8}"))
    assert run(engine, base)[1] == "x"
    # the stop string does not end the output before 4 tokens; the next one does
    assert run(engine, dataclasses.replace(base, min_tokens=4))[1] == "xyxyx"


def test_min_tokens_is_checked(engine):
    with pytest.raises(RequestError) as e:
        engine.prepare("Hello", SamplingParams(max_tokens=4, min_tokens=5))
    assert e.value.param == "min_tokens"


def _thinking(engine, budget, inside=False):
    enc = lambda s: tuple(engine.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    return Thinking("<think>", "</think>", enc("<think>"), enc("</think>"), budget, inside)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_spent_thinking_budget_forces_the_close_tag(engine, temperature):
    close = engine.tokenizer.encode("</think>", add_special_tokens=False)[0]
    msgs = [{"role": "user", "content": "2+2?"}]
    # the template opened the thought (prepare finds it in the prompt): 5 tokens, then </think>
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True,
                            thinking=_thinking(engine, 5))
    ids, _, _ = run(engine, params, messages=msgs)
    assert params.thinking.inside and ids[5] == close and close not in ids[:5]
    unlimited = dataclasses.replace(params, thinking=_thinking(engine, None))
    assert close not in run(engine, unlimited, messages=msgs)[0][:8]     # the random model does not close it
    # a thought the reply opens itself, held by a grammar to think then answer: 3 tokens of it
    # (<think> is a token of its own, which a grammar names as such: a regex spelling it would not)
    grammar = Constraint("lark", "start: <think> /[a-z ]*/ </think> /[a-z]{4}/")
    params = SamplingParams(max_tokens=30, temperature=temperature, seed=5, constraint=grammar,
                            thinking=_thinking(engine, 3))
    ids, text, last = run(engine, params, prompt="Think:")
    assert not params.thinking.inside
    assert ids[4] == close and text.startswith("<think>") and last.finish_reason == "stop"
    assert len(text.split("</think>")[1]) == 4


def test_budget_zero_closes_at_once(engine):
    close = engine.tokenizer.encode("</think>", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, thinking=_thinking(engine, 0))
    ids, _, _ = run(engine, params, messages=[{"role": "user", "content": "hi"}])
    assert ids[0] == close
