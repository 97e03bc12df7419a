"""The HTTP connection's own limits, below the ASGI app.

BentoML runs uvicorn, which waits for a request's headers and body without a time limit (its
keep-alive timer stops at the first byte), keeps headers of any size in memory, and accepts
connections until the process has no file descriptor left, after which every client fails. The
routes cannot see any of that: the app is called once the headers are complete. So each worker's
uvicorn makes its connections with `guarded_protocol(...)`, uvicorn's own httptools protocol plus
these rules (Settings fields; docs/serving.md):

- headers: a request's headers (request line included) must arrive within `read_timeout_s` of
  the connection's start or the end of its previous response, and be at most `max_header_bytes`;
  else 408 or 431 and the connection closes (an idle connection that sent nothing just closes);
- body: the rest of a request's body must arrive within `read_timeout_s` of its headers; else 408
  and the connection closes (the route sees its client gone);
- connections: past `max_connections` open ones (0: the open-file limit less FD_RESERVE), a new
  connection closes the one that has waited longest for a request to arrive (a slow or idle
  client); when every connection is a request being served, the new one gets 503.
"""

from __future__ import annotations

import json
import logging
import resource
from typing import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..settings import Settings

log = logging.getLogger(__name__)

FD_RESERVE = 256             # descriptors kept for the worker's own files, pipes and engine process
MIN_CONNECTIONS = 16


def connection_limit(settings: Settings) -> int:
    """Open connections a worker keeps at most: the setting, or the open-file limit less FD_RESERVE."""
    if settings.max_connections:
        return settings.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(MIN_CONNECTIONS, soft - FD_RESERVE)


def _response(status: int, reason: bytes, message: str, code: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n"
            % (status, reason, len(body), extra) + body)


def guarded_protocol(settings: Settings, on_refused: Callable[[int], None] | None = None) -> type:
    """uvicorn's httptools protocol with this module's limits; on_refused(status) counts each
    request answered here (408, 431, 503)."""
    timeout = settings.read_timeout_s
    max_header = settings.max_header_bytes
    limit = connection_limit(settings)
    count = on_refused or (lambda status: None)

    class GuardedProtocol(HttpToolsProtocol):
        # per connection: since when it waits for a request to arrive whole (None: it has one,
        # being served), the bytes of the headers so far, and the timer of the current phase
        _waiting_since: float | None = None
        _header_bytes = 0
        _headers_done = False
        _messages = 0                 # requests received whole
        _timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._waiting_since = self.loop.time()
            self._arm(self._headers_late)
            if len(self.connections) > limit:
                self._make_room()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # the whole chunk counts as header bytes when it neither finished the headers nor
            # began another request (httptools holds a header's bytes until it is complete, so
            # what counts is what arrived, checked after each chunk: at most a chunk past the limit)
            in_headers, messages = not self._headers_done, self._messages
            super().data_received(data)
            if in_headers and not self._headers_done and messages == self._messages \
                    and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > max_header:
                    self._refuse(431, b"Request Header Fields Too Large",
                                 f"the request's headers exceed {max_header} bytes", "request_header_too_large")

        # ---------------------------------------------------------------- phases of a request
        def on_headers_complete(self) -> None:
            self._headers_done = True
            self._disarm()
            super().on_headers_complete()
            if any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers):
                self._arm(self._body_late)           # on_message_complete disarms it

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()
            self._waiting_since = None
            self._messages += 1
            self._headers_done, self._header_bytes = False, 0     # the next request's headers follow

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._waiting_since = self.loop.time()            # for the next request
                self._arm(self._headers_late)

        # ---------------------------------------------------------------- timers
        def _arm(self, fn) -> None:
            self._disarm()
            self._timer = self.loop.call_later(timeout, fn)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self._header_bytes:
                self._refuse(408, b"Request Timeout", f"the request's headers did not arrive within {timeout:g} s",
                             "request_timeout")
            else:                 # an idle connection: nothing to answer
                self.transport.close()

        def _body_late(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                self._refuse(408, b"Request Timeout", f"the request's body did not arrive within {timeout:g} s",
                             "request_timeout")
            else:
                self._drop()

        # ---------------------------------------------------------------- ending a connection
        def _refuse(self, status: int, reason: bytes, message: str, code: str, extra: bytes = b"") -> None:
            """Answer `status` in OpenAI's error shape and close; the route, if one runs, sees
            its client gone."""
            log.info("%s: %d, %s", "%s:%d" % self.client if self.client else "client", status, message)
            count(status)
            cycle = self.cycle
            if cycle is None or not cycle.response_started:
                self.transport.write(_response(status, reason, message, code, extra))
            self._drop()

        def _drop(self) -> None:
            self._disarm()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def _make_room(self) -> None:
            """Over the limit: close the connection that has waited longest for its request,
            or, when every other one is a request being served, refuse this one."""
            waiting = [c for c in self.connections if c is not self
                       and getattr(c, "_waiting_since", None) is not None and not c.transport.is_closing()]
            if waiting:
                oldest = min(waiting, key=lambda c: c._waiting_since)
                log.info("%d connections: closing the one that waited %.1f s for its request", len(self.connections),
                         self.loop.time() - oldest._waiting_since)
                oldest._drop()
            else:
                self._refuse(503, b"Service Unavailable", f"this worker serves {limit} connections already",
                             "server_overloaded", b"retry-after: 1\r\n")

    return GuardedProtocol


def install(server, settings: Settings, on_refused: Callable[[int], None] | None = None) -> None:
    """Make uvicorn `server` (a worker's, before or after it started listening: uvicorn makes
    each connection's protocol from its config when the connection arrives) use the limits."""
    server.config.http_protocol_class = guarded_protocol(settings, on_refused)
