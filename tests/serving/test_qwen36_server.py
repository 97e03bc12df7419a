"""Thinking mode of a Qwen3.5 / 3.6 hybrid end to end: a real `bentoml serve` (CPU) of a tiny random
qwen35 GGUF that carries the real Qwen3.6 tokenizer and chat template, from the twin header
shared/models/qwen36.head.gz (tests/support/qwen35_model.py; the module is skipped without it).
The random model's output is held by a grammar, or its thought closed by a thinking budget, so the
shapes are certain:

- the prompt the server renders ends in the template's generation prompt: `<think>\\n` (thinking
  on, the default), an empty closed thought with `chat_template_kwargs.enable_thinking: false`;
- chat completions: the thought is reasoning_content, the answer content, whole and streamed; with
  thinking off no reasoning comes back;
- /v1/messages: with thinking enabled a thinking block comes first (whole and streamed); without,
  none; /v1/responses: the thought is a reasoning item (whole and streamed).
Parsing the real tokenizer's token streams: tests/serving/test_qwen36_thinking.py.
"""

from __future__ import annotations

import functools

import httpx
import pytest

from support.qwen35_model import write_qwen35_model
from support.server import guided_chat, tiny_model_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "qwen36-tiny"
USER = [{"role": "user", "content": "What is two plus two?"}]
# a thought of words, its close tag, an answer (the template opened the thought)
THINK_THEN_ANSWER = "start: /[a-z]{2,4}( [a-z]{2,4}){3,8}/ </think> /[a-z]{3,6}( [a-z]{3,6}){1,3}/"
ANSWER_ONLY = "start: /[a-z]{3,6}( [a-z]{3,6}){2,4}/"
ANTHROPIC = {"anthropic-version": "2023-06-01"}


chat = functools.partial(guided_chat, model=MODEL, messages=USER)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_model_server(tmp_path_factory, "qwen36", write_qwen35_model, MODEL, REALIZAR_BACKEND="cpu")


def rendered(server, **kw) -> str:
    """The prompt the server renders for USER, as text (its tokens, detokenized)."""
    r = httpx.post(server.url + "/tokenize", headers=server.auth, timeout=60,
                   json={"model": MODEL, "messages": USER, **kw})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/detokenize", headers=server.auth, timeout=60,
                   json={"model": MODEL, "tokens": r.json()["tokens"]})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_the_generation_prompt_opens_the_thought_or_closes_it(server):
    on = rendered(server)
    assert on.endswith("assistant\n<think>\n") and on == rendered(
        server, chat_template_kwargs={"enable_thinking": True})
    off = rendered(server, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("assistant\n<think>\n\n</think>\n\n") and off.startswith(on.removesuffix("<think>\n"))


def test_chat_thought_apart_from_the_answer(client):
    r = chat(client, THINK_THEN_ANSWER)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    thought, answer = msg.reasoning_content, msg.content
    assert msg.reasoning == thought and len(thought.split()) >= 4 and "think>" not in thought
    assert answer and "think>" not in answer and len(answer.split()) >= 2
    deltas = [c.choices[0].delta for c in chat(client, THINK_THEN_ANSWER, stream=True) if c.choices]
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and {"reasoning", "content"} <= set(kinds)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer


def test_chat_with_thinking_off_has_no_reasoning(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = chat(client, ANSWER_ONLY, extra_body=off)
    msg = r.choices[0].message
    assert msg.reasoning_content is None and msg.reasoning is None and len(msg.content.split()) >= 3
    deltas = [c.choices[0].delta for c in chat(client, ANSWER_ONLY, extra_body=off, stream=True) if c.choices]
    assert not any(getattr(d, "reasoning_content", None) or getattr(d, "reasoning", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_messages_thinking_blocks(server):
    """Anthropic's thinking on: the template's thought, closed by the budget, is the first block;
    off (the default): the template is asked not to think and no thinking block comes back."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 24, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 6}}
    am = httpx.post(server.url + "/v1/messages", headers={**server.auth, **ANTHROPIC}, timeout=120, json=body).json()
    kinds = [b["type"] for b in am["content"]]
    assert kinds[0] == "thinking" and set(kinds) <= {"thinking", "text"} and kinds.count("thinking") == 1, am
    thought = am["content"][0]["thinking"]
    assert thought and "think>" not in thought and all("think>" not in b.get("text", "") for b in am["content"])
    events = httpx.post(server.url + "/v1/messages", headers={**server.auth, **ANTHROPIC}, timeout=120,
                        json={**body, "stream": True}).text
    assert "thinking_delta" in events and "think>" not in events
    plain = {k: v for k, v in body.items() if k != "thinking"}
    am = httpx.post(server.url + "/v1/messages", headers={**server.auth, **ANTHROPIC}, timeout=120, json=plain).json()
    assert am["content"] and all(b["type"] == "text" for b in am["content"]), am
    events = httpx.post(server.url + "/v1/messages", headers={**server.auth, **ANTHROPIC}, timeout=120,
                        json={**plain, "stream": True}).text
    assert "thinking" not in events and "text_delta" in events


def test_responses_reasoning_item(server):
    """The template opens the thought and the random model never writes the one token of 248,320
    that closes it: the reply is a reasoning item cut at the token limit, whole and streamed."""
    body = {"model": MODEL, "input": "What is two plus two?", "max_output_tokens": 16, "temperature": 0}
    resp = httpx.post(server.url + "/v1/responses", headers=server.auth, timeout=120, json=body).json()
    assert resp["status"] == "incomplete", resp
    (item,) = resp["output"]
    assert item["type"] == "reasoning" and item["content"][0]["text"] and "think>" not in item["content"][0]["text"]
    events = httpx.post(server.url + "/v1/responses", headers=server.auth, timeout=120,
                        json={**body, "stream": True}).text
    assert "response.reasoning_text.delta" in events and "think>" not in events
