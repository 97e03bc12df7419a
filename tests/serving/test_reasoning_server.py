"""Reasoning, the chat template's fields and the newer request fields, end to end: a real
`bentoml serve` of a tiny random qwen3 model whose template thinks (tests/support/thinking_model.py, CPU,
one server for the module) and the official `openai` client. The random model's output is held by
a grammar to a thought and then an answer, so the shapes are certain:

- the thought comes back as `reasoning_content` (and `reasoning`), the answer as `content`, whole
  and streamed as their own deltas; `chat_template_kwargs` reaches the template (enable_thinking);
  a reasoning budget ends the thought; with tools, a thought may come first and the call in
  Qwen3.5's XML syntax after it parses;
- continue_final_message / add_generation_prompt shape the prompt; min_tokens, prompt_logprobs,
  stream_options.continuous_usage_stats, usage.prompt_tokens_details.cached_tokens;
- bad values of those fields are 400s naming them; an unknown model is a 404; /health and /version;
- vLLM's waiting gauge moves; a request past REALIZAR_REQUEST_TIMEOUT_S gets an OpenAI-shaped 504.
"""

from __future__ import annotations

import functools
import json
import threading

import httpx
import openai
import pytest

from support.server import guided_chat, model_server, sample, start_server, wait_for
from support.thinking_model import write_thinking_model

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "thinker"
# a thought of words, its close tag, an answer (the template opened the thought)
THINK_THEN_ANSWER = "start: /[a-z]{2,4}( [a-z]{2,4}){3,8}/ </think> /[a-z]{3,6}( [a-z]{3,6}){1,3}/"
USER = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_thinking_model(tmp_path_factory.mktemp("thinker") / "thinker.gguf", context_length=4096)


@pytest.fixture(scope="module")
def server(model_path):
    yield from model_server(model_path, MODEL)


chat = functools.partial(guided_chat, grammar=THINK_THEN_ANSWER, model=MODEL, messages=USER)


