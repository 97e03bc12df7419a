"""gpt-oss's harmony format end to end: a real `bentoml serve` of a tiny random gpt-oss GGUF that
carries the real gpt-oss-20b tokenizer (201,088 tokens, the harmony markers special tokens) and chat
template, from the twin header shared/models/gptoss20.head.gz (tests/support/gptoss_model.py; the
module is skipped without it). The random model's output is held by a grammar to harmony's shape
(its markers named as the special tokens they are), so the shapes are certain:

- chat completions: the analysis channel comes back as reasoning_content, the final channel as
  content (no marker in either), whole and streamed; a commentary message to functions.NAME is a
  tool call with finish_reason "tool_calls" (the engine stopped at <|call|>), whole and streamed;
- /v1/responses and /v1/messages: with tool_choice required (the harmony tool grammar) the
  thought comes back as a reasoning item / thinking block;
- reasoning_effort reaches the template.
"""

from __future__ import annotations

import functools
import json

import httpx
import pytest

from support.gptoss_model import write_gptoss_model
from support.server import guided_chat, tiny_model_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "gptoss"
USER = [{"role": "user", "content": "What is two plus two?"}]
THOUGHT_THEN_ANSWER = ('start: <|channel|> "analysis" <|message|> /[a-z]{2,4}( [a-z]{2,4}){3,6}/ <|end|> '
                       '<|start|> "assistant" <|channel|> "final" <|message|> /[a-z]{3,6}( [a-z]{3,6}){1,3}/')
THOUGHT_THEN_CALL = ('start: <|channel|> "analysis" <|message|> /[a-z]{2,4}( [a-z]{2,4}){2,4}/ <|end|> '
                     '<|start|> "assistant" <|channel|> "commentary to=functions.set_mode " <|constrain|> "json" '
                     '<|message|> "{\\"mode\\": \\"" /(fast|slow)/ "\\"}" <|call|>')
TOOLS = [{"type": "function", "function": {"name": "set_mode", "description": "Sets the mode.", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}}, "required": ["mode"]}}}]


chat = functools.partial(guided_chat, model=MODEL, messages=USER)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_model_server(tmp_path_factory, "gptoss20", write_gptoss_model, MODEL)


def test_analysis_is_reasoning_and_final_is_content(client):
    r = chat(client, THOUGHT_THEN_ANSWER)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "stop"
    thought, answer = msg.reasoning_content, msg.content
    assert msg.reasoning == thought and len(thought.split()) >= 4 and "<|" not in thought
    assert answer and "<|" not in answer and len(answer.split()) >= 2
    assert "analysis" not in thought and "final" not in answer
    chunks = list(chat(client, THOUGHT_THEN_ANSWER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer


def test_commentary_call_is_a_tool_call(client):
    r = chat(client, THOUGHT_THEN_CALL, tools=TOOLS)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content is None
    assert msg.reasoning_content and "<|" not in msg.reasoning_content
    (call,) = msg.tool_calls
    assert call.function.name == "set_mode" and json.loads(call.function.arguments)["mode"] in ("fast", "slow")
    chunks = list(chat(client, THOUGHT_THEN_CALL, tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "set_mode" and calls[0].id
    # (the tiny random model's near-even logits may pick the other mode on another run)
    assert json.loads("".join(tc.function.arguments or "" for tc in calls))["mode"] in ("fast", "slow")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_thought_in_responses_and_messages(server):
    """tool_choice required holds the reply to the harmony grammar (tool_grammars.harmony_grammar:
    a thought may come first, then one call). The random model never closes its thought (<|end|>
    is one token of 201,088), so the reply is a thought cut at the token limit: a Responses reasoning
    item and a Messages thinking block, incomplete, with no marker and no call. (The call path of
    these APIs is chat's parser, covered above and in test_harmony.py.)"""
    params = TOOLS[0]["function"]["parameters"]
    rtools = [{"type": "function", "name": "set_mode", "description": "Sets the mode.", "parameters": params}]
    resp = httpx.post(server.url + "/v1/responses", headers=server.auth, timeout=120, json={
        "model": MODEL, "input": "What is two plus two?", "tools": rtools, "tool_choice": "required",
        "max_output_tokens": 40, "temperature": 0, "reasoning": {"effort": "low"}}).json()
    assert resp["status"] == "incomplete", resp
    (item,) = resp["output"]
    assert item["type"] == "reasoning" and item["content"][0]["text"] and "<|" not in item["content"][0]["text"]
    atools = [{"name": "set_mode", "description": "Sets the mode.", "input_schema": params}]
    am = httpx.post(server.url + "/v1/messages", headers={**server.auth, "anthropic-version": "2023-06-01"},
                    timeout=120, json={"model": MODEL, "messages": USER, "tools": atools, "tool_choice": {"type": "any"},
                                       "max_tokens": 40, "temperature": 0,
                                       "thinking": {"type": "enabled", "budget_tokens": 1024}}).json()
    assert am["stop_reason"] == "max_tokens", am
    (block,) = am["content"]
    assert block["type"] == "thinking" and block["thinking"] and "<|" not in block["thinking"]
    # streamed: the same thought as reasoning / thinking deltas, no marker anywhere
    events = httpx.post(server.url + "/v1/responses", headers=server.auth, timeout=120, json={
        "model": MODEL, "input": "What is two plus two?", "tools": rtools, "tool_choice": "required",
        "max_output_tokens": 40, "temperature": 0, "stream": True}).text
    assert "response.reasoning_text.delta" in events and "<|" not in events and "function_call" not in events
    events = httpx.post(server.url + "/v1/messages", headers={**server.auth, "anthropic-version": "2023-06-01"},
                        timeout=120, json={"model": MODEL, "messages": USER, "tools": atools, "stream": True,
                                           "tool_choice": {"type": "any"}, "max_tokens": 40, "temperature": 0,
                                           "thinking": {"type": "enabled", "budget_tokens": 1024}}).text
    assert "thinking_delta" in events and "<|" not in events and "tool_use" not in events


def test_reasoning_effort_reaches_the_template(server):
    def count(effort):
        body = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"reasoning_effort": effort}}
        r = httpx.post(server.url + "/tokenize", json=body, headers=server.auth)
        assert r.status_code == 200, r.text
        return r.json()
    low, high = count("low"), count("high")
    assert low["tokens"] != high["tokens"]
