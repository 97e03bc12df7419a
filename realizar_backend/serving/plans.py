"""Request bodies -> engine jobs: each route's body parsed, checked (requests.py), its constraint
(structured.py) or tools (tools.py) resolved, and every prompt tokenized and validated by the
engine, as a Plan the route runs. Blocking work: the routes call these on a worker thread
(`planned`): parsing, checking, compiling a grammar and tokenizing a body of megabytes take the
CPU for a while, never the event loop, and a client that leaves meanwhile stops the grammar
checks (the plan's `cancel` event).

A request's cost is bounded before anything is queued: its prompt tokens times its choices, and
its max_tokens times its choices, each at most Settings.max_request_tokens (0: the KV cache's
size), so that one request cannot hold the engine from every other client for minutes.

The exception: a completions body of at most INLINE_PLAN_BYTES that asks for no grammar is planned
on the event loop (`completion`). Its plan (a small JSON body, a prompt of token ids or a short
text for the GIL-free tokenizer) takes the loop less time than handing it to a worker thread and
back: under a burst of requests each such hand-off waits for the GIL behind every other request's
work (the interpreter's switch interval, milliseconds, at each of the two hops), and that wait is
spent before the request reaches the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass

from ..engine.guidance import Constraint
from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from . import requests as rq
from . import tokens
from .chat_request import ChatOptions, chat_options
from .reasoning import ReasoningFormat
from .requests import bad
from .structured import names_constraint, request_constraint
from .tools import ToolRequest, ToolStreamParser, parse_tool_request

INLINE_PLAN_BYTES = 8 << 10       # a completions body up to this size, without a grammar, is planned on the loop


@dataclass
class Plan:
    """A checked request, tokenized: one job (prompt ids, sampling) per sequence."""
    jobs: list[tuple[list[int], SamplingParams]]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: list[str] | None = None         # completions: per job, the text put before its output
    tools: ToolRequest | None = None      # chat: the tools the reply may call (None: plain text)
    n: int = 1                            # choices per prompt (jobs n at a time share a prompt)
    continuous_usage: bool = False        # streamed: every chunk carries usage so far
    reasoning: ReasoningFormat | None = None   # chat: the model thinks in this format
    thinking_inside: bool = False         # chat: the prompt left the model inside a thought

    @property
    def calls_tools(self) -> bool:
        return self.tools is not None and ToolStreamParser(self.tools).active

    def cached_tokens(self, per_job: list[int]) -> int:
        """usage.prompt_tokens_details.cached_tokens: each prompt counted once (as prompt_tokens
        counts it), by its first choice: how much of it the prefix cache held when it came."""
        return sum(per_job[::self.n])


async def planned(state, receive, fn, *args):
    """fn(*args, cancel) on a worker thread, watching the client meanwhile (`receive`: the
    request's ASGI receive, its body already read): when it disconnects, `cancel` is set, so that
    a grammar check in progress stops, and ClientGone is raised at once."""
    cancel = threading.Event()
    work = asyncio.ensure_future(state.offload(fn, *args, cancel))

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            cancel.set()
            # its answer (a 499 once the check stops) goes nowhere
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
    if not work.done():
        raise rq.ClientGone("the client left while its request was being checked; the checks stopped")
    return work.result()


async def completion(state, receive, raw: bytes, engine) -> Plan:
    """The completions route's plan: on the event loop when the body is small and names no
    grammar (INLINE_PLAN_BYTES), else on a worker thread (`planned`)."""
    if len(raw) > INLINE_PLAN_BYTES:
        return await planned(state, receive, completion_plan, raw, engine, state.settings)
    body = rq.parse_json(raw)
    if names_constraint(body.data):
        return await planned(state, receive, completion_body_plan, body, engine, state.settings)
    return completion_body_plan(body, engine, state.settings)


def completion_plan(raw: bytes, engine, settings, cancel: threading.Event | None = None) -> Plan:
    return completion_body_plan(rq.parse_json(raw), engine, settings, cancel)


def completion_body_plan(body: rq.Body, engine, settings, cancel: threading.Event | None = None) -> Plan:
    body.only(rq.COMPLETION_FIELDS)
    rq.check_model(body, engine)
    body.unsupported("suffix")
    rq.no_prompt_logprobs(body)
    prompts = rq.prompts(body)
    n = rq.choices(body, len(prompts), settings.max_waiting)
    body.unsupported("best_of", lambda v: v == n)
    stream = body.get("stream", "bool", False)
    include_usage, continuous = rq.stream_options(body, stream)
    logprobs = body.get("logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"logprobs: must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    echo = body.get("echo", "bool", False)
    params = rq.sampling(body, body.get("max_tokens", "int", 16), logprobs, settings.max_stop_chars)
    params.constraint = request_constraint(body.data, chat=False)
    echoes = [tokens.echo_text(engine, p, echo, logprobs) for p in prompts for _ in range(n)] if echo else None
    jobs, prompt_tokens = jobs_for(engine, params, prompts, n, None, limit=request_tokens(engine, settings),
                                   cancel=cancel)
    return Plan(jobs, prompt_tokens, stream, include_usage, logprobs is not None, echo=echoes, n=n,
                continuous_usage=continuous)


def chat_plan(raw: bytes, engine, settings, cancel: threading.Event | None = None) -> Plan:
    body = rq.parse_json(raw)
    body.only(rq.CHAT_FIELDS)
    rq.check_model(body, engine)
    for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "verbosity"):
        body.unsupported(name)
    body.unsupported("modalities", lambda v: v == ["text"])
    rq.no_prompt_logprobs(body)
    if not getattr(engine.tokenizer, "has_chat_template", True):
        raise bad("messages", "this model has no chat template; use /v1/completions")
    tool_req = parse_tool_request(body.data.get("tools"), body.data.get("tool_choice"),
                                  body.data.get("parallel_tool_calls"), engine.tokenizer.chat_template)
    messages = rq.messages(body)
    options = chat_options(body.data, engine.tokenizer)
    n = rq.choices(body, 1, settings.max_waiting)
    stream = body.get("stream", "bool", False)
    include_usage, continuous = rq.stream_options(body, stream)
    want_lp = body.get("logprobs", "bool", False)
    top = body.get("top_logprobs", "int")
    if top is not None and not want_lp:
        raise bad("top_logprobs", "top_logprobs: requires logprobs to be true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"top_logprobs: must be between 0 and {MAX_LOGPROBS}, got {top}")
    max_tokens = body.get("max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", "int")
    params = rq.sampling(body, max_tokens, (top or 0) if want_lp else None, settings.max_stop_chars)
    constraint = request_constraint(body.data, chat=True)
    jobs, prompt_tokens = chat_jobs(engine, params, messages, tool_req, constraint, n, options=options,
                                    limit=request_tokens(engine, settings), cancel=cancel)
    thinking = jobs[0][1].thinking          # prepare saw the prompt: is the model inside a thought?
    return Plan(jobs, prompt_tokens, stream, include_usage, want_lp, tools=tool_req, n=n, continuous_usage=continuous,
                reasoning=options.reasoning, thinking_inside=thinking is not None and thinking.inside)


def chat_jobs(engine, params: SamplingParams, messages: list[dict], tool_req: ToolRequest | None,
              constraint: Constraint | None, n: int = 1, cap_to_context: bool = False,
              options: ChatOptions | None = None, limit: int | None = None,
              cancel: threading.Event | None = None):
    """The jobs of a chat (every API's: chat completions, Responses, Anthropic's messages):
    messages as the chat template takes them, the tools it renders and whose calls the reply is
    held to, or a structured-output constraint (not both: the tools' grammar is the reply's),
    tokenized and validated by jobs_for. cap_to_context: params.max_tokens is an upper bound
    (Anthropic's and the Responses API's), cut to the room the context leaves after the prompt
    rather than refused. options: the template's kwargs and flags and the model's thought
    (chat_request.chat_options). limit: the request's cost bound (request_tokens); cancel: set when
    its client leaves (the grammar checks stop). Blocking: call it on a worker thread."""
    reasoning = options.reasoning if options is not None else None
    tool_constraint = tool_req.constraint(engine.guidance, reasoning) if tool_req is not None else None
    if tool_constraint is not None and constraint is not None:
        raise bad(constraint.param, f"{constraint.param}: cannot be combined with tools unless tool_choice is "
                                    f"\"none\"")
    params.constraint = tool_constraint or constraint
    if tool_constraint is not None:
        check_tool_schemas(engine, tool_req, cancel)
    if options is not None:
        params.thinking = options.thinking
    cap = params.max_tokens if cap_to_context else None
    if cap is not None:
        params.max_tokens = None          # prepare() fills in the room left
    jobs, prompt_tokens = jobs_for(engine, params, [None], n, messages,
                                   tool_req.template_tools if tool_req is not None else None, options,
                                   limit=limit, cancel=cancel)
    if cap is not None:
        for _, p in jobs:
            p.max_tokens = min(p.max_tokens, cap)
        asked = sum(p.max_tokens for _, p in jobs)
        if limit is not None and asked > limit:
            raise _too_costly("output tokens (max_tokens)", asked, 1, n, limit, "max_tokens")
    return jobs, prompt_tokens


def request_tokens(engine, settings) -> int:
    """The most tokens one request may ask of the engine (Settings.max_request_tokens)."""
    return settings.max_request_tokens or engine.kv_capacity


def _too_costly(what: str, total: int, prompts: int, n: int, limit: int, param: str):
    return bad("n" if n > 1 else param,
               f"this request asks for {total:,} {what} ({prompts} prompt(s) x {n} choice(s)); this server takes "
               f"at most {limit:,} per request (REALIZAR_MAX_REQUEST_TOKENS; 0 means the KV cache's size)",
               "request_tokens_exceeded")


def check_tool_schemas(engine, tool_req: ToolRequest, cancel: threading.Event | None) -> None:
    """Each function's parameters on their own, as the JSON object its arguments must be: a
    schema that no finite object satisfies (a required property that is the schema itself) is a
    400 naming that tool here, not a limit the reply runs into mid-call."""
    for i, fn in enumerate(tool_req.functions.values()):
        schema = fn.parameters if fn.parameters.get("type") is not None else {**fn.parameters, "type": "object"}
        engine.guidance.compile(Constraint("json_schema", schema, param=f"tools[{i}].function.parameters"), cancel)


def jobs_for(engine, base: SamplingParams, prompts, n: int, messages, tools=None, options: ChatOptions | None = None,
             limit: int | None = None, cancel: threading.Event | None = None):
    """Validate and tokenize every prompt once (blocking: tokenizing, template rendering and
    compiling the grammar run here, on a worker thread), then one job (sequence) per choice;
    seeded choices get seed + i so that n > 1 gives n different, reproducible samples.
    options: a chat's template kwargs and generation-prompt flags. limit: the request's cost
    bound (request_tokens), checked as the prompts are tokenized; the output side counts
    max_tokens only where the request gave it. cancel: set when the client leaves."""
    if limit is not None and base.max_tokens is not None and base.max_tokens * n * len(prompts) > limit:
        raise _too_costly("output tokens (max_tokens)", base.max_tokens * n * len(prompts), len(prompts), n, limit,
                          "max_tokens")
    jobs, prompt_tokens = [], 0
    chat = {} if options is None else dict(template_kwargs=options.template_kwargs,
                                           add_generation_prompt=options.add_generation_prompt,
                                           continue_final_message=options.continue_final_message)
    for prompt in prompts:
        params = dataclasses.replace(base)
        ids = engine.prepare(prompt, params, messages, tools, cancel=cancel, **chat)
        prompt_tokens += len(ids)
        if limit is not None and prompt_tokens * n > limit:
            raise _too_costly("prompt tokens", prompt_tokens * n, len(prompts), n, limit,
                              "messages" if messages is not None else "prompt")
        for i in range(n):
            p = dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)
            jobs.append((ids, p))
    return jobs, prompt_tokens


def tokenize(raw: bytes, engine) -> dict:
    body = rq.parse_json(raw)
    body.only(rq.TOKENIZE_FIELDS)
    messages = None
    if body.data.get("messages") is not None:
        if not getattr(engine.tokenizer, "has_chat_template", True):
            raise bad("messages", "this model has no chat template; tokenize a prompt")
        messages = rq.messages(body)
    return tokens.tokenize(engine, body.data, messages)


def detokenize(raw: bytes, engine) -> dict:
    body = rq.parse_json(raw)
    body.only(rq.DETOKENIZE_FIELDS)
    return tokens.detokenize(engine, body.data)
