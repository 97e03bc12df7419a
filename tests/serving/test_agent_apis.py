"""The APIs coding agents speak, end to end: Anthropic's Messages API through the official
`anthropic` client and OpenAI's Responses API through the official `openai` client, against the
real `bentoml serve` of Qwen2.5-Coder-0.5B on the CPU that the test process shares
(support.server.shared_qwen_server).

The model is small, so replies are held where the assertions need them: tool calls are forced
(tool_choice) and structured output has a schema; what is checked is what a client sees (shapes,
stop reasons, usage, event order, errors), never a particular wording. Greedy decoding
(temperature 0) makes every run the same.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from support.server import QWEN_MODEL, shared_qwen_server
from support.tool_defs import CALC, WEATHER

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = QWEN_MODEL
GREEDY = {"temperature": 0}
WEATHER_SCHEMA = WEATHER["function"]["parameters"]
# the same tools in each API's own shape
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in (WEATHER, CALC)]
RESPONSES_TOOLS = [{"type": "function", **t["function"], "strict": True} for t in (WEATHER, CALC)]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "country": {"type": "string", "maxLength": 20}},
               "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    return shared_qwen_server()      # the test process's Qwen server; it keeps 4 responses


@pytest.fixture(scope="module")
def claude(server):
    import anthropic
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(server):
    return server.openai()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------ Anthropic

def test_messages_text_usage_and_count_tokens(claude):
    r = claude.messages.create(model=MODEL, max_tokens=24, messages=_user("Say hello."), extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip()
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 24
    counted = claude.messages.count_tokens(model=MODEL, messages=_user("Say hello."))
    # Anthropic's input_tokens leaves out what was read from the cache
    assert counted.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    r = claude.messages.create(model=MODEL, max_tokens=1, messages=_user("Say hello."), extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 1
    # the same prompt again: its prefix comes from the cache
    assert r.usage.cache_read_input_tokens > 0


def test_messages_stop_sequence_and_structured_output(claude):
    schema = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    r = claude.messages.create(model=MODEL, max_tokens=20, messages=_user("The capital of France, as JSON."),
                               output_config=fmt, extra_body=GREEDY)
    assert json.loads(r.content[0].text) == {"city": "Paris"} and r.stop_reason == "end_turn"
    r = claude.messages.create(model=MODEL, max_tokens=20, messages=_user("The capital of France, as JSON."),
                               output_config=fmt, stop_sequences=["xyz", "Par"], extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Par"
    assert r.content[0].text == '{"city": "'


def test_messages_stream_matches_the_whole_reply(claude):
    kwargs = dict(model=MODEL, max_tokens=30, messages=_user("Name three colours."), extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_messages_stream_events_on_the_wire(server):
    """The raw server-sent events: Anthropic's names and order (the client hides pings)."""
    body = {"model": MODEL, "max_tokens": 40, "stream": True, "temperature": 0, "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": _user("Weather in Oslo?")}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=300,
                      headers={"x-api-key": server.api_key, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    block = data[2]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"].startswith("toolu_")
    args = "".join(d["delta"]["partial_json"] for d in data[3:-3])
    jsonschema.validate(json.loads(args), WEATHER_SCHEMA)
    assert data[-2]["delta"]["stop_reason"] == "tool_use" and data[-2]["usage"]["output_tokens"] > 0


def test_messages_tool_round_trip(claude):
    messages = _user("What is the weather in Paris, in celsius?")
    r = claude.messages.create(model=MODEL, max_tokens=60, messages=messages, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert r.stop_reason == "tool_use"
    [call] = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    messages += [{"role": "assistant", "content": r.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": "21 C and sunny"}]}]}]
    # after a tool result this small model repeats its call unless asked for text (docs/serving.md)
    r = claude.messages.create(model=MODEL, max_tokens=40, messages=messages, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in r.content] == ["text"] and r.stop_reason in ("end_turn", "max_tokens")
    # any: calls only, streamed, one of the tools
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=_user("What is 17 times 3?"),
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].name in ("get_weather", "calculate") and isinstance(final.content[0].input, dict)


def test_messages_errors_in_anthropics_shape(server, claude):
    import anthropic
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus-4-1", max_tokens=8, messages=_user("hi"))
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=_user("hi"))
    # the key as a bearer token (ANTHROPIC_AUTH_TOKEN) is accepted as well as x-api-key
    r = anthropic.Anthropic(base_url=server.url, auth_token=server.api_key, max_retries=0).messages.create(
        model=MODEL, max_tokens=2, messages=_user("hi"))
    assert r.usage.output_tokens > 0
    # max_tokens is required, as Anthropic requires it; an unknown route keeps the shape
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": _user("hi")},
                   headers={"x-api-key": server.api_key}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/messages/nope", headers={"x-api-key": server.api_key}, timeout=60)
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {"type": "not_found_error",
                                                                            "message": r.json()["error"]["message"]}}


# ------------------------------------------------------------------------------ Responses

def test_responses_text_stream_and_usage(oai):
    kwargs = dict(model=MODEL, input="Name three colours.", instructions="Answer briefly.", max_output_tokens=30,
                  temperature=0)
    r = oai.responses.create(**kwargs)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text.strip()
    assert [item.type for item in r.output] == ["message"] and r.instructions == "Answer briefly."
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == r.output_text
    r = oai.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=1, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_function_tool_round_trip(oai):
    r = oai.responses.create(model=MODEL, input="What is the weather in Paris, in celsius?", tools=RESPONSES_TOOLS,
                             tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    # stateful: the stored response continues; stateless: the items sent back (the same prompt)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C and sunny"}
    follow = dict(tools=RESPONSES_TOOLS, tool_choice="none", temperature=0, max_output_tokens=30)
    a = oai.responses.create(model=MODEL, previous_response_id=r.id, input=[result], **follow)
    b = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "What is the weather in Paris, in "
                                                  "celsius?"}, call.model_dump(exclude_none=True), result], **follow)
    assert a.output_text and a.output_text == b.output_text
    assert a.usage.input_tokens == b.usage.input_tokens
    assert a.previous_response_id == r.id and a.usage.input_tokens_details.cached_tokens > 0
    # streamed, calls only: arguments deltas add up to the item's arguments
    with oai.responses.stream(model=MODEL, input="What is 6 times 7?", tools=RESPONSES_TOOLS, tool_choice="required",
                              parallel_tool_calls=False, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [item] = final.output
    assert item.type == "function_call" and item.name in ("get_weather", "calculate")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == item.arguments
    assert isinstance(json.loads(item.arguments), dict)


def test_responses_json_schema(oai):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    r = oai.responses.parse(model=MODEL, input="The largest city of Japan, as JSON.", text_format=City,
                            temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, City), r.output_text
    r = oai.responses.create(model=MODEL, input="Rome, as JSON.", temperature=0, max_output_tokens=60,
                             text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)


def test_responses_store_and_errors(oai):
    import openai
    r = oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    unstored = oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0, store=False)
    for rid in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.create(model=MODEL, input="And again.", previous_response_id=rid)
        assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    # the store keeps the last REALIZAR_RESPONSES_STORE_SIZE (4 here)
    first = oai.responses.create(model=MODEL, input="One.", max_output_tokens=1, temperature=0).id
    for _ in range(4):
        oai.responses.create(model=MODEL, input="Two.", max_output_tokens=1, temperature=0)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first)
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    with pytest.raises(openai.BadRequestError, match="input_image"):
        oai.responses.create(model=MODEL, input=[image])
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", extra_body={"max_output_token": 5})
    assert e.value.body["code"] == "unknown_parameter" and "max_output_tokens" in e.value.body["message"]


