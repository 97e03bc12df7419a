"""Hostile requests and a hostile model against a real server: every attack gets a 4xx with an
OpenAI-shaped body (never a 5xx), /livez keeps answering within 100 ms while each one is in
flight (timed from a separate process), the server's memory stays bounded, its worker process is
the same one throughout (nothing crashed it), and good requests are served afterwards.

The model is SmolLM2 with a chat template that behaves on the trial conversation the loader
renders (it renders tools the Hermes way, so tool requests are taken), and runs away when a
message asks it to (a GGUF file can carry any Jinja). The grammars that attack the compiler
(deep chains, huge texts, ones that allow nothing, one that compiles for minutes) are built here,
not stored."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import psutil
import pytest
from gguf import GGUFValueType as V

from support import gguf_kv
from support.grammars import SLOW, defs_chain, lark_chain, object_of
from support.hostile_templates import TRAP_CODES, trapped
from support.real_models import smollm2_path
from support.server import LivezProbe, sample, start_server, wait_for

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "hostile-smol"
LIVEZ_BOUND_S = 0.1
TEMPLATE_TIMEOUT_S = 2
MAX_WAITING = 4
GRAMMAR_TIMEOUT_S = 6
MAX_REQUEST_TOKENS = 1500
PREFILL_CHUNK_TOKENS = 8         # a long prompt takes many steps: what a short request must not wait for
TRAPPED = trapped("<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n",
                  "{% if tools %}<|im_start|>system\nCall one of <tools>{{ tools | tojson }}</tools> as "
                  "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    parts = gguf_kv.read(smollm2_path())
    kvs = gguf_kv.replaced(parts.kvs, "tokenizer.chat_template", V.STRING, TRAPPED)
    path = gguf_kv.write(parts, kvs, tmp_path_factory.mktemp("hostile") / "hostile.gguf", data="copy")
    srv = start_server({"REALIZAR_MODEL": str(path), "REALIZAR_MODEL_NAME": MODEL,
                        "REALIZAR_CHAT_TEMPLATE_TIMEOUT_S": str(TEMPLATE_TIMEOUT_S),
                        "REALIZAR_MAX_WAITING": str(MAX_WAITING),
                        "REALIZAR_GRAMMAR_TIMEOUT_S": str(GRAMMAR_TIMEOUT_S),
                        "REALIZAR_MAX_REQUEST_TOKENS": str(MAX_REQUEST_TOKENS),
                        "REALIZAR_PREFILL_CHUNK_TOKENS": str(PREFILL_CHUNK_TOKENS)})
    yield srv
    srv.stop()


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def chat(content: str, **kw) -> bytes:
    return _json({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw})


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def tokenize(**kw) -> bytes:
    return _json({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw})


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


C, CH, T = "/v1/completions", "/v1/chat/completions", "/tokenize"
JSON = {"Content-Type": "application/json"}
FOUR_MB = 4 << 20
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
SELF_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {
    "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}]

# id, path, body bytes (or a callable giving an iterator: a chunked body), headers, status, param or code
ATTACKS = [
    *[(f"template-{t}", CH, chat(t), JSON, 400, code) for t, code in TRAP_CODES.items()],
    ("prompt-4mb-text", C, _json(comp(prompt="word " * (FOUR_MB // 5 - 100))), JSON, 400, "context_length_exceeded"),
    ("prompt-2m-token-ids", C, b'{"model": "%s", "prompt": [%s]}' % (MODEL.encode(), b",".join([b"1"] * 2_000_000)),
     JSON, 400, "prompt"),
    ("prompt-1m-arrays", C, b'{"model": "%s", "prompt": [%s]}' % (MODEL.encode(), b",".join([b"[1]"] * 1_000_000)),
     JSON, 400, "invalid_json"),
    ("chat-3mb-message", CH, chat("hello " * 500_000), JSON, 400, "context_length_exceeded"),
    ("json-nested-10000", C, b'{"model": "x", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", JSON, 400,
     "invalid_json"),
    ("prompt-lone-surrogate", C, b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL.encode(), JSON,
     400, "prompt"),
    ("message-lone-surrogate", CH, b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}'
     % MODEL.encode(), JSON, 400, "messages[0].content"),
    ("key-lone-surrogate", C, b'{"model": "%s", "prompt": "hi", "\\ud800": 1}' % MODEL.encode(), JSON, 400,
     "invalid_unicode"),
    ("text-plain-body", C, _json(comp()), {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ("form-body", C, b"model=x&prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    ("body-over-limit", C, b'{"model": "x", "prompt": "' + b"a" * (FOUR_MB + 10) + b'"}', JSON, 413,
     "request_too_large"),
    ("chunked-body-over-limit", C, lambda: (b"a" * 65536 for _ in range(FOUR_MB // 65536 + 4)), JSON, 413,
     "request_too_large"),
    ("typo-max-token", C, _json({"model": MODEL, "prompt": "hi", "max_token": 5}), JSON, 400, "max_token"),
    ("unknown-field", CH, _json({"model": MODEL, "messages": [], "guided_decoding_backend": "x"}), JSON, 400,
     "unknown_parameter"),
    ("stop-1mb", C, _json(comp(stop="x" * (1 << 20))), JSON, 400, "stop"),
    ("n-beyond-queue", C, _json(comp(n=MAX_WAITING + 1)), JSON, 400, "n"),
    # grammars: past the limits (measured before any compile: the chains used to end the worker
    # with a signal, the big ones compiled for minutes or failed at the first token with a 500)
    ("lark-rule-chain-5000", C, _json(comp(guided_grammar=lark_chain(5000))), JSON, 400, "grammar_too_large"),
    ("json-defs-chain-5000", C, _json(comp(guided_json=defs_chain(5000))), JSON, 400, "grammar_too_large"),
    ("regex-a-1000000", C, _json(comp(guided_regex="a{1000000}")), JSON, 400, "grammar_too_large"),
    ("regex-nested-repeats", C, _json(comp(guided_regex="(a{1000}){1000}")), JSON, 400, "grammar_too_large"),
    ("regex-3.5mb", C, _json(comp(guided_regex="a" * 3_500_000)), JSON, 400, "grammar_too_large"),
    ("lark-literal-3.5mb", C, _json(comp(guided_grammar='start: "' + "a" * 3_500_000 + '"')), JSON, 400,
     "grammar_too_large"),
    ("schema-10000-optional-properties", CH, _json(chat_body(response_format=schema_format(object_of(10_000)))),
     JSON, 400, "grammar_too_large"),
    ("choices-100000", C, _json(comp(guided_choice=[f"c{i}" for i in range(100_000)])), JSON, 400,
     "grammar_too_large"),
    ("lark-alternatives-100000", C, _json(comp(guided_grammar="start: " + " | ".join(
        f'"w{i}"' for i in range(100_000)))), JSON, 400, "grammar_too_large"),
    # grammars the compile check refuses: one that fails where generation starts, ones that allow
    # no text (they used to answer 200 with empty text), one that compiles past the time limit
    ("schema-requires-itself", C, _json(comp(guided_json=SELF_REQUIRED)), JSON, 400, "grammar_too_complex"),
    ("tool-requires-itself", CH, _json(chat_body(tools=SELF_TOOL, tool_choice="required")), JSON, 400,
     "tools[0].function.parameters"),
    ("regex-matches-nothing", C, _json(comp(guided_regex=r"[^\s\S]")), JSON, 400, "grammar_unsatisfiable"),
    ("schema-ref-root", C, _json(comp(guided_json={"$ref": "#"})), JSON, 400, "grammar_unsatisfiable"),
    ("schema-ref-cycle", C, _json(comp(guided_json={"$defs": {"a": {"$ref": "#/$defs/b"},
                                                              "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
     JSON, 400, "grammar_unsatisfiable"),
    ("schema-compiles-for-minutes", C, _json(comp(guided_json=SLOW)), JSON, 400, "grammar_too_complex"),
    # the token route's template arguments, and nesting
    ("tokenize-kwargs-messages", T, tokenize(chat_template_kwargs={"messages": []}), JSON, 400,
     "chat_template_kwargs"),
    ("tokenize-kwargs-add-generation-prompt", T, tokenize(chat_template_kwargs={"add_generation_prompt": 5}), JSON,
     400, "chat_template_kwargs"),
    ("tokenize-kwargs-tools", T, tokenize(chat_template_kwargs={"tools": "x"}), JSON, 400,
     "chat_template_kwargs"),
    ("tokenize-nested-900", T, tokenize(chat_template_kwargs={"x": json.loads("[" * 900 + "]" * 900)}), JSON, 400,
     "invalid_json"),
    ("logit-bias-arabic-digits", C, _json(comp(logit_bias={"١٢": 5})), JSON, 400, "logit_bias"),
    # one request's cost: prompt tokens x choices, max_tokens x choices
    ("prompt-tokens-x-choices", C, _json(comp(prompt="word " * 470, n=MAX_WAITING)), JSON, 400,
     "request_tokens_exceeded"),
    ("max-tokens-x-choices", C, _json(comp(n=MAX_WAITING, max_tokens=MAX_REQUEST_TOKENS // MAX_WAITING + 1)), JSON,
     400, "request_tokens_exceeded"),
]


def _post(server, path, body, headers):
    content = body() if callable(body) else body
    return httpx.post(server.url + path, content=content, headers={**headers, **server.auth}, timeout=120)


def test_attacks_get_4xx_and_the_server_stays_responsive(server):
    worker = server.worker()
    rss0 = worker.memory_info().rss
    report = []
    for name, path, body, headers, status, what in ATTACKS:
        # an attack that stalls the server does so every time; a slow probe on a busy machine
        # rarely twice in a row: a probe over the bound gets one more try
        for attempt in range(2):
            with LivezProbe(server.url) as probe:
                r = _post(server, path, body, headers)
            report.append(f"{name}: {r.status_code}, /livez worst {probe.worst() * 1000:.0f} ms "
                          f"over {len(probe.samples)} probes")
            assert r.status_code == status, (name, r.text[:500])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, err)
            assert what in (err["param"], err["code"]), (name, err)
            assert probe.statuses() == {"200"}, (name, probe.samples)
            if probe.worst() < LIVEZ_BOUND_S:
                break
        assert probe.worst() < LIVEZ_BOUND_S, "\n".join(report)
    grown = (worker.memory_info().rss - rss0) / 2 ** 20
    print("\n".join(report), f"\nworker memory grew by {grown:.0f} MB", sep="")
    assert grown < 512, f"the worker grew by {grown:.0f} MB"
    assert server.worker().pid == worker.pid, "the worker process was restarted"
    # still serving, and the chat template still renders for ordinary messages
    r = httpx.post(server.url + CH, content=chat("hi", temperature=0), headers={**JSON, **server.auth}, timeout=120)
    assert r.status_code == 200, r.text
    m = server.metrics()
    assert not [k for k, v in m.items() if k[0] == "realizar_request_errors_total" and v
                and dict(k[1]).get("status_code", "").startswith("5")], m


def _check_workers(server) -> list:
    """The grammar check worker processes of the server's worker (engine/grammar_check.py)."""
    return [p for p in server.worker().children(recursive=True)
            if any("grammar_check" in part for part in p.cmdline())]


