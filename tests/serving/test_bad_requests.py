"""Bad requests against a real server: each gets its documented status and an OpenAI-shaped
error body, never a 500, and the server keeps answering good requests afterwards."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from support.server import CONTEXT, MAX_NUM_SEQS, MAX_WAITING, sample, wait_for

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
C, CH = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "Hi"}]


def comp(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": OK_MSG, "max_tokens": 2, **kw}


# (id, method, path, body: dict | bytes | None, headers override, status, expected param or code)
AUTH = object()          # placeholder: "use the right key"
CASES = [
    ("malformed-json", "POST", C, b'{"model": "x", "prompt": ', AUTH, 400, "invalid_json"),
    ("body-not-object", "POST", C, b'[1, 2, 3]', AUTH, 400, "invalid_json"),
    ("body-not-utf8", "POST", C, b'\xff\xfe\x00', AUTH, 400, "invalid_json"),
    ("missing-model", "POST", C, {"prompt": "hi"}, AUTH, 400, "model"),
    ("unknown-model", "POST", C, comp(model="gpt-17"), AUTH, 404, "model_not_found"),
    ("model-not-string", "POST", C, comp(model=3), AUTH, 400, "model"),
    ("missing-prompt", "POST", C, {"model": MODEL}, AUTH, 400, "prompt"),
    ("prompt-number", "POST", C, comp(prompt=42), AUTH, 400, "prompt"),
    ("prompt-empty", "POST", C, comp(prompt=""), AUTH, 400, "prompt"),
    ("prompt-ids-out-of-vocab", "POST", C, comp(prompt=[1, 2, 10 ** 9]), AUTH, 400, "prompt"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), AUTH, 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-5), AUTH, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="10"), AUTH, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=1.5), AUTH, 400, "max_tokens"),
    ("max-tokens-beyond-context", "POST", C, comp(max_tokens=CONTEXT), AUTH, 400, "context_length_exceeded"),
    ("max-tokens-absurd", "POST", C, comp(max_tokens=10 ** 12), AUTH, 400, "max_tokens"),
    ("prompt-beyond-context", "POST", C, comp(prompt="word " * (2 * CONTEXT)), AUTH, 400,
     "context_length_exceeded"),
    ("temperature-negative", "POST", C, comp(temperature=-1), AUTH, 400, "temperature"),
    ("temperature-absurd", "POST", C, comp(temperature=1e9), AUTH, 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), AUTH, 400, "temperature"),
    ("temperature-nan", "POST", C, b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(),
     AUTH, 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), AUTH, 400, "top_p"),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), AUTH, 400, "top_p"),
    ("top-k-negative", "POST", C, comp(top_k=-7), AUTH, 400, "top_k"),
    ("min-p-above-one", "POST", C, comp(min_p=2), AUTH, 400, "min_p"),
    ("presence-penalty-absurd", "POST", C, comp(presence_penalty=3), AUTH, 400, "presence_penalty"),
    ("frequency-penalty-absurd", "POST", C, comp(frequency_penalty=-3), AUTH, 400, "frequency_penalty"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), AUTH, 400, "repetition_penalty"),
    ("n-zero", "POST", C, comp(n=0), AUTH, 400, "n"),
    ("n-absurd", "POST", C, comp(n=1000), AUTH, 400, "n"),
    ("n-times-prompts", "POST", C, comp(n=16, prompt=["a"] * 8), AUTH, 400, "n"),
    ("logprobs-absurd", "POST", C, comp(logprobs=100), AUTH, 400, "logprobs"),
    ("logprobs-bool", "POST", C, comp(logprobs=True), AUTH, 400, "logprobs"),
    ("stop-number", "POST", C, comp(stop=7), AUTH, 400, "stop"),
    ("stop-too-many", "POST", C, comp(stop=[str(i) for i in range(40)]), AUTH, 400, "stop"),
    ("stop-token-id-negative", "POST", C, comp(stop_token_ids=[-1]), AUTH, 400, "stop_token_ids"),
    ("seed-string", "POST", C, comp(seed="x"), AUTH, 400, "seed"),
    ("stream-string", "POST", C, comp(stream="yes"), AUTH, 400, "stream"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), AUTH, 400,
     "stream_options"),
    ("echo-with-logprobs", "POST", C, comp(echo=True, logprobs=1), AUTH, 400, "echo"),
    ("suffix-unsupported", "POST", C, comp(suffix="x"), AUTH, 400, "suffix"),
    ("logit-bias-not-a-token", "POST", C, comp(logit_bias={"999999999": 1}), AUTH, 400, "logit_bias"),
    ("logit-bias-absurd", "POST", C, comp(logit_bias={"1": 500}), AUTH, 400, "logit_bias"),
    ("guided-json-unsupported-key", "POST", C, comp(guided_json={"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}), AUTH, 400, "guided_json"),
    ("guided-regex-malformed", "POST", C, comp(guided_regex="(unclosed"), AUTH, 400, "guided_regex"),
    ("two-guided-fields", "POST", C, comp(guided_regex="a+", guided_choice=["a"]), AUTH, 400, "guided_choice"),
    ("response-format-on-completions", "POST", C, comp(response_format={"type": "json_object"}), AUTH, 400,
     "unknown_parameter"),
    ("best-of-unsupported", "POST", C, comp(best_of=3), AUTH, 400, "best_of"),
    ("chat-missing-messages", "POST", CH, {"model": MODEL}, AUTH, 400, "messages"),
    ("chat-empty-messages", "POST", CH, chat(messages=[]), AUTH, 400, "messages"),
    ("chat-messages-not-list", "POST", CH, chat(messages="hi"), AUTH, 400, "messages"),
    ("chat-bad-role", "POST", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), AUTH, 400,
     "messages[0].role"),
    ("chat-content-number", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), AUTH, 400,
     "messages[0].content"),
    ("chat-image-part", "POST", CH, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), AUTH, 400, "messages[0].content"),
    ("chat-top-logprobs-without-logprobs", "POST", CH, chat(top_logprobs=2), AUTH, 400, "top_logprobs"),
    ("chat-top-logprobs-absurd", "POST", CH, chat(logprobs=True, top_logprobs=99), AUTH, 400, "top_logprobs"),
    ("chat-max-completion-tokens-negative", "POST", CH, chat(max_completion_tokens=-1), AUTH, 400,
     "max_tokens"),
    ("chat-beyond-context", "POST", CH, chat(max_tokens=CONTEXT), AUTH, 400, "context_length_exceeded"),
    ("chat-tools-template-without-tools", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     AUTH, 400, "tools_not_supported"),
    ("chat-tool-choice-without-tools", "POST", CH, chat(tool_choice="required"), AUTH, 400, "tool_choice"),
    ("chat-tool-message-answers-nothing", "POST", CH, chat(messages=OK_MSG + [
        {"role": "tool", "tool_call_id": "call_1", "content": "18"}]), AUTH, 400, "messages[1].tool_call_id"),
    ("chat-tool-call-arguments-not-json", "POST", CH, chat(messages=OK_MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), AUTH, 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("chat-response-format-bad-type", "POST", CH, chat(response_format={"type": "xml"}), AUTH, 400,
     "response_format"),
    ("chat-json-schema-without-name", "POST", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}), AUTH, 400, "response_format.json_schema.name"),
    ("chat-json-schema-not-a-schema", "POST", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}), AUTH, 400,
     "response_format"),
    ("tokenize-prompt-number", "POST", "/tokenize", {"prompt": 5}, AUTH, 400, "prompt"),
    ("tokenize-unknown-field", "POST", "/tokenize", {"prompt": "x", "add_special_token": True}, AUTH, 400,
     "add_special_token"),
    ("detokenize-not-a-token", "POST", "/detokenize", {"tokens": [1, 10 ** 9]}, AUTH, 400, "tokens"),
    ("chat-unknown-model", "POST", CH, chat(model="nope"), AUTH, 404, "model_not_found"),
    ("no-api-key", "POST", C, comp(), {}, 401, "invalid_api_key"),
    ("wrong-api-key", "POST", C, comp(), {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
    ("not-bearer", "GET", "/v1/models", None, {"Authorization": "Basic dGVzdA=="}, 401, "invalid_api_key"),
    ("unknown-path", "POST", "/v1/engines/x/completions", comp(), AUTH, 404, "not_found"),
    ("wrong-method", "GET", C, None, AUTH, 405, "method_not_allowed"),
    ("unknown-model-retrieve", "GET", "/v1/models/gpt-17", None, AUTH, 404, "model_not_found"),
]


def _send(server, method, path, body, headers):
    hdrs = server.auth if headers is AUTH else dict(headers)
    if isinstance(body, dict):
        content = json.dumps(body).encode()
        hdrs["Content-Type"] = "application/json"
    else:
        content = body
    return httpx.request(method, server.url + path, content=content, headers=hdrs, timeout=120)


def test_table_is_large_enough():
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, case):
    _, method, path, body, headers, status, what = case
    r = _send(server, method, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    # `what` is either the offending field (param) or the machine-readable code
    assert what in (err["param"], err["code"]), err


def test_server_still_answers_after_bad_requests(server):
    for case in CASES:
        _send(server, *case[1:5])
    r = httpx.post(server.url + C, json=comp(max_tokens=2, temperature=0), headers=server.auth, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
    m = server.metrics()
    assert sample(m, "realizar_request_errors_total", status_code="400") >= 40
    assert sample(m, "realizar_request_errors_total", status_code="401") >= 3


def test_capacity_answers_503_with_retry_after(server):
    """Fill every KV slot, then the waiting queue, and one more request is refused with 503 and
    Retry-After; dropping the held streams then frees every sequence at once."""
    hold = MAX_NUM_SEQS + MAX_WAITING
    before = server.metrics()

    def gauges(running, waiting):
        def check():
            m = server.metrics()
            return (sample(m, "realizar_requests_running") == running
                    and sample(m, "realizar_requests_waiting") == waiting)
        return check

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=server.auth, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            release = asyncio.Event()
            statuses = []

            async def hold_stream(i):
                # no EOS and room for most of the context: nothing may finish on its own before the drop
                body = comp(prompt=f"Count slowly to one hundred, try {i}:", max_tokens=CONTEXT - 64,
                            ignore_eos=True, stream=True)
                async with client.stream("POST", C, json=body) as r:
                    statuses.append(r.status_code)
                    await release.wait()      # leaving the block closes the connection mid-stream

            # the queue bounds requests not yet admitted, so fill the slots first, then the queue
            tasks = [asyncio.create_task(hold_stream(i)) for i in range(MAX_NUM_SEQS)]
            assert await asyncio.to_thread(wait_for, gauges(MAX_NUM_SEQS, 0), 120), server.log_tail()
            tasks += [asyncio.create_task(hold_stream(i)) for i in range(MAX_NUM_SEQS, hold)]
            assert await asyncio.to_thread(wait_for, gauges(MAX_NUM_SEQS, MAX_WAITING), 60)
            r = await client.post(C, json=comp())
            assert r.status_code in (429, 503), r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "server_overloaded"
            release.set()
            for t in tasks:
                t.cancel()               # the waiting ones never got headers: cancel them too
            await asyncio.gather(*tasks, return_exceptions=True)
            assert set(statuses) <= {200}     # those whose headers came before the drop

    asyncio.run(scenario())
    assert wait_for(gauges(0, 0), 30), server.log_tail()
    after = server.metrics()
    finished = {reason: sample(after, "realizar_requests_total", finish_reason=reason)
                - sample(before, "realizar_requests_total", finish_reason=reason)
                for reason in ("abort", "stop", "length")}
    assert finished["abort"] == hold, finished
