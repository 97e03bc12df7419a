"""Constrained decoding in the engine, on the real SmolLM2 (NumPy backend): a request's grammar
holds every token (the first, drawn from the prefill's logits, and the decoded ones), a complete
grammar ends the sequence even with ignore_eos, constrained and plain rows share batches without
changing the plain rows' text, preempted constrained sequences resume where they were, a logit
bias moves the draw, and a token the grammar refuses fails only its own sequence."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import llguidance
import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.engine.guidance import Constraint, Guidance
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.errors import GrammarError, RequestError
from realizar_backend.settings import Settings

BASE = dict(backend="cpu", max_num_seqs=4, context_length=256)
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "size": {"enum": ["small", "large"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "size", "count"], "additionalProperties": False}
# a string of 40-60 characters: ~15-25 tokens whatever the model likes
LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 40, "maxLength": 60}},
        "required": ["story"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ref():
    eng = Engine.from_settings(Settings(**BASE))
    yield eng
    eng.shutdown()


async def _run(engine, prompt, **kw):
    params = SamplingParams(**kw)
    ids = engine.prepare(prompt, params)
    outs = [o async for o in engine.generate(ids, params)]
    return "".join(o.text for o in outs), outs[-1].finish_reason, [t for o in outs for t in o.token_ids]


def _together(engine, jobs):
    async def go():
        return await asyncio.gather(*[_run(engine, p, **kw) for p, kw in jobs], return_exceptions=True)
    return asyncio.run(go())


def test_schema_output_validates_and_the_grammar_ends_it(ref):
    c = Constraint("json_schema", ITEM)
    greedy = _together(ref, [("An item as JSON:", dict(max_tokens=60, temperature=0, constraint=c))])[0]
    sampled = _together(ref, [("An item as JSON:", dict(max_tokens=60, temperature=1.0, seed=s, constraint=c))
                              for s in range(3)])
    for text, reason, toks in [greedy, *sampled]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), ITEM)
        assert not set(toks) & ref.tokenizer.stop_ids      # the grammar ended it, not a stop token
    # ignore_eos does not keep a finished grammar going
    assert _together(ref, [("An item as JSON:", dict(max_tokens=60, temperature=0, constraint=c,
                                                     ignore_eos=True))])[0][:2] == greedy[:2]
    # a choice: the first token alone may complete it
    text, reason, _ = _together(ref, [("Yes or no?", dict(max_tokens=8, temperature=0,
                                                          constraint=Constraint("choice", ["yes", "no"])))])[0]
    assert (text in ("yes", "no"), reason) == (True, "stop")


def test_a_bad_grammar_is_a_400_before_anything_runs(ref):
    p = SamplingParams(constraint=Constraint("json_schema", {"type": "object", "properties": {"a": {"not": {}}}},
                                             param="guided_json"))
    with pytest.raises(RequestError) as e:
        ref.prepare("x", p)
    assert (e.value.status, e.value.param) == (400, "guided_json") and "not" in e.value.message


def test_plain_rows_beside_constrained_rows_keep_their_text(ref):
    plain = [("The capital of France is", dict(max_tokens=16, temperature=0, ignore_eos=True)),
             ("One, two, three,", dict(max_tokens=16, temperature=0, ignore_eos=True))]
    alone = [r[0] for r in _together(ref, plain)]
    c = Constraint("json_schema", LONG)
    mixed = _together(ref, [plain[0], ("A story as JSON:", dict(max_tokens=40, temperature=0, constraint=c)),
                            plain[1], ("Another story, JSON:", dict(max_tokens=40, temperature=0.7, seed=5,
                                                                    constraint=c))])
    assert [mixed[0][0], mixed[2][0]] == alone
    for text, reason, _ in (mixed[1], mixed[3]):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), LONG)


def test_our_slices_and_split_masks_leave_the_constrained_text_unchanged(ref):
    """The engine's guidance (SLICES), one with llguidance's default slices and one that splits
    every row's mask over vocabulary parts (mask_split) give the same text for the same requests,
    greedy and sampled, bounded strings included."""
    jobs = [("An item as JSON:", dict(max_tokens=60, temperature=0, constraint=Constraint("json_schema", ITEM))),
            ("A story as JSON:", dict(max_tokens=40, temperature=0, constraint=Constraint("json_schema", LONG))),
            ("A story, JSON:", dict(max_tokens=40, temperature=0.8, seed=3,
                                    constraint=Constraint("json_schema", LONG)))]
    ours = _together(ref, jobs)
    engine_guidance = ref.guidance
    others = [Guidance(engine_guidance.tokenizer, engine_guidance.vocab_size,
                       slices=llguidance.LLTokenizer.general_slices()),
              # 4 parts on 16 threads: the three rows split whatever this machine's cores
              Guidance(engine_guidance.tokenizer, engine_guidance.vocab_size, split_parts=4, threads=16)]
    others[1].build_split()
    try:
        for g in others:
            ref.guidance = g
            assert _together(ref, jobs) == ours
    finally:
        ref.guidance = engine_guidance
    assert others[1]._split is not None
    assert all(reason == "stop" for _, reason, _ in ours)


@pytest.mark.slow
def test_preempted_constrained_sequences_resume_their_grammar(ref):
    """Four constrained sequences of ~40 tokens in a pool of 96 tokens: they are preempted and
    recomputed, each keeps its guide (all of its output consumed), and each ends with the text
    it gets with room to spare."""
    tiny = Engine.from_settings(Settings(**BASE, kv_cache_tokens=96, prefill_chunk_tokens=16))
    try:
        c = Constraint("json_schema", LONG)
        jobs = [(f"Story {i} as JSON:", dict(max_tokens=36, temperature=0, constraint=c)) for i in range(3)]
        jobs.insert(2, ("A sampled story as JSON:", dict(max_tokens=36, temperature=0.8, seed=11, constraint=c)))
        want = _together(ref, jobs)
        before = tiny.stats()["preemptions"]
        got = _together(tiny, jobs)
        assert tiny.stats()["preemptions"] > before
    finally:
        tiny.shutdown()
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert any(reason == "stop" for _, reason, _ in got)
    for text, reason, _ in got:
        if reason == "stop":
            jsonschema.validate(json.loads(text), LONG)


def test_logit_bias_moves_the_first_and_the_decoded_draws(ref):
    prompt = "The capital of France is"
    _, _, free = _together(ref, [(prompt, dict(max_tokens=4, temperature=0, ignore_eos=True))])[0]
    forced = free[0] + 7
    _, _, toks = _together(ref, [(prompt, dict(max_tokens=4, temperature=0, ignore_eos=True,
                                               logit_bias={str(forced): 100}))])[0]
    assert toks == [forced] * 4
    _, _, toks = _together(ref, [(prompt, dict(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True,
                                               logit_bias={forced: 100}))])[0]
    assert toks == [forced] * 4
    _, _, toks = _together(ref, [(prompt, dict(max_tokens=4, temperature=0, ignore_eos=True,
                                               logit_bias={free[0]: -100}))])[0]
    assert free[0] not in toks


def test_a_token_the_grammar_refuses_fails_only_its_sequence(smol_model):
    """A backend that drops the masks (a bug) draws a refused token: that sequence fails with
    GrammarError naming the grammar; a plain sequence in the same batches finishes."""
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.model.tokenizer import Tokenizer

    class MaskBlind(CPUBackend):
        def sample(self, handle, rows, prepare=None):
            super().sample(handle, [r and dataclasses.replace(r, mask=None) for r in rows], prepare)

    eng = Engine(MaskBlind(smol_model, max_slots=2, max_context=128), Tokenizer.from_model_file(smol_model),
                 Settings(**BASE))
    try:
        res = _together(eng, [("Say hello:", dict(max_tokens=12, temperature=0,
                                                  constraint=Constraint("regex", "(xq)+", param="guided_regex"))),
                              ("The capital of France is", dict(max_tokens=12, temperature=0, ignore_eos=True))])
    finally:
        eng.shutdown()
    assert isinstance(res[0], GrammarError) and "guided_regex" in str(res[0])
    assert res[1][1] == "length" and len(res[1][2]) == 12


def test_a_grammar_that_reaches_a_limit_mid_generation_is_a_400_for_its_sequence_only(ref):
    """The check at the request walks a grammar's forced start; one whose endless branch is only
    taken later (here a logit bias picks it) reaches llguidance's item limit mid-generation: a
    400 grammar_too_complex for that sequence (the grammar's fault, not a server error), while a
    plain sequence in the same batches finishes."""
    from realizar_backend.errors import GrammarLimitError
    c = Constraint("lark", 'start: "a" | "b" x\nx: "(" x ")"', param="guided_grammar")
    b = ref.tokenizer.encode("b", add_special_tokens=False)[0]
    res = _together(ref, [("Pick one:", dict(max_tokens=12, temperature=0, constraint=c, logit_bias={str(b): 100})),
                          ("The capital of France is", dict(max_tokens=12, temperature=0, ignore_eos=True))])
    err = res[0]
    assert isinstance(err, GrammarLimitError), err
    assert (err.status, err.code, err.param) == (400, "grammar_too_complex", "guided_grammar"), err.message
    assert res[1][1] == "length" and len(res[1][2]) == 12
