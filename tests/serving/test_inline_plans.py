"""Which completions requests are planned on the event loop (plans.completion): a small body that
asks for no grammar is planned at once, even while every request worker thread is busy (as under a
burst of requests, where the hand-off to a thread and back is the wait); a body with a grammar, or
larger than INLINE_PLAN_BYTES, still goes to a worker thread. Either way the plan and the errors
are those of completion_plan. The real SmolLM2 engine (NumPy backend) prepares the prompts."""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.errors import RequestError
from realizar_backend.serving import plans
from realizar_backend.serving.state import ServerState
from realizar_backend.settings import Settings


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_settings(Settings(backend="cpu", max_num_seqs=8, context_length=512))
    yield eng
    eng.shutdown()


async def _connected():
    """An ASGI receive whose client stays connected."""
    await asyncio.Event().wait()


def _plan_while_threads_busy(engine, body: dict, wait_s: float = 2.0):
    """(plan or exception, whether it came while the state's one worker thread was held busy)."""
    state = ServerState(settings=engine.settings, engine=engine, work=ThreadPoolExecutor(1, "busy-request"))
    hold = threading.Event()
    state.work.submit(hold.wait)
    raw = json.dumps(body).encode()

    async def go():
        task = asyncio.ensure_future(plans.completion(state, _connected, raw, engine))
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        hold.set()
        try:
            return await task, bool(done)
        except Exception as e:
            return e, bool(done)
    try:
        return asyncio.run(go())
    finally:
        hold.set()
        state.work.shutdown()


def _jobs(plan):
    return [(ids, p.max_tokens, p.temperature, p.seed, p.stop) for ids, p in plan.jobs]


def test_small_body_is_planned_without_a_worker_thread(engine):
    body = {"model": engine.model_name, "prompt": list(range(1000, 1128)), "max_tokens": 16, "stream": True,
            "seed": 3, "n": 2}
    plan, at_once = _plan_while_threads_busy(engine, body)
    assert at_once, "a small completions body waited for a worker thread"
    threaded = plans.completion_plan(json.dumps(body).encode(), engine, engine.settings)
    assert _jobs(plan) == _jobs(threaded) and len(plan.jobs) == 2 and plan.prompt_tokens == threaded.prompt_tokens == 128
    assert plan.stream and plan.n == 2

    text = {"model": engine.model_name, "prompt": "Tell me about the sea.", "max_tokens": 8}
    plan, at_once = _plan_while_threads_busy(engine, text)
    assert at_once
    assert _jobs(plan) == _jobs(plans.completion_plan(json.dumps(text).encode(), engine, engine.settings))


def test_small_body_errors_are_the_routes_own(engine):
    err, at_once = _plan_while_threads_busy(engine, {"model": engine.model_name, "prompt": [1, 2], "max_tokens": -1})
    assert at_once and isinstance(err, RequestError) and err.status == 400 and err.param == "max_tokens"
    err, at_once = _plan_while_threads_busy(engine, {"model": engine.model_name, "prompt": [10 ** 9]})
    assert at_once and isinstance(err, RequestError) and err.param == "prompt"


@pytest.mark.parametrize("body", [
    {"prompt": "Answer yes or no:", "max_tokens": 4, "guided_regex": "(yes|no)"},
    {"prompt": "Hello", "max_tokens": 4, "user": "u" * plans.INLINE_PLAN_BYTES},
], ids=["grammar", "large"])
def test_grammar_or_large_body_goes_to_a_worker_thread(engine, body):
    body = {"model": engine.model_name, **body}
    plan, at_once = _plan_while_threads_busy(engine, body, wait_s=0.5)
    assert not at_once, "a body that may block was planned on the event loop"
    assert isinstance(plan, plans.Plan)
    assert _jobs(plan) == _jobs(plans.completion_plan(json.dumps(body).encode(), engine, engine.settings))
