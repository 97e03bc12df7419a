"""The SSE bytes of streamed completions and chat on the real SmolLM2 (NumPy backend), through the
routes' own stream generators: every chunk is byte for byte what encoding its object with
json.dumps gives (the plain text chunks come from a per-stream template), the text deltas join to
the non-streamed reply, and the stream ends with one finish per choice, usage and [DONE]. (Streamed
tool calls, which keep the dict path, are checked with a tool-capable model in
test_structured_server.py.)"""

import asyncio
import json

import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.serving import chat, streaming
from realizar_backend.serving import openai as oa
from realizar_backend.serving import plans
from realizar_backend.settings import Settings

TRICKY = ["", "a", " hello", 'quote " and \\ backslash', "tab\tnew\nline\r", "\x00\x01\x1f\x7f",
          "é ü 中文 🙂", "\u2028\u2029", "</script>", "\ue000realizar-text\ue000", "{\"k\": [1, 2]}"]


@pytest.mark.parametrize("model", ["SmolLM2", "naïve \"model\"", "x\ue000realizar-text\ue000y"])
def test_template_bytes_equal_the_dict_encoding(model):
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": model}
    shapes = [lambda t, i: {**head, "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": None}]},
              lambda t, i: {**head, "object": "chat.completion.chunk",
                            "choices": [{"index": i, "delta": {"content": t}, "logprobs": None,
                                         "finish_reason": None}]}]
    for make in shapes:
        for i in (0, 3):
            template = streaming.ChunkTemplate(lambda t, i=i: make(t, i))
            for text in TRICKY:
                assert template(text) == streaming.sse(make(text, i))


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_settings(Settings(backend="cpu", max_num_seqs=8, context_length=512))
    yield eng
    eng.shutdown()


def _run(engine, route: str, body: dict) -> tuple[list[bytes], bytes]:
    """(the stream's body chunks as the route yields them, the non-streamed reply's body)."""
    settings = engine.settings
    make_plan = plans.completion_plan if route == "completions" else plans.chat_plan
    head = {"id": "x-1", "created": 1, "model": engine.model_name}
    if route == "completions":
        head = {**head, "object": "text_completion"}

    async def go():
        plan = make_plan(json.dumps({**body, "stream": True}).encode(), engine, settings)
        gen = oa._stream_completion if route == "completions" else chat.stream_chat
        chunks = [c async for c in gen(engine, plan, head)]
        once = {k: v for k, v in body.items() if k != "stream_options"}
        full_plan = make_plan(json.dumps({**once, "stream": False}).encode(), engine, settings)
        full = oa._full_completion if route == "completions" else chat.full_chat
        state = type("S", (), {"offload": None})()
        whole = [c async for c in full(state, engine, full_plan, head)]
        return chunks, b"".join(whole)
    return asyncio.run(go())


def _events(chunks: list[bytes]) -> list[bytes]:
    raw = b"".join(chunks)
    assert raw.endswith(b"\n\n")
    return [e + b"\n\n" for e in raw[:-2].split(b"\n\n")]


def _check(chunks: list[bytes], n: int, usage: bool) -> tuple[list[dict], dict | None]:
    assert type(chunks[-1]) is streaming.Last and all(type(c) is not streaming.Last for c in chunks[:-1])
    events = _events(chunks)
    assert events[-1] == b"data: [DONE]\n\n"
    objs = []
    for e in events[:-1]:
        assert e.startswith(b"data: ")
        obj = json.loads(e[6:])
        assert streaming.sse(obj) == e          # the bytes the dict encoding of the same object gives
        objs.append(obj)
    tail = None
    if usage:
        tail = objs.pop()
        assert tail["choices"] == [] and set(tail["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                                                 "prompt_tokens_details"}
    finishes = [c["index"] for o in objs for c in o["choices"] if c["finish_reason"] is not None]
    assert sorted(finishes) == list(range(n))
    return objs, tail


def _counts(usage: dict) -> dict:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"echo": True}, {"n": 2, "seed": 3, "temperature": 0.8}])
def test_streamed_completion_chunks(engine, extra):
    body = {"model": engine.model_name, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0, "stream_options": {"include_usage": True}, **extra}
    if extra.get("n"):
        body.pop("stream_options")
    chunks, whole = _run(engine, "completions", body)
    n = extra.get("n", 1)
    objs, tail = _check(chunks, n, usage="stream_options" in body)
    reply = json.loads(whole)
    for i in range(n):
        mine = [c for o in objs for c in o["choices"] if c["index"] == i]
        assert "".join(c["text"] for c in mine) == reply["choices"][i]["text"]
        if "logprobs" in extra:
            tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert tokens == reply["choices"][i]["logprobs"]["tokens"]
        else:
            assert all(c["logprobs"] is None for c in mine)
        assert [list(c) for c in mine] == [["index", "text", "logprobs", "finish_reason"]] * len(mine)
    if tail is not None:     # (the second run may find the prompt in the prefix cache)
        assert _counts(tail["usage"]) == _counts(reply["usage"])


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "seed": 5, "temperature": 0.9}])
def test_streamed_chat_chunks(engine, extra):
    body = {"model": engine.model_name, "max_completion_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
            "stream_options": {"include_usage": True}, **extra}
    chunks, whole = _run(engine, "chat", body)
    n = extra.get("n", 1)
    objs, tail = _check(chunks, n, usage=True)
    reply = json.loads(whole)
    for i in range(n):
        mine = [c for o in objs for c in o["choices"] if c["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        content = "".join(c["delta"].get("content") or "" for c in mine)
        assert content == (reply["choices"][i]["message"]["content"] or "")
        if "logprobs" in extra:
            got = [t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
            assert got == [t["token"] for t in reply["choices"][i]["logprobs"]["content"]]
    assert _counts(tail["usage"]) == _counts(reply["usage"])
