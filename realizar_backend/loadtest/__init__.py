"""`realizar loadtest URL`: many concurrent streaming OpenAI clients against a running server.

Works against this package's server and any OpenAI-compatible one (llama-server, vLLM). Each of
`clients` workers sends streaming requests one after another until `requests` have been sent or
`duration` has passed; streams still open at the time limit are closed and reported as cut.

Prompts are fixed in length and different for every request of a run (so a prefix cache cannot
turn the run into a replay; a second run with the same --seed repeats the first one's prompts,
which the report's prefix-cache hits then show): in completions mode, random token ids sent as a token-id prompt, exact on
every server that accepts them; in chat mode, random common words, their number sized once
against the server's own count (`usage.prompt_tokens` of a few one-token requests), because chat
messages are text and the OpenAI API has no tokenize route. Outputs are greedy, `max_tokens` long,
with `ignore_eos` so that every request generates the same number of tokens.

Requests go through the official `openai` async client (URL, auth, error statuses), and the
stream is read as raw server-sent events, which keeps one client process fast enough to measure
tens of thousands of tokens per second. The clients are spread over processes of 4 (`--processes`),
because building a request through the official client costs ~2 ms: one process would send a wave
of new requests late. Timing is taken on the client per streamed chunk that
carries text: time to first token, the gaps between chunks (inter-token latency), per-request time
per output token and end-to-end latency.
Tokens are counted from the usage chunk (`stream_options.include_usage`) when the server sends one,
else by chunks. The server's gauges (running, waiting, KV usage, ...) are read from /metrics before
and after, with counter deltas, when the server has them.
"""

from __future__ import annotations

from .config import CLIENTS_PER_PROCESS, LoadtestConfig
from .report import format_report
from .run import run_loadtest

__all__ = ["CLIENTS_PER_PROCESS", "LoadtestConfig", "format_report", "run_loadtest"]