def test_reasoning_content_apart_from_content(client):
    r = chat(client)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "stop"
    thought, answer = msg.reasoning_content, msg.content
    assert msg.reasoning == thought and len(thought.split()) >= 4 and "</think>" not in thought
    assert answer and "think" not in answer and len(answer.split()) >= 2
    # streamed: the thought in its own deltas first, then the answer; they join to the same
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "content" in kinds and "reasoning" in kinds
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_template_kwargs_reach_the_template(client, server):
    # thinking off: the prompt holds a closed, empty thought; a reply that opens none is all content
    body = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    on = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": USER}, headers=server.auth).json()
    off = httpx.post(server.url + "/tokenize", json=body, headers=server.auth).json()
    assert off["count"] > on["count"]
    r = chat(client, grammar="start: /[a-z]{3,6}( [a-z]{3,6}){2,4}/",
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.reasoning_content is None and len(r.choices[0].message.content.split()) >= 3
    # a reply that opens its own thought is read as one
    r = chat(client, grammar="start: <think> /[a-z]{3,6}/ </think> /[a-z]{3,6}/",
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert m.reasoning_content and m.content and "think" not in m.reasoning_content + m.content


def test_reasoning_budget_ends_the_thought(client):
    long_thought = "start: /[a-z]{2,4}( [a-z]{2,4}){0,200}/ </think> /[a-z]{3,6}( [a-z]{3,6}){1,2}/"
    r = chat(client, grammar=long_thought, max_tokens=60)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    # the budget forces </think> after 6 tokens of thought: the answer follows in time
    r = chat(client, grammar=long_thought, max_tokens=60, extra_body={"max_reasoning_tokens": 6})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content and len(msg.reasoning_content) <= 6 * 8


def test_tool_call_after_a_thought(client):
    """Tools for a model that thinks: the grammar lets a thought come first; the budget closes it,
    and the call that follows is parsed (whole and streamed), the thought apart."""
    tools = [{"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}, "loud": {"type": "boolean"}},
        "required": ["mode", "loud"]}}}]
    one = dict(model=MODEL, messages=USER, tools=tools, tool_choice="required", parallel_tool_calls=False,
               max_tokens=300, temperature=0, extra_body={"max_reasoning_tokens": 4})
    r = client.chat.completions.create(**one)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "set_mode" and args["mode"] in ("fast", "slow") and isinstance(args["loud"], bool)
    chunks = list(client.chat.completions.create(**one, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == "set_mode" and calls[0].id
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_generation_prompt_fields(server, client):
    def prompt(**body) -> str:
        t = httpx.post(server.url + "/tokenize", json={"model": MODEL, **body}, headers=server.auth).json()
        return httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}, headers=server.auth).json()["prompt"]

    partial = USER + [{"role": "assistant", "content": "The answer is"}]
    assert prompt(messages=USER).endswith("<|im_start|>assistant\n<think>\n")
    assert prompt(messages=USER, add_generation_prompt=False).endswith("two?<|im_end|>\n")
    cont = prompt(messages=partial, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nThe answer is")
    r = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(httpx.post(server.url + "/tokenize", headers=server.auth, json={
        "model": MODEL, "messages": partial, "continue_final_message": True}).json()["tokens"])


def test_min_tokens_and_usage_fields(server, client):
    # min_tokens: the stop string cannot end the output before it
    base = dict(model=MODEL, prompt="x", max_tokens=30, temperature=0, stop=["y"],
                extra_body={"guided_regex": "(xy){10}"})
    assert client.completions.create(**base).choices[0].text == "x"
    r = client.completions.create(**{**base, "extra_body": {**base["extra_body"], "min_tokens": 6}})
    assert r.choices[0].text == "xyxyxyx"
    # every streamed chunk carries the usage so far
    chunks = list(client.completions.create(model=MODEL, prompt="Count:", max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 8
    # the prefix cache's share of the prompt
    long = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog. " * 6}]
    before = server.metrics()
    first = chat(client, grammar=None, messages=long, max_tokens=2)
    again = chat(client, grammar=None, messages=long, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= hit < again.usage.prompt_tokens
    # vLLM's prefix-cache counters count the same tokens (once the engine's next report is in)
    want = {"vllm:prefix_cache_hits_total": hit,
            "vllm:prefix_cache_queries_total": first.usage.prompt_tokens + again.usage.prompt_tokens}

    def moved():
        after = server.metrics()
        return {n: sample(after, n) - sample(before, n) for n in want}
    assert wait_for(lambda: moved() == want, 10), moved()


@pytest.mark.parametrize("body,param", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"bad key": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"doc": "x" * 70000}}, "chat_template_kwargs"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
])
def test_bad_fields_are_400s_naming_them(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.auth,
                   json={"model": MODEL, "messages": USER, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_health_and_version(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=3)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.post(server.url + "/tokenize", json={"model": "gpt-4o", "prompt": "x"}, headers=server.auth)
    assert r.status_code == 404
    assert httpx.get(server.url + "/health").status_code == 200
    from realizar_backend import __version__
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_vllm_waiting_gauge_moves(server, client):
    """Two sequences run at once here: a third waits, and vllm:num_requests_waiting says so."""
    def stream():
        s = client.completions.create(model=MODEL, prompt="Count:", max_tokens=4000, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(s))                      # running
        return s

    def gauge(name):
        return sample(server.metrics(), name, model_name=MODEL)

    running, third = [stream(), stream()], None
    try:
        assert wait_for(lambda: gauge("vllm:num_requests_running") == 2, 30)
        third = threading.Thread(target=lambda: running.append(stream()))
        third.start()
        assert wait_for(lambda: gauge("vllm:num_requests_waiting") >= 1, 30)
    finally:
        for s in running[:2]:
            s.close()                      # the two leave; the third runs, then is closed too
        if third is not None:
            third.join(60)
        for s in running[2:]:
            s.close()
    assert wait_for(lambda: gauge("vllm:num_requests_waiting") == 0 and gauge("vllm:num_requests_running") == 0, 30)


def test_a_request_past_the_time_limit_gets_a_504(model_path):
    s = start_server({"REALIZAR_MODEL": str(model_path), "REALIZAR_MODEL_NAME": MODEL,
                      "REALIZAR_CONTEXT_LENGTH": "4096", "REALIZAR_REQUEST_TIMEOUT_S": "1"})
    try:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "n": 4}
        r = httpx.post(s.url + "/v1/completions", json=body, headers=s.auth, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "response_timeout", r.text
        assert "REALIZAR_REQUEST_TIMEOUT_S" in r.json()["error"]["message"]
        m = s.metrics()
        assert sample(m, "realizar_request_errors_total", status_code="504") == 1
        # its sequences were cancelled: the engine is idle again, and a short request is served
        assert wait_for(lambda: sample(s.metrics(), "realizar_requests_running") == 0, 15)
        ok = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 2, "n": 1}, headers=s.auth, timeout=60)
        assert ok.status_code == 200
    finally:
        s.stop()
