"""A real `bentoml serve` against clients that send their requests slowly, partly or hugely, over
raw sockets (serving/connections.py): headers or a body that never finish get 408 and the
connection closes, oversized headers get 431 before they are held, and more half-sent connections
than the worker has file descriptors for do not keep a real client out."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from support.server import LivezProbe, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

READ_TIMEOUT_S = 2
NOFILE = 512                 # the server's open-file limit: its default connection limit is 256
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = start_server({"REALIZAR_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}, nofile=NOFILE)
    yield s
    s.stop()


def _connect(server) -> socket.socket:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _response(sock: socket.socket, timeout: float) -> tuple[int | None, bytes, bool]:
    """(status, body, closed): what the server sends until it closes the connection or `timeout`."""
    sock.settimeout(timeout)
    data, closed = b"", False
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            data += chunk
    except socket.timeout:
        pass
    except ConnectionResetError:
        closed = True
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None
    return status, body, closed


def _post_head(server, length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_headers_that_never_finish_get_408_and_the_connection_closes(server):
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        t0 = time.monotonic()
        status, body, closed = _response(s, READ_TIMEOUT_S + 10)
        waited = time.monotonic() - t0
    assert status == 408 and closed, (status, body)
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert READ_TIMEOUT_S - 0.5 <= waited <= READ_TIMEOUT_S + 3


def test_a_body_shorter_than_its_content_length_gets_408(server):
    with _connect(server) as s:
        s.sendall(_post_head(server, 100) + b'{"model": ')
        t0 = time.monotonic()
        status, body, closed = _response(s, READ_TIMEOUT_S + 10)
        waited = time.monotonic() - t0
    assert status == 408 and closed, (status, body)
    assert "body did not arrive" in json.loads(body)["error"]["message"]
    assert READ_TIMEOUT_S - 0.5 <= waited <= READ_TIMEOUT_S + 3


def test_huge_headers_get_431_before_they_are_read(server):
    """A 96 MiB header: the server answers 431 once the headers pass 64 KiB and closes, so the
    client cannot send more than a little of it."""
    piece = 64 << 10
    sent, status, body = 0, None, b""
    with _connect(server) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Big: ")
        try:
            while sent < 96 << 20:
                s.sendall(b"a" * piece)
                sent += piece
                if select.select([s], [], [], 0.02)[0]:      # the server answered: read it
                    status, body, _ = _response(s, 10)
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent <= 4 << 20, f"the server read {sent >> 20} MiB of headers"
    assert status == 431, (status, body)
    assert json.loads(body)["error"]["code"] == "request_header_too_large"


def test_more_half_sent_requests_than_file_descriptors_do_not_keep_a_client_out(server):
    """Past its connection limit the worker closes the connections that waited longest for their
    requests: a real client is still served, and /livez answers at once throughout."""
    attackers = []
    try:
        with LivezProbe(server.url) as probe:
            for _ in range(NOFILE + 100):
                s = _connect(server)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
                attackers.append(s)
            r = httpx.post(server.url + "/v1/completions", headers=server.auth, timeout=60,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        assert probe.statuses() == {"200"} and probe.worst() < 0.1, probe.samples[-5:]
    finally:
        for s in attackers:
            s.close()
