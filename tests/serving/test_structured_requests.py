"""Request fields that ask for structured output (serving/structured.py: OpenAI's response_format,
vLLM's guided_* and structured_outputs) and the token-level API (serving/tokens.py: vLLM's
/tokenize and /detokenize, completions' echo), on the real SmolLM2 engine (CPU)."""

from __future__ import annotations

import pytest

from realizar_backend.engine.guidance import Constraint, Guidance
from realizar_backend.errors import RequestError
from realizar_backend.serving.structured import guided, request_constraint, response_format
from realizar_backend.serving.tokens import detokenize, echo_text, tokenize

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_response_format_shapes():
    assert response_format(None) is None and response_format({"type": "text"}) is None
    c = response_format({"type": "json_object"})
    assert (c.kind, c.param) == ("json_object", "response_format")
    c = response_format({"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    assert (c.kind, c.spec, c.param) == ("json_schema", SCHEMA, "response_format")
    assert response_format({"type": "json_schema", "json_schema": {"name": "any"}}).spec == {}


@pytest.mark.parametrize("value,param", [
    ("json", "response_format"),
    ({"type": "yaml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
])
def test_bad_response_formats(value, param):
    with pytest.raises(RequestError) as e:
        response_format(value)
    assert e.value.status == 400 and e.value.param == param


def test_guided_fields():
    assert guided({}) is None
    assert guided({"guided_json": SCHEMA}) == Constraint("json_schema", SCHEMA, param="guided_json")
    assert guided({"guided_json": '{"type": "object"}'}).spec == {"type": "object"}
    assert guided({"guided_regex": "[a-z]+"}).kind == "regex"
    assert guided({"guided_choice": ["a", "b"]}).spec == ["a", "b"]
    assert guided({"guided_grammar": 'start: "x"'}).kind == "lark"
    c = guided({"structured_outputs": {"regex": "[0-9]+"}})
    assert (c.kind, c.param) == ("regex", "structured_outputs.regex")
    for body, param in [({"guided_json": "{bad"}, "guided_json"), ({"guided_json": [1]}, "guided_json"),
                        ({"guided_regex": 5}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
                        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
                        ({"structured_outputs": "json"}, "structured_outputs")]:
        with pytest.raises(RequestError) as e:
            guided(body)
        assert e.value.param == param, body


def test_one_constraint_per_request():
    assert request_constraint({"response_format": {"type": "json_object"}}, chat=True).kind == "json_object"
    assert request_constraint({"guided_regex": "a+"}, chat=False).param == "guided_regex"
    with pytest.raises(RequestError) as e:
        request_constraint({"response_format": {"type": "json_object"}, "guided_regex": "a"}, chat=True)
    assert e.value.param == "guided_regex"
    with pytest.raises(RequestError) as e:
        request_constraint({"response_format": {"type": "json_object"}}, chat=False)
    assert e.value.param == "response_format"


def test_schema_errors_name_the_field(smol_model):
    from realizar_backend.model.tokenizer import Tokenizer
    g = Guidance(Tokenizer.from_model_file(smol_model), smol_model.config.vocab_size)
    c = request_constraint({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}}}},
        chat=True)
    with pytest.raises(RequestError) as e:
        g.compile(c)
    assert e.value.param == "response_format" and "not" in e.value.message
    c = request_constraint({"guided_regex": "(unclosed"}, chat=False)
    with pytest.raises(RequestError) as e:
        g.compile(c)
    assert e.value.param == "guided_regex"


# ------------------------------------------------------------------ /tokenize, /detokenize, echo

@pytest.fixture(scope="module")
def engine():
    from realizar_backend.engine.engine import Engine
    from realizar_backend.settings import Settings
    eng = Engine.from_settings(Settings(backend="cpu", max_num_seqs=1, context_length=256))
    yield eng
    eng.shutdown()


def test_tokenize_and_detokenize(engine):
    tok = engine.tokenizer
    text = "Hello, world! 😀"
    r = tokenize(engine, {"prompt": text, "return_token_strs": True})
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_context and r["token_strs"] == [tok.id_to_piece(i) for i in r["tokens"]]
    assert tokenize(engine, {"model": engine.model_name, "prompt": text})["token_strs"] is None
    assert detokenize(engine, {"tokens": r["tokens"]}) == {"prompt": text}
    msgs = [{"role": "user", "content": "Hi there"}]
    r = tokenize(engine, {"messages": msgs}, messages=msgs)
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert r["tokens"] == tok.encode(prompt, add_special_tokens=False)
    r2 = tokenize(engine, {"messages": msgs, "add_generation_prompt": False}, messages=msgs)
    assert r2["count"] < r["count"]
    assert detokenize(engine, {"tokens": r["tokens"]})["prompt"] == tok.apply_chat_template(msgs)   # specials kept


@pytest.mark.parametrize("fn,body,param", [
    ("tokenize", {"prompt": 5}, "prompt"),
    ("tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),    # SmolLM2: no tool support
    ("chat", {"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ("chat", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat", {"prompt": "x"}, "prompt"),
    ("detokenize", {"tokens": "1 2"}, "tokens"),
    ("detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("detokenize", {"tokens": [True]}, "tokens"),
])
def test_bad_token_requests(engine, fn, body, param):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(RequestError) as e:
        if fn == "chat":
            tokenize(engine, {"messages": msgs, **body}, messages=msgs)
        else:
            {"tokenize": tokenize, "detokenize": detokenize}[fn](engine, body)
    assert e.value.status == (404 if param == "model" else 400) and e.value.param == param


def test_echo(engine):
    assert echo_text(engine, "Once upon", None, None) == "" and echo_text(engine, "Once upon", False, 2) == ""
    assert echo_text(engine, "Once upon", True, None) == "Once upon"
    ids = engine.tokenizer.encode("<|im_start|>Once upon", add_special_tokens=False)
    assert echo_text(engine, ids, True, None) == "<|im_start|>Once upon"
    for echo, lp in ((True, 0), ("yes", None)):
        with pytest.raises(RequestError) as e:
            echo_text(engine, "x", echo, lp)
        assert e.value.param == "echo"
