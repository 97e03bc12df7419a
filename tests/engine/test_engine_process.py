"""The engine in a process of its own (engine/process.py), on the real SmolLM2 (NumPy backend): the
same streams as the engine on a thread, cancels that free blocks, typed errors across the pipe,
a dead engine process that fails its streams instead of hanging them (counted, its gauges zeroed),
a stopped one that never blocks its caller and is reported stuck, and servers whose engine process
dies (standing aside) or stops (probes answering, /livez saying so)."""

import asyncio
import itertools
import pickle
import threading
import time

import httpx
import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.engine.process import EngineClient
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.errors import CapacityError, ContextOverflowError, RequestError
from realizar_backend.settings import Settings
from support.server import start_server, wait_for

SETTINGS = Settings(backend="cpu", max_num_seqs=4, context_length=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def client():
    c = EngineClient.start(SETTINGS)
    yield c
    c.shutdown()


async def _stream(eng, prompt: str, request_id: str, **kw):
    params = SamplingParams(**kw)
    ids = eng.prepare(prompt, params)
    outs = [o async for o in eng.generate(ids, params, request_id=request_id)]
    return ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1].finish_reason,
            outs[-1].completion_tokens)


async def _long_stream(eng, request_id: str, at: int, then) -> int:
    """A 200-token stream; after `at` outputs, then() and True from it: leave the stream."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    n = 0
    async for _ in eng.generate(eng.prepare("Count slowly:", params), params, request_id=request_id):
        n += 1
        if n == at and then():
            break
    return n


async def _all(eng, **kw):
    return await asyncio.gather(*[_stream(eng, p, f"r{i}", **kw) for i, p in enumerate(PROMPTS)])


def test_streams_equal_the_engine_on_a_thread(client):
    remote = asyncio.run(_all(client, max_tokens=12, temperature=0))
    local_engine = Engine.from_settings(SETTINGS, prewarm_guidance=False)
    try:
        local = asyncio.run(_all(local_engine, max_tokens=12, temperature=0))
    finally:
        local_engine.shutdown()
    assert remote == local
    assert all(r[3] == 12 and r[2] == "length" for r in remote)


def test_seeded_sampling_and_stop_strings_cross_the_pipe(client):
    kw = dict(max_tokens=16, temperature=0.9, seed=7, stop=["\n"])
    a = asyncio.run(_stream(client, "Write a list:", "s1", **kw))
    b = asyncio.run(_stream(client, "Write a list:", "s2", **kw))
    assert a == b and "\n" not in a[0]


def test_a_stream_left_early_frees_its_blocks_and_the_gauges_follow(client):
    assert asyncio.run(_long_stream(client, "leaver", 3, lambda: True)) == 3
    wait_for(lambda: client.stats()["kv_used_blocks"] == 0 and client.stats()["running"] == 0, timeout=20)


def test_errors_keep_their_type_and_fields_across_processes(client):
    err = pickle.loads(pickle.dumps(ContextOverflowError("too long", param="prompt")))
    assert (type(err), err.status, err.param, err.code) == (ContextOverflowError, 400, "prompt",
                                                           "context_length_exceeded")
    assert pickle.loads(pickle.dumps(CapacityError("full", retry_after_s=7))).retry_after_s == 7
    # the client side checks a request before it reaches the engine, as the engine does
    with pytest.raises(ContextOverflowError):
        client.prepare("hello", SamplingParams(max_tokens=10_000))
    with pytest.raises(RequestError):
        client.prepare([10 ** 9], SamplingParams(max_tokens=4))


def test_after_finish_all_new_requests_get_a_retryable_capacity_error():
    c = EngineClient.start(SETTINGS)
    try:
        c.finish_all("shutdown")
        with pytest.raises(CapacityError) as e:
            asyncio.run(_stream(c, "Hello", "late", max_tokens=4, temperature=0))
        assert e.value.retry_after_s == 5
    finally:
        c.shutdown()


def test_a_dead_engine_process_fails_its_streams_promptly():
    c = EngineClient.start(SETTINGS)

    try:
        t0 = time.monotonic()
        with pytest.raises(CapacityError):
            asyncio.run(asyncio.wait_for(_long_stream(c, "victim", 2, lambda: c._proc.kill()), timeout=30))
        assert time.monotonic() - t0 < 30
        with pytest.raises(CapacityError):          # and later requests are refused at once
            asyncio.run(_stream(c, "Hello", "after", max_tokens=4, temperature=0))
    finally:
        c.shutdown()


def _engine_process(server):
    engines = server.engines()
    assert len(engines) == 1, [p.cmdline() for p in engines]
    return engines[0]


@pytest.mark.server
def test_a_server_whose_engine_process_dies_ends_its_streams_and_stands_aside():
    from support.server import sample

    server = start_server()
    try:
        engine = _engine_process(server)
        client = server.openai()
        streams = [client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Count slowly {i}:",
                                             max_tokens=200, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}) for i in range(4)]
        got, err = [[] for _ in streams], [[] for _ in streams]
        killed = threading.Event()

        def read(i):
            try:
                for chunk in streams[i]:
                    got[i].append(chunk)
                    if all(len(g) >= 2 for g in got) and not killed.is_set():
                        killed.set()
                        engine.kill()
            except Exception as e:          # the stream's end: an error event, or the connection closed
                err[i].append(e)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        for r in readers:
            r.start()
        for r in readers:
            r.join(60)
        assert not any(r.is_alive() for r in readers), "a stream hung after its engine died"
        for g, e in zip(got, err):
            # each stream ended early, without a finish_reason of a normal end, with an error event
            assert len(g) >= 2 and not any(c.choices and c.choices[0].finish_reason in ("length", "stop") for c in g)
            assert e and "engine process exited" in str(e[0]), e      # retryable
        # the killed sequences are counted as errors, and the gauges say nothing runs
        m = server.metrics()
        assert sample(m, "realizar_requests_total", finish_reason="error") == 4
        assert sample(m, "realizar_requests_running") == 0 and sample(m, "realizar_requests_waiting") == 0
        assert sample(m, "realizar_kv_cache_used_blocks") == 0
        assert wait_for(lambda: httpx.get(server.url + "/readyz", timeout=10).status_code == 503, 30)
        r = httpx.post(server.url + "/v1/completions", headers=server.auth,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"], r.text
        # its one engine is gone: the whole server is dead to an orchestrator
        assert wait_for(lambda: httpx.get(server.url + "/livez", timeout=10).status_code == 503, 30)
        assert server.worker_statuses() == {"1": "failed"}
        assert server.engine_statuses() == {"1": ("cpu", "dead")}
        assert "no engine can serve the model: BackendError: the engine process exited" in server.log_tail(400)
    finally:
        server.stop()


def _counter(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"engine": "1", "worker": "1", **labels}) or 0.0


def test_a_submit_with_nothing_ahead_is_in_the_pipe_when_generate_starts():
    """A request's submit goes into the pipe from the caller's own thread when nothing waits ahead
    of it (no wait for the writer thread to wake and take the GIL), even with the engine stopped
    and reading nothing; one the pipe cannot take whole is finished by the writer thread, in
    order, and every stream is whole once the engine reads again."""
    import os
    import signal as sig

    c = EngineClient.start(SETTINGS.replace(context_length=2048))
    try:
        # the writer thread's first ping is written and answered: nothing is ahead of the submit
        assert wait_for(lambda: c._pong >= 1 and not c._writing, timeout=10, interval=0.01)
        os.kill(c._proc.pid, sig.SIGSTOP)
        try:
            async def run():
                params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
                small = c.generate(c.prepare("The capital of France is", params), params, request_id="small")
                first = asyncio.ensure_future(small.__anext__())
                await asyncio.sleep(0)          # generate's start: the submit is sent
                assert not c._out and c._unsent_submits == 0
                # prompts of 1,000 tokens until one does not fit the pipe whole: its tail waits
                big = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
                gens, pending = [], []
                for i in range(200):
                    g = c.generate(list(range(100, 1100)), big, request_id=f"big{i}")
                    gens.append(g)
                    pending.append(asyncio.ensure_future(g.__anext__()))
                    await asyncio.sleep(0)
                    if c._out:
                        break
                assert c._out, "the pipe took 200 prompts of 1,000 tokens while nothing read it"
                # all but the split one leave (their aborts queue behind the submits)
                for p in pending[:-1]:
                    p.cancel()
                await asyncio.gather(*pending[:-1], return_exceptions=True)
                for g in gens[:-1]:
                    await g.aclose()
                return small, first, gens, pending
            loop = asyncio.new_event_loop()
            small, first, gens, pending = loop.run_until_complete(run())
        finally:
            os.kill(c._proc.pid, sig.SIGCONT)

        async def finish():
            outs = [await first] + [o async for o in small]
            assert sum(len(o.token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"
            # the one split between this thread and the writer arrived whole, as did what followed
            got = [await pending[-1]] + [o async for o in gens[-1]]
            assert sum(len(o.token_ids) for o in got) == 2 and got[-1].finish_reason == "length"
            again = [o async for o in c.generate(c.prepare("1, 2, 3,", params), params, request_id="again")]
            assert again[-1].finish_reason == "length"
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        loop.run_until_complete(asyncio.wait_for(finish(), 120))
        loop.close()
    finally:
        c.shutdown()


def test_a_stopped_engine_never_blocks_the_caller_and_says_it_is_stuck():
    """SIGSTOP the engine process while long prompts arrive: each submit returns at once (the
    event loop keeps running), submits past max_waiting that the pipe cannot take are refused
    with a retryable CapacityError, and stall() names the silence once it outlasts
    engine_stall_timeout_s; after SIGCONT the engine answers again and serves."""
    import os
    import signal as sig

    # short prefill steps: once resumed, the engine meets the cancels of the abandoned prompts
    # after a step of 256 tokens, not of 2048
    settings = SETTINGS.replace(max_waiting=4, engine_stall_timeout_s=2.0, context_length=8192,
                                prefill_chunk_tokens=256)
    c = EngineClient.start(settings)
    try:
        prompt = list(range(100, 8100))         # 8,000 tokens: a few fill the pipe
        params = SamplingParams(max_tokens=1, temperature=0)

        os.kill(c._proc.pid, sig.SIGSTOP)
        try:
            async def run():
                results = []
                async def one(i):
                    gen = c.generate(prompt, params, request_id=f"long{i}")
                    try:
                        async for _ in gen:
                            pass
                        results.append("done")
                    except CapacityError:
                        results.append("refused")
                    finally:
                        await gen.aclose()
                tasks = [asyncio.create_task(one(i)) for i in range(40)]
                # the loop runs on while the submits queue: a tick every 10 ms is never late
                worst = 0.0
                for _ in range(50):
                    t0 = time.perf_counter()
                    await asyncio.sleep(0.01)
                    worst = max(worst, time.perf_counter() - t0)
                refused = results.count("refused")
                assert worst < 0.1, worst
                assert 0 < refused == len(results), results     # the pipe and max_waiting hold the rest
                assert c.stall() is None            # not yet: under engine_stall_timeout_s
                assert wait_for(lambda: c.stall() is not None, timeout=10, interval=0.1)
                assert "has not answered" in c.stall()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            asyncio.run(run())
        finally:
            os.kill(c._proc.pid, sig.SIGCONT)
        assert wait_for(lambda: c.stall() is None, timeout=10, interval=0.1)

        attempts = itertools.count()

        def served():            # as a client does: retried while the engine works off the cancels
            try:
                return asyncio.run(_stream(c, "The capital of France is", f"after{next(attempts)}", max_tokens=4,
                                           temperature=0))[3] == 4
            except CapacityError:
                return False
        assert wait_for(served, timeout=120, interval=0.5)
    finally:
        c.shutdown()


def test_a_killed_engine_counts_its_sequences_as_errors_and_zeroes_its_gauges():
    from prometheus_client import CollectorRegistry

    from realizar_backend.serving.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry=registry)
    c = EngineClient.start(SETTINGS, observer=metrics.engine(1))
    try:
        async def four():
            running = []

            def kill_when_all_run():
                running.append(1)
                if len(running) == 4:              # every stream has had 3 outputs
                    c._proc.kill()
                return False

            return await asyncio.gather(*[_long_stream(c, f"k{i}", 3, kill_when_all_run) for i in range(4)],
                                        return_exceptions=True)

        mine = {"engine": "1", "worker": "1"}
        wait_for(lambda: registry.get_sample_value("realizar_requests_running", mine) is not None, 10)
        outcomes = asyncio.run(asyncio.wait_for(four(), timeout=60))
        assert all(isinstance(o, CapacityError) for o in outcomes), outcomes
        assert _counter(registry, "realizar_requests_total", finish_reason="error") == 4
        assert _counter(registry, "realizar_generation_tokens_total") >= 4 * 3
        for gauge in ("realizar_requests_running", "realizar_requests_waiting", "realizar_kv_cache_used_blocks"):
            assert registry.get_sample_value(gauge, mine) == 0, gauge
    finally:
        c.shutdown()


@pytest.mark.server
def test_a_stopped_engine_process_stalls_no_probe_and_livez_says_it_is_stuck():
    """SIGSTOP the engine process for 20 s while 60 requests with 8,000-token prompts arrive:
    /livez answers within 100 ms throughout (503 once the engine has been silent for
    REALIZAR_ENGINE_STALL_TIMEOUT_S, 200 again after SIGCONT), /readyz and /metrics answer, and
    every request gets an answer: 503 with Retry-After for those the engine cannot take."""
    import os
    import signal

    from support.server import LivezProbe, sample, warm

    stall_s, stop_s = 3, 20
    server = start_server({"REALIZAR_CONTEXT_LENGTH": "8192", "REALIZAR_ENGINE_STALL_TIMEOUT_S": str(stall_s),
                           "REALIZAR_PREFILL_CHUNK_TOKENS": "256"})      # resumed, it meets the cancels soon
    try:
        engine = _engine_process(server)
        warm(server)
        body = {"model": "SmolLM2-135M-Instruct", "prompt": list(range(1000, 9000)), "max_tokens": 1}
        answers = []

        def post():
            # the client gives up before the engine resumes, so that its prompt is not computed
            try:
                r = httpx.post(server.url + "/v1/completions", json=body, headers=server.auth, timeout=stop_s - 6)
                answers.append((r.status_code, r.headers.get("retry-after")))
            except httpx.TimeoutException:
                answers.append(("timeout", None))

        with LivezProbe(server.url) as probe:
            os.kill(engine.pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                clients = [threading.Thread(target=post) for _ in range(60)]
                for c in clients:
                    c.start()
                    time.sleep(0.05)
                slow = []
                while time.monotonic() - t_stop < stop_s:
                    for path in ("/readyz", "/metrics"):
                        t0 = time.monotonic()
                        httpx.get(server.url + path, timeout=10)
                        slow.append((path, time.monotonic() - t0))
                    time.sleep(0.5)
                for c in clients:
                    c.join(30)
                assert httpx.get(server.url + "/readyz", timeout=10).status_code == 503
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            assert wait_for(lambda: httpx.get(server.url + "/livez", timeout=10).status_code == 200, 10)
        # within 100 ms throughout; on a shared machine a probe process may miss its core now and
        # then, but never for the seconds a blocked event loop would cost
        assert len(probe.late(0.1)) <= len(probe.samples) // 100 and probe.worst() < 1.0, probe.late(0.1)
        assert probe.statuses() == {"200", "503"}
        # every request was answered (none hung); those refused can retry
        assert len(answers) == 60 and all(s in (503, "timeout") for s, _ in answers), answers
        refused = [ra for s, ra in answers if s == 503]
        assert len(refused) >= 10 and all(ra and int(ra) >= 1 for ra in refused), answers
        assert max(t for _, t in slow) < 1.0, slow
        assert wait_for(lambda: httpx.get(server.url + "/readyz", timeout=10).status_code == 200, 10)
        m = lambda: server.metrics()
        assert wait_for(lambda: sample(m(), "realizar_requests_running") + sample(m(), "realizar_requests_waiting")
                        == 0, 120)
        assert "every engine is stuck" in server.log_tail(400)
    finally:
        server.stop()
