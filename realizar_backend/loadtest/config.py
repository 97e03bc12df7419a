"""The load test's settings, one request's record and how a failure is named."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# Random prompt ids come from this range: above the special and byte tokens that open most
# vocabularies, below the specials some put at the end, and inside every common vocabulary.
PROMPT_ID_RANGE = (1000, 30000)
# Common English words: mostly one token each (with their leading space) in BPE vocabularies.
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education").split()
PROGRESS_EVERY_S = 5.0     # plain progress lines when stderr is not a terminal
CALIBRATION_ROUNDS = 4
CLIENTS_PER_PROCESS = 4    # streams per client process when --processes is 0
START_TIMEOUT_S = 120.0    # for client processes to start (import the client, connect)


@dataclass
class LoadtestConfig:
    url: str
    clients: int = 8
    requests: int = 64
    duration_s: float = 600.0
    prompt_tokens: int = 128
    max_tokens: int = 128
    model: str | None = None
    api_key: str | None = None
    mode: str = "completions"          # or "chat"
    random_cancel: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    processes: int = 0                 # client processes; 0: one per CLIENTS_PER_PROCESS clients

    def validate(self) -> None:
        for name in ("clients", "requests", "prompt_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.duration_s > 0:
            raise ValueError("--duration must be positive")
        if not 0.0 <= self.random_cancel <= 1.0:
            raise ValueError("--random-cancel must be a fraction between 0 and 1")
        if self.mode not in ("completions", "chat"):
            raise ValueError("--mode must be completions or chat")
        if self.processes < 0:
            raise ValueError("--processes must be 0 (automatic) or more")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"URL must start with http:// or https://, got {self.url!r}")

    @property
    def process_count(self) -> int:
        """Client processes: one asyncio loop reads many streams well, but a burst of new requests
        (streams ending together) costs it ~2 ms of request building each, so that later streams'
        ends are read late and the server idles between waves it did not make: hence CLIENTS_PER_PROCESS
        clients a process, the fewest that still keeps one process's loop busy."""
        n = self.processes or min(-(-self.clients // CLIENTS_PER_PROCESS), os.cpu_count() or 1)
        return max(1, min(n, self.clients, self.requests))

    @property
    def root(self) -> str:
        """The server's root (where /metrics lives); a URL given with /v1 works too."""
        url = self.url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass
class RequestResult:
    index: int
    status: str = "running"            # ok | cancelled | cut | error
    start: float = 0.0
    end: float | None = None
    ttft: float | None = None
    done: float | None = None          # when the stream's end ([DONE]) was read; `end` is after the close
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0                    # chunks that carried text
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    error: tuple[str, str] | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


class StreamError(Exception):
    """An error event inside a stream that had started (`data: {"error": {...}}`)."""

    def __init__(self, error):
        msg = error.get("message") if isinstance(error, dict) else None
        super().__init__(msg or str(error))


def error_key(e: BaseException) -> tuple[str, str]:
    """(key, message): HTTP errors by status, transport errors by the exception under them."""
    import openai
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}", e.message
    if isinstance(e, openai.APIConnectionError):        # APITimeoutError included
        cause = e.__cause__ or e.__context__
        return (type(cause).__name__, str(cause) or repr(cause)) if cause else (type(e).__name__, str(e))
    if isinstance(e, StreamError):
        return "error in stream", str(e)
    return type(e).__name__, str(e) or repr(e)