def test_a_client_that_leaves_during_a_grammar_check_stops_it(server):
    ok = httpx.post(server.url + C, content=_json(comp(guided_regex="[0-9]{3}")), headers={**JSON, **server.auth},
                    timeout=120)
    assert ok.status_code == 200, ok.text
    (worker,) = _check_workers(server)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):       # the client gives up while the grammar compiles
        httpx.post(server.url + C, content=_json(comp(guided_json=SLOW)), headers={**JSON, **server.auth},
                   timeout=1.0)
    # stopped with its client, well before the check's own time limit
    assert wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 20, 0.05)
    assert time.monotonic() - t0 < GRAMMAR_TIMEOUT_S - 1, "the check ran on after its client left"
    assert "the client left while its request was being checked" in server.log_tail(100)
    ok = httpx.post(server.url + C, content=_json(comp(guided_regex="[0-9]{3}")), headers={**JSON, **server.auth},
                    timeout=120)
    assert ok.status_code == 200, ok.text


def _gauges(server) -> tuple[float, float]:
    m = server.metrics()
    return sample(m, "realizar_requests_running"), sample(m, "realizar_requests_waiting")


def test_a_long_request_does_not_hold_up_a_short_one_and_leaving_frees_the_engine(server):
    """Three ~470-token prompts (one request, n=3) take ~180 prefill steps of 8 tokens; a short
    request sent just after it is answered before the long one's first token, and when the long
    one's client leaves mid-prefill (streaming or not), the engine is idle again within a few steps."""
    long_body = comp(prompt="word " * 470, n=3, max_tokens=30, ignore_eos=True, stream=True)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=server.auth, timeout=300) as client:
            events = []

            async def long_one():
                async with client.stream("POST", C, json=long_body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            events.append("long first token")
                            return                 # the client leaves: its choices still prefill

            task = asyncio.create_task(long_one())
            assert await asyncio.to_thread(wait_for, lambda: sum(_gauges(server)) >= 3, 60, 0.02)
            r = await client.post(C, json=comp(prompt="Hi", max_tokens=1))
            assert r.status_code == 200, r.text
            events.append("short answered")
            await task
            return events

    events = asyncio.run(scenario())
    assert events == ["short answered", "long first token"], events
    # the long request's other choices were still prefilling when its client left
    assert wait_for(lambda: _gauges(server) == (0, 0), 10, 0.05), _gauges(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, content=_json({**long_body, "stream": False}), headers={**JSON, **server.auth},
                   timeout=1.5)
    assert wait_for(lambda: _gauges(server) == (0, 0), 10, 0.05), _gauges(server)


def test_a_client_that_leaves_mid_body_is_not_a_server_error(server):
    host, port = server.url.rsplit("//", 1)[1].split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + server.api_key.encode() + b"\r\n"
                      b"Content-Length: 100000\r\n\r\n" + b'{"model": "' + b"x" * 500)
            time.sleep(0.3)
    time.sleep(1.0)
    log = server.log_tail(200)
    assert "the client left while sending its request body" in log, log
    assert "Traceback" not in log and " 500 " not in log, log
    assert sample(server.metrics(), "realizar_request_errors_total", status_code="500") == 0


def test_transport_errors_are_uvicorn_plain_400(server):
    """Malformed HTTP never reaches the app: uvicorn answers 400 in plain text (docs/serving.md)."""
    host, port = server.url.rsplit("//", 1)[1].split(":")
    for garbage in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(garbage)
            s.settimeout(30)
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 400"), head
    assert httpx.get(server.url + "/livez", timeout=10).status_code == 200
