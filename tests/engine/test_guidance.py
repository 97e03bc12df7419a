"""Constrained decoding (engine/guidance.py) on the real vocabularies: llguidance's view of every
token is our tokenizer's (byte-level BPE: SmolLM2, Qwen2.5; SentencePiece: Gemma 3), masks walk
a valid output and block an invalid one, bad grammars are 400s that name the problem, and greedy
and sampled generation of Qwen2.5-Coder-0.5B on the CPU backend gives JSON that validates
against a nested schema with enums and arrays (through the engine, as a request runs)."""

from __future__ import annotations

import functools
import json

import jsonschema
import llguidance
import numpy as np
import pytest

from realizar_backend.backends.sampling import allowed_tokens
from realizar_backend.engine.guidance import Constraint, Guidance
from realizar_backend.errors import RequestError
from realizar_backend.model.tokenizer import bytes_to_unicode
from support.tokenizer_corpus import HAND, model_file, ours

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 20}, "verified": {"type": "boolean"}},
                  "required": ["city", "verified"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["small", "loud", "fluffy", "old"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}
PET_JSON = {"name": "Rex", "kind": "dog", "age": 4, "owner": {"city": "Oslo", "verified": True},
            "tags": ["loud", "old"]}


@functools.lru_cache(maxsize=None)
def guidance_for(name: str) -> Guidance:
    return Guidance(ours(name), model_file(name).config.vocab_size)


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def expected_bytes(tok, i: int) -> bytes | None:
    """A token's bytes as our tokenizer spells it (None: a special token)."""
    if tok.is_special(i):
        return None
    piece = tok.id_to_piece(i)
    if tok._spm_pieces:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()
    return bytes(_BYTE_OF[c] for c in piece) if all(c in _BYTE_OF for c in piece) else piece.encode()


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270"])
def test_llguidance_reads_our_vocabulary(name):
    tok, g = ours(name), guidance_for(name)
    ll = g.ll_tokenizer
    assert ll.vocab_size == g.vocab_size and set(ll.eos_tokens) == set(tok.stop_ids)
    wrong = [i for i in range(tok.vocab_size)
             if (b := expected_bytes(tok, i)) is not None and ll.decode_bytes([i]) != b and b != b"\xff"]
    assert wrong == []          # (the lone 0xFF byte is llguidance's own marker and never valid UTF-8)
    for text in HAND:
        assert ll.tokenize_str(text) == tok.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270"])
def test_a_schema_mask_walks_valid_json_and_blocks_the_rest(name):
    tok, g = ours(name), guidance_for(name)
    guide = g.guide(Constraint("json_schema", PET))
    text = json.dumps(PET_JSON)
    for t in tok.encode(text, add_special_tokens=False):
        allowed = allowed_tokens(guide.compute_mask(), g.vocab_size)
        assert allowed[t] and not allowed[list(tok.stop_ids)].any()
        assert guide.consume(t)
    assert guide.accepting and guide.finished
    assert set(np.flatnonzero(allowed_tokens(guide.compute_mask(), g.vocab_size))) == set(tok.stop_ids)
    # an enum value outside the list, and a missing required key, are never allowed
    for bad in ('{"name": "Rex", "kind": "fish"', '{"name": "Rex", "age"'):
        guide = g.guide(Constraint("json_schema", PET))
        ids = tok.encode(bad, add_special_tokens=False)
        ok = all(allowed_tokens(guide.compute_mask(), g.vocab_size)[t] and guide.consume(t) for t in ids)
        assert not ok, bad


def walk(g, c, text):
    guide = g.guide(c)
    for t in g.tokenizer.encode(text, add_special_tokens=False):
        if not allowed_tokens(guide.compute_mask(), g.vocab_size)[t]:
            return False, guide
        guide.consume(t)
    return True, guide


def test_other_grammars():
    g = guidance_for("qwen05")
    assert walk(g, Constraint("json_object"), '{"any": [1, {"thing": null}]}')[1].finished
    assert not walk(g, Constraint("json_object"), '[1, 2]')[0]
    assert not walk(g, Constraint("json_object"), '{"a":1}')[0]          # compact style: ", " and ": "
    rx = Constraint("regex", r"[0-9]{3}-[a-z]+", param="guided_regex")
    ok, guide = walk(g, rx, "123-abc")
    assert ok and guide.accepting and not walk(g, rx, "12a")[0]
    ch = Constraint("choice", ["positive", "negative"], param="guided_choice")
    assert walk(g, ch, "negative")[1].finished and not walk(g, ch, "neutral")[0]
    lark = Constraint("lark", 'start: "yes" | "no" " because " /[a-z ]+/', param="guided_grammar")
    assert walk(g, lark, "no because it rains")[0] and not walk(g, lark, "maybe")[0]
    gbnf = Constraint("lark", 'root ::= "A" [0-9]+', param="guided_grammar")
    assert walk(g, gbnf, "A42")[0] and not walk(g, gbnf, "B")[0]


@pytest.mark.parametrize("c,words", [
    (Constraint("json_schema", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), ["not"]),
    (Constraint("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), ["missing"]),
    (Constraint("json_schema", {"type": "strng"}), ["strng"]),
    (Constraint("json_schema", {"type": "string", "pattern": "(?<=a)b"}), ["look-around"]),
    (Constraint("json_schema", [1, 2]), ["schema must be an object"]),
    (Constraint("regex", "a(b", param="guided_regex"), ["unclosed group"]),
    (Constraint("lark", "start: undefined_rule", param="guided_grammar"), ["undefined_rule"]),
    (Constraint("choice", [], param="guided_choice"), ["non-empty"]),
])
def test_bad_grammars_are_400s_that_say_why(c, words):
    g = guidance_for("qwen05")
    with pytest.raises(RequestError) as e:
        g.guide(c)
    assert e.value.status == 400 and e.value.param == c.param and e.value.message.startswith(c.param + ":")
    assert all(w in e.value.message for w in words), e.value.message


def test_compiled_grammars_are_cached_and_masks_fill_in_parallel():
    g = guidance_for("qwen05")
    c = Constraint("json_schema", PET)
    assert g.compile(c) is g.compile(Constraint("json_schema", json.loads(json.dumps(PET))))
    guides = [g.guide(c) for _ in range(5)]
    prefixes = ['{"name": "', '{"name": "Rex", "kind": "', '{', '', '{"name": "Rex", "kind": "cat", "age": 1']
    for guide, p in zip(guides, prefixes):
        assert all(guide.consume(t) for t in g.tokenizer.encode(p, add_special_tokens=False))
    out = np.full((6, g.words), -7, np.int32)
    g.fill_masks(guides, out)
    for i, guide in enumerate(guides):
        assert np.array_equal(out[i], guide.compute_mask())
    assert (out[5] == -7).all()
    with pytest.raises(ValueError):
        g.fill_masks(guides, np.zeros((2, g.words), np.int32))


@pytest.mark.parametrize("c", [
    Constraint("json_schema", PET),
    Constraint("json_schema", {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 3, "maxLength": 40}, "t": {"type": "string", "maxLength": 7},
        "u": {"type": "string"}, "p": {"type": "string", "pattern": "[a-z]{2,9}"}},
        "required": ["s", "t", "u", "p"], "additionalProperties": False}),
    Constraint("json_object"),
    Constraint("lark", 'start: "say " /[a-z ]{1,14}/ "!"', param="guided_grammar"),
], ids=["pet", "strings", "json_object", "lark"])
def test_our_slices_give_llguidance_s_own_masks(c):
    """SLICES only changes how llguidance computes a mask, never the mask: a random walk of
    allowed tokens (mostly long strings, where the slices apply) sees the same mask at every step
    as with llguidance's default slices."""
    ours_g = guidance_for("qwen05")
    theirs = Guidance(ours_g.tokenizer, ours_g.vocab_size, slices=llguidance.LLTokenizer.general_slices())
    assert ours_g.slices != theirs.slices
    rng = np.random.default_rng(7)
    a, b, steps, done = ours_g.guide(c), theirs.guide(c), 0, []
    while steps < 160:
        ma, mb = a.compute_mask(), b.compute_mask()
        assert np.array_equal(ma, mb), ours_g.tokenizer.decode(done)
        allowed = np.flatnonzero(allowed_tokens(ma, ours_g.vocab_size))
        tok = int(rng.choice([t for t in allowed if t not in ours_g.tokenizer.stop_ids] or allowed))
        assert a.consume(tok) and b.consume(tok)
        steps += 1
        done.append(tok)
        if a.finished:
            assert b.finished
            ours_g.release(a)
            theirs.release(b)
            a, b, done = ours_g.guide(c), theirs.guide(c), []


SPLIT_GRAMMARS = [
    Constraint("json_schema", PET),
    Constraint("json_schema", {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 3, "maxLength": 9}, "u": {"type": "string"},
        "n": {"type": "number"}, "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["s", "u", "n", "a"], "additionalProperties": False}),
    Constraint("json_object"),
    Constraint("regex", r"(yes|no): [a-z ]{1,12}\.", param="guided_regex"),
]


@functools.lru_cache(maxsize=None)
def split_guidance_for(name: str) -> Guidance:
    g = guidance_for(name)
    # 3 parts, 8 threads: two rows of 3 parts fit, whatever this machine's cores
    split = Guidance(g.tokenizer, g.vocab_size, split_parts=3, threads=8)
    split.build_split()
    return split


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270"])
def test_masks_split_over_vocabulary_parts_are_the_main_matcher_s(name):
    """Two rows' masks, each computed by 3 matchers over parts of the vocabulary (mask_split)
    and ORed, are bit for bit the one matcher's, at every step of random walks of allowed tokens
    through four grammars (the forced-bytes states, where the main matcher answers, included)."""
    plain, split = guidance_for(name), split_guidance_for(name)
    rng = np.random.default_rng(11)
    stops = plain.tokenizer.stop_ids
    for c in SPLIT_GRAMMARS:
        refs, rows = [plain.guide(c), plain.guide(c)], [split.guide(c), split.guide(c)]
        out = np.zeros((2, split.words), np.int32)
        parts_used = 0
        for step in range(70):
            split.fill_masks(rows, out)
            parts_used += sum(row._parts is not None for row in rows)
            assert not any(row._no_split for row in rows)
            toks = []
            for r, (ref, row) in enumerate(zip(refs, rows)):
                want = ref.compute_mask()
                assert np.array_equal(out[r], want), (c.kind, step, plain.tokenizer.decode(ref.tokens))
                allowed = np.flatnonzero(allowed_tokens(want, plain.vocab_size))
                toks.append(int(rng.choice([t for t in allowed if t not in stops] or allowed)))
            assert all(ref.consume(t) for ref, t in zip(refs, toks))
            assert split.consume_all(rows, toks) == [True, True]
            for r in range(2):
                if refs[r].finished:
                    assert rows[r].finished
                    plain.release(refs[r])
                    split.release(rows[r])            # its part matchers go back to the pool
                    refs[r], rows[r] = plain.guide(c), split.guide(c)
        assert parts_used > 50, c.kind        # most steps: the parts' OR, not the main matcher


# ------------------------------------------------------------------ generation with the real model

PROMPTS = ["Invent a pet and describe it as JSON.",
           "Describe an old dog that lives in Rome, as JSON.",
           "A small bird named Kiwi, 2 years old, owner in Lima (verified). JSON please."]


@pytest.fixture(scope="module")
def qwen_engine():
    from support.real_models import real_model

    from realizar_backend.engine.engine import Engine
    from realizar_backend.settings import Settings
    eng = Engine.from_settings(Settings(model=str(real_model("qwen05")), backend="cpu", max_num_seqs=4,
                                        context_length=512))
    yield eng
    eng.shutdown()


def generate(engine, prompt, constraint, **sampling):
    """(text, finish_reason) of one chat reply through the engine."""
    from realizar_backend.engine.sampling import SamplingParams
    params = SamplingParams(constraint=constraint, **sampling)
    ids = engine.prepare(None, params, [{"role": "user", "content": prompt}])
    outs = list(engine.generate_sync(ids, params))
    return "".join(o.text for o in outs), outs[-1].finish_reason


@pytest.mark.slow
def test_greedy_and_sampled_constrained_generation_validates_and_free_text_would_not(qwen_engine):
    from concurrent.futures import ThreadPoolExecutor
    c = Constraint("json_schema", PET)
    # (greedy output on 20 prompts: tests/serving/test_structured_server.py)
    jobs = [(PROMPTS[2], dict(temperature=0))] + \
           [(PROMPTS[0], dict(temperature=0.9, top_p=0.95, seed=seed)) for seed in (1, 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:      # one batch: constrained rows decode together
        results = list(pool.map(lambda job: generate(qwen_engine, job[0], c, max_tokens=80, **job[1]), jobs))
    for text, reason in results:
        print(text)
        assert reason == "stop"
        jsonschema.validate(json.loads(text), PET)
    # the same prompt without the constraint: the model wraps its JSON in a markdown fence
    free, _ = generate(qwen_engine, PROMPTS[0], None, max_tokens=8, temperature=0)
    assert not free.startswith("{")


def test_pydantic_schemas_compile():
    """The schema a pydantic model gives (what openai's `parse` helper sends: $defs and $ref,
    enums, nested objects, arrays, field limits) compiles, and its instances' JSON walks through."""
    from enum import Enum

    from pydantic import BaseModel, Field

    class Kind(str, Enum):
        cat = "cat"
        dog = "dog"

    class Owner(BaseModel):
        city: str = Field(max_length=24)
        verified: bool

    class Pet(BaseModel):
        name: str = Field(max_length=20)
        kind: Kind
        age: int = Field(ge=0, le=30)
        owner: Owner
        tags: list[str] = Field(max_length=3)
        weight: float | None = None

    schema = Pet.model_json_schema()
    assert "$defs" in schema
    g = guidance_for("qwen05")
    pet = Pet(name="Rex", kind=Kind.dog, age=4, owner=Owner(city="Oslo", verified=True), tags=["a", "b"], weight=3.5)
    ok, guide = walk(g, Constraint("json_schema", schema), json.dumps(pet.model_dump(mode="json")))
    assert ok and guide.accepting
    assert not walk(g, Constraint("json_schema", schema), '{"name": "Rex", "kind": "cow"')[0]
    assert not walk(g, Constraint("json_schema", schema), '{"name": "Rex", "kind": "dog", "age": 31')[0]


def test_a_finished_sequences_matcher_starts_the_next_one_afresh():
    g = guidance_for("qwen05")
    c = Constraint("json_schema", PET)
    first = g.guide(c)
    start = first.compute_mask().copy()
    assert all(first.consume(t) for t in g.tokenizer.encode('{"name": "Rex", "kind": "', add_special_tokens=False))
    g.release(first)
    again, other = g.guide(c), g.guide(c)
    assert np.array_equal(again.compute_mask(), start) and np.array_equal(other.compute_mask(), start)
    assert again._m is not other._m            # rows of one batch never share a matcher (nor its lock)
