"""Hostile requests and a hostile model against a real server: every attack gets a 4xx with an
OpenAI-shaped body (never a 5xx), /livez keeps answering within 100 ms while each one is in
flight (timed from a separate process), the server's memory stays bounded, and good requests
are served afterwards.

The model is SmolLM2 with a chat template that behaves on the trial conversation the loader
renders, and runs away when a message asks it to (a GGUF file can carry any Jinja)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from gguf import GGUFValueType as V

import gguf_kv
from hostile_templates import TRAP_CODES, trapped
from real_models import smollm2_path
from server_util import LivezProbe, sample, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "hostile-smol"
LIVEZ_BOUND_S = 0.1
TEMPLATE_TIMEOUT_S = 2
MAX_WAITING = 4
TRAPPED = trapped("<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n",
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    parts = gguf_kv.read(smollm2_path())
    kvs = gguf_kv.replaced(parts.kvs, "tokenizer.chat_template", V.STRING, TRAPPED)
    path = gguf_kv.write(parts, kvs, tmp_path_factory.mktemp("hostile") / "hostile.gguf", data="copy")
    srv = start_server({"REALIZAR_MODEL": str(path), "REALIZAR_MODEL_NAME": MODEL,
                        "REALIZAR_CHAT_TEMPLATE_TIMEOUT_S": str(TEMPLATE_TIMEOUT_S),
                        "REALIZAR_MAX_WAITING": str(MAX_WAITING)})
    yield srv
    srv.stop()


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def chat(content: str, **kw) -> bytes:
    return _json({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw})


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}


C, CH = "/v1/completions", "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
FOUR_MB = 4 << 20

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
    # still serving, and the chat template still renders for ordinary messages
    r = httpx.post(server.url + CH, content=chat("hi", temperature=0), headers={**JSON, **server.auth}, timeout=120)
    assert r.status_code == 200, r.text
    m = server.metrics()
    assert not [k for k, v in m.items() if k[0] == "realizar_request_errors_total" and v
                and dict(k[1]).get("status_code", "").startswith("5")], m


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