# ------------------------------------------------------------------------------ a model that thinks

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny random qwen3 whose template thinks (tests/support/thinking_model.py), served for this module."""
    from support.server import start_server
    from support.thinking_model import write_thinking_model
    path = write_thinking_model(tmp_path_factory.mktemp("thinker") / "thinker.gguf", context_length=1024)
    s = start_server({"REALIZAR_MODEL": str(path), "REALIZAR_MODEL_NAME": "thinker",
                      "REALIZAR_CONTEXT_LENGTH": "1024", "REALIZAR_MAX_NUM_SEQS": "2"})
    yield s
    s.stop()


def test_thought_as_thinking_blocks_and_reasoning_items(thinker):
    """Every API splits a reply the same way: the thought chat completions return as
    reasoning_content is Anthropic's thinking block and the Responses API's reasoning item. (The
    random model's reply is held to a schema; the template opened a thought, which the reply, cut
    short or not, never closes: all of it is the thought.)"""
    import anthropic
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"],
              "additionalProperties": False}
    question = _user("Say a word.")
    chat = thinker.openai().chat.completions.create(
        model="thinker", messages=question, max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    thought = chat.choices[0].message.reasoning_content
    assert thought and json.loads(thought)["word"] is not None and not chat.choices[0].message.content
    claude = anthropic.Anthropic(base_url=thinker.url, api_key=thinker.api_key, max_retries=0, timeout=120)
    kwargs = dict(model="thinker", max_tokens=24, messages=question, thinking={"type": "adaptive"},
                  output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    r = claude.messages.create(**kwargs)
    assert [(b.type, b.thinking) for b in r.content] == [("thinking", thought)]
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", thought)]
    resp = thinker.openai().responses.create(model="thinker", input=question, max_output_tokens=24, temperature=0,
                                             text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
    assert [item.type for item in resp.output] == ["reasoning"] and resp.output[0].content[0].text == thought
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= resp.usage.output_tokens


def test_langchain_with_the_responses_api(server):
    """langchain-openai's ChatOpenAI(use_responses_api=True): a forced tool call comes back parsed."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=server.api_key, temperature=0,
                     max_tokens=60, max_retries=0, use_responses_api=True)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
