"""Structured output and tool calling end to end: the official `openai` client against a real
`bentoml serve` of Qwen2.5-Coder-0.5B on the CPU (the shared one of support.server; short outputs).

- `client.beta.chat.completions.parse(..., response_format=<pydantic model>)` with nested objects,
  enums and arrays returns a valid instance for 20 different prompts;
- a tool round trip (a weather and a calculator function; tool_choice auto, required and named;
  streamed and not) gives tool_calls whose arguments validate, and the follow-up with the tool's
  result renders and ends in text (asked with tool_choice none: after a tool result this 0.5B
  model repeats its call, docs/serving.md says so);
- json_object, vLLM's guided fields, logit_bias, echo, /tokenize and /detokenize;
- bad schemas, unknown tools in tool_choice and malformed tool messages are OpenAI-shaped 400s.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import httpx
import pytest

from support.server import QWEN_MODEL, shared_qwen_server
from support.tool_defs import TOOLS

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = QWEN_MODEL
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server():
    return shared_qwen_server()


def _pet_model():
    from pydantic import BaseModel, Field

    class Kind(str, Enum):
        cat = "cat"
        dog = "dog"
        bird = "bird"

    class Tag(str, Enum):
        small = "small"
        loud = "loud"
        fluffy = "fluffy"
        old = "old"

    class Owner(BaseModel):
        city: str = Field(max_length=24)
        verified: bool

    class Pet(BaseModel):
        name: str = Field(max_length=20)
        kind: Kind
        age: int = Field(ge=0, le=30)
        owner: Owner
        tags: list[Tag] = Field(max_length=3)

    return Pet


PET_PROMPTS = [
    "Invent a pet and describe it.", "A loud old dog from Rome.", "A fluffy cat called Miso, 3 years old.",
    "Describe a small bird living in Lima.", "My neighbour's dog is 12 and very loud.",
    "A kitten, owner not verified.",
    "A parrot that belongs to someone in Oslo.", "An old cat named Tom who lives in Paris.",
    "Describe the pet of a verified owner in Tokyo.", "A puppy named Rex.", "A canary, 1 year old.",
    "A grumpy cat from Berlin, 15 years old.", "Describe a dog that is small and fluffy.",
    "A bird called Kiwi owned by someone in Auckland.", "A cat with no tags.", "Invent a dog from Madrid.",
    "A very old parrot named Polly.", "A 7 year old cat in Cairo.", "Describe a small loud dog.",
    "A pet bird from Nairobi, owner verified.",
]


def test_parse_returns_valid_instances_for_20_prompts(client):
    Pet = _pet_model()

    def one(prompt):
        r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               response_format=Pet, temperature=0, max_tokens=120)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", (prompt, msg.content)
        assert isinstance(msg.parsed, Pet), (prompt, msg.content)
        return msg.parsed

    with ThreadPoolExecutor(len(PET_PROMPTS)) as pool:       # one engine batch
        pets = list(pool.map(one, PET_PROMPTS))
    assert len(pets) == 20
    assert len({p.model_dump_json() for p in pets}) > 1        # 20 prompts, not one canned answer


def test_json_object_and_guided_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris, as a JSON object."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=80)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="The answer (yes or no):", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="A year: ", max_tokens=12, temperature=0.7, seed=1,
                                  extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2] in ("19", "20")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.completions.create(model=MODEL, prompt="The capital of France as JSON:", max_tokens=20, temperature=0,
                                  extra_body={"guided_json": schema}, echo=True)
    text = r.choices[0].text
    assert text.startswith("The capital of France as JSON:")
    assert list(json.loads(text[len("The capital of France as JSON:"):])) == ["city"]


def test_logit_bias_steers_the_reply(server, client):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                     headers=server.auth, timeout=60).json()["tokens"]
    assert len(tok) == 1
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                       temperature=0, max_tokens=3, logit_bias={str(tok[0]): 100})
    assert r.choices[0].message.content == " banana" * 3


def _stream_tool_calls(client, **kw):
    calls: dict[int, dict] = {}
    finish = content = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.content:
            content = (content or "") + c.delta.content
        for tc in c.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


CASES = [("What's the weather like in Paris right now?", "get_weather", "auto", '{"temperature": 18}'),
         ("What is 12 times 7 plus 3?", "calculate", "auto", '{"result": 87}'),
         ("What's the weather like in Paris right now?", "get_weather", "required", '{"temperature": 18}'),
         ("What is 12 times 7 plus 3?", "calculate", "required", '{"result": 87}'),
         ("I need to know something.", "calculate", "named", '{"result": 2}')]


def _round_trip(client, case):
    import jsonschema
    question, fn, choice, result = case
    tool_choice = {"type": "function", "function": {"name": fn}} if choice == "named" else choice
    messages = [{"role": "user", "content": question}]
    kw = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=60)
    r = client.chat.completions.create(**kw)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    calls = choice0.message.tool_calls
    assert [c.function.name for c in calls] == [fn] and calls[0].id and calls[0].type == "function"
    assert not choice0.message.content
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[fn])
    # streamed: the same call (greedy), as OpenAI streams calls
    content, streamed, finish = _stream_tool_calls(client, **kw)
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in streamed] == [(fn, calls[0].function.arguments)]
    assert streamed[0]["id"].startswith("call_")

    messages += [choice0.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": result}]
    follow = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert follow.choices[0].finish_reason in ("stop", "length") and not follow.choices[0].message.tool_calls
    assert follow.choices[0].message.content.strip()


def test_tool_round_trips(client):
    """Every case at once (one engine batch): auto and required for both tools, and a named
    function forced on a question that does not ask for it."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        list(pool.map(lambda c: _round_trip(client, c), CASES))


def test_tools_render_through_the_template_and_tokens_round_trip(server, client):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    def post(path, body):
        r = httpx.post(server.url + path, json=body, headers=server.auth, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    plain = post("/tokenize", {"model": MODEL, "messages": msgs})
    with_tools = post("/tokenize", {"model": MODEL, "messages": msgs, "tools": TOOLS})
    assert with_tools["count"] > plain["count"] and with_tools["max_model_len"] == 1024
    text = post("/detokenize", {"tokens": with_tools["tokens"]})["prompt"]
    assert '"name": "get_weather"' in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


def _error(fn):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    assert e.value.status_code == 400
    return e.value.body


def test_bad_requests_are_openai_400s(client):
    msgs = [{"role": "user", "content": "hi"}]
    body = _error(lambda: client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert body["param"] == "tool_choice" and "get_time" in body["message"]
    body = _error(lambda: client.chat.completions.create(
        model=MODEL, messages=msgs, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}))
    assert body["param"] == "response_format" and "not" in body["message"]
    body = _error(lambda: client.chat.completions.create(
        model=MODEL, messages=msgs + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}], tools=TOOLS))
    assert body["param"] == "messages[1].tool_call_id"
    body = _error(lambda: client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[{"type": "function", "function": {"name": "bad name"}}]))
    assert body["param"] == "tools[0].function.name"
