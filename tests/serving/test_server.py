"""The OpenAI-compatible API of a real `bentoml serve` process, driven by the official `openai`
client: models, text and chat completions (streaming and not), greedy output equal to
`realizar generate`, n / seed / stop / logprobs, 16 concurrent streams, and a dropped stream."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.server import CONTEXT, REPO, sample, wait_for

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def realizar_generate(prompt: str, max_tokens: int, chat: bool = False) -> str:
    """Greedy text from the CLI, a separate process with its own engine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALIZAR_")}
    cmd = [sys.executable, "-m", "realizar_backend.cli", "generate", prompt, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--backend", "cpu", "--context-length", str(CONTEXT)]
    if chat:
        cmd.append("--chat")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.endswith("\n")
    return out.stdout[:-1]            # the CLI ends its output with one newline of its own


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_text_completion_greedy_equals_cli(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert choice.text == realizar_generate(PROMPT, 8)
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == (8 if choice.finish_reason == "length" else r.usage.completion_tokens)
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # streaming gives the same text, in pieces, then the usage chunk
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_completion_greedy_equals_cli(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    assert msg.content == realizar_generate(CHAT[0]["content"], 8, chat=True)
    assert r.usage.completion_tokens <= 8

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n_and_seed_are_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 15           # summed over the three choices
    if all(c.finish_reason == "length" for c in a.choices):
        assert a.usage.completion_tokens == 15
    single = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0)
    assert a.usage.prompt_tokens == single.usage.prompt_tokens     # the prompt counts once, not n times

    # streamed chat with n = 2: both choices arrive, interleaved, each with its own finish
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2, seed=5,
                                                 temperature=1.0, stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finishes) == {0, 1}


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = full.strip()[2:5]                   # a piece from inside the greedy output
    assert stop and stop in full
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen)       # greedy: the chosen one is the best

    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0.0 for e in content)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)


def test_sampling_fields(client):
    kw = dict(model=MODEL, prompt="My favourite food is", max_tokens=4, temperature=0.7, top_p=0.9, seed=7,
              presence_penalty=0.5, frequency_penalty=0.3,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens >= 1


def _stream_text(client, prompt: str, max_tokens: int) -> str:
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    return "".join(c.choices[0].text for c in stream if c.choices)


def test_16_concurrent_streams_match_solo(client):
    prompts = [f"Fact number {i}: the {w}" for i, w in enumerate(
        "sun moon sea sky tree river cat dog bird fish stone fire wind rain snow city".split())]
    assert len(prompts) == 16
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
            for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _stream_text(client, p, 5), prompts))
    assert together == solo
    assert len(set(solo)) > 1                  # the outputs are independent, not one answer copied


def test_dropped_stream_frees_its_sequence(server, client):
    before = server.metrics()
    stream = client.completions.create(model=MODEL, prompt="Count to one thousand: 1, 2,", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)                          # it is running: two chunks came
    assert sample(server.metrics(), "realizar_requests_running") == 1
    stream.close()                              # the client goes away mid-stream

    assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 15)
    after = server.metrics()
    assert (sample(after, "realizar_requests_total", finish_reason="abort")
            - sample(before, "realizar_requests_total", finish_reason="abort")) == 1
    assert sample(after, "realizar_kv_cache_usage_ratio") == 0.0
    # a non-streaming client that gives up frees its sequence too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", headers=server.auth, timeout=1.5,
                   json={"model": MODEL, "prompt": "Count to one thousand: 1, 2,", "max_tokens": 400,
                         "ignore_eos": True})       # a sampled EOS must not end it before the timeout
    assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 15)
    final = server.metrics()
    assert (sample(final, "realizar_requests_total", finish_reason="abort")
            - sample(after, "realizar_requests_total", finish_reason="abort")) == 1
    # and the server goes on serving
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
