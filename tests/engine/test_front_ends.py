"""Several front ends (BentoML workers on one port) in front of the same engine processes
(engine/shared.py; Settings.front_ends).

The rule for how many, and the load board the engines keep for the router, are plain logic. Two
front ends in this process on two shared engines: each routes by the engines' whole load (its own
requests and the other's), a request id used by both stays two requests, each sequence's end is
counted once (by the front end the engine reports to), and when that one leaves the other takes
over from the last report; an engine that stops answering stands aside in both. Then a real `bentoml serve` with two CPU engines and two front ends: requests through the one port are
served by both front ends and both engines, and /metrics counts each engine's work once (it adds
up to what was sent); streamed greedy text equals a one-engine server's; a front end killed is
started again by BentoML while the other serves, and connects again to the same engines; an engine
killed leaves the other serving in every front end; a server none of whose engines can load the
model says so in one line and exits 1; a SIGKILLed server takes its engines with it."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import json
import os
import signal
import time

import httpx
import pytest

from support.server import count_to, counted_burst, sample, start_server, wait_for

from realizar_backend.engine.group import PREFIX_TOKENS, EngineGroup
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.engine.shared import PREFIX_MEMORY, SLOTS, EngineHost, KVState, LoadBoard, PrefixTable
from realizar_backend.errors import SettingsError
from realizar_backend.settings import Settings, serve_front_ends

MODEL = "SmolLM2-135M-Instruct"
SETTINGS = Settings(backend="cpu", max_num_seqs=4, context_length=512)
ENV = {"REALIZAR_WORKERS": "2", "REALIZAR_FRONT_ENDS": "2"}


# ------------------------------------------------------------------------------ the rule, the board

def test_one_front_end_per_two_engines_unless_set():
    assert [serve_front_ends(Settings(), n, gpu=True) for n in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert [serve_front_ends(Settings(), n, gpu=False) for n in (1, 2, 4)] == [1, 1, 1]
    assert serve_front_ends(Settings(front_ends=3), 1, gpu=True) == 3
    assert Settings.from_env({"REALIZAR_FRONT_ENDS": "2"}).front_ends == 2
    with pytest.raises(SettingsError, match="REALIZAR_FRONT_ENDS"):
        Settings.from_env({"REALIZAR_FRONT_ENDS": "-1"})


def test_the_load_board_gives_each_front_end_the_others_load(tmp_path):
    path = str(tmp_path / "engine-1.load")
    LoadBoard.create(path)
    engine, reader = LoadBoard(path, writable=True), LoadBoard(path)
    try:
        engine.add(0, 1, 100)
        engine.add(1, 2, 30)
        engine.add(SLOTS - 1, 1, 5)
        assert reader.others(0) == (3, 35) and reader.others(1) == (2, 105) and reader.others(None) == (4, 135)
        engine.add(1, -1, -10)
        engine.clear(0)
        assert reader.others(SLOTS - 1) == (1, 20)
        # the engine's KV state, as its reports say it, for every front end
        assert reader.kv() is None
        before = time.monotonic()
        engine.set_kv({"kv_used_blocks": 60, "kv_total_blocks": 64, "kv_waiting_blocks": 15})
        state = reader.kv()
        assert state[:3] == (60, 64, 15) and before <= state.reported_at <= time.monotonic()
        assert reader.others(SLOTS - 1) == (1, 20)              # the slots are untouched
    finally:
        engine.close()
        reader.close()


def test_the_prefix_table_is_one_for_every_front_end_and_bounded(tmp_path):
    path = str(tmp_path / "prefixes")
    PrefixTable.create(path)
    a, b = PrefixTable.open(path), PrefixTable.open(path)
    try:
        heads = [tuple(range(k, k + PREFIX_TOKENS)) for k in range(3)]
        assert a.get(heads[0]) is None
        a.put(heads[0], 1)
        b.put(heads[1], 0)
        assert (b.get(heads[0]), a.get(heads[1]), a.get(heads[2])) == (1, 0, None)
        a.put(heads[0], 0)                                   # the head went elsewhere: the last word stands
        assert b.get(heads[0]) == 0
        # bounded: as many heads as entries and more leave the file its size, and each lookup
        # names the engine last put or none (a head displaced by another that shares its entry)
        many = [tuple(range(10_000 + k, 10_000 + k + PREFIX_TOKENS)) for k in range(2 * PREFIX_MEMORY)]
        for k, head in enumerate(many):
            a.put(head, k % 3)
        assert os.path.getsize(path) == PREFIX_MEMORY * 8
        found = [b.get(head) for head in many]
        assert all(f is None or f == k % 3 for k, f in enumerate(found))
        assert sum(f is not None for f in found[-PREFIX_MEMORY:]) > PREFIX_MEMORY // 2
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------ two front ends in this process

class _Recorder:
    """An engine observer that keeps what it is told (metrics.EngineMetrics' protocol)."""

    def __init__(self):
        self.steps, self.finished, self.primed = [], [], []

    def on_step(self, stats):
        self.steps.append(stats)

    def on_request_finished(self, *args):
        self.finished.append(args)

    def on_token_interval(self, seconds):
        pass

    def prime(self, stats):
        self.primed.append(stats)


async def _hold(eng, prompt, rid: str, release: asyncio.Event, started: asyncio.Event) -> str:
    """A long greedy stream that stops once `release` is set; returns its text."""
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    text = []
    async for out in eng.generate(eng.prepare(prompt, params), params, request_id=rid):
        text.append(out.text)
        started.set()
        if release.is_set():
            break
    return "".join(text)


@pytest.mark.slow
def test_two_front_ends_share_two_engines_route_by_their_whole_load_and_hand_over_the_metrics():
    host = EngineHost.start(SETTINGS, [None, None])
    obs1 = [_Recorder(), _Recorder()]
    obs2 = [_Recorder(), _Recorder()]
    g1 = EngineGroup.start(SETTINGS, [None, None], observer_of=lambda i: obs1[i - 1], shared=host.directory)
    g2 = EngineGroup.start(SETTINGS, [None, None], observer_of=lambda i: obs2[i - 1], shared=host.directory)
    try:
        # the first to connect writes each engine's series; the other does not
        assert g1.reports() == [True, True] and g2.reports() == [False, False]
        assert {m.slot for m in g1.members} == {0} and {m.slot for m in g2.members} == {1}

        async def run():
            release = asyncio.Event()
            # front end 1 puts two streams on the engines; front end 2 then sees them
            s1 = [asyncio.Event() for _ in range(2)]
            t1 = [asyncio.create_task(_hold(g1, f"Count to {i}:", "same-id" if i == 0 else "x", release, s1[i]))
                  for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in s1)), 120)
            assert g1.inflight() == [1, 1]
            assert wait_for(lambda: [g2._load(i)[0] for i in range(2)] == [1, 1], 10)
            # front end 2 uses the same request id: its own stream, routed by the whole load
            s2 = [asyncio.Event() for _ in range(2)]
            t2 = [asyncio.create_task(_hold(g2, f"Count to {i}:", "same-id" if i == 0 else "y", release, s2[i]))
                  for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in s2)), 120)
            assert g2.inflight() == [1, 1], g2.inflight()     # not both on one engine: each has front end 1's
            release.set()
            return await asyncio.gather(*t1), await asyncio.gather(*t2)

        texts1, texts2 = asyncio.run(run())
        # greedy text per prompt, whichever front end and engine ran it (cut where each stopped)
        for a, b in zip(texts1, texts2):
            n = min(len(a), len(b))
            assert n > 0 and a[:n] == b[:n]
        assert wait_for(lambda: [g2._load(i) for i in range(2)] == [(0, 0), (0, 0)], 10)
        # a prompt head front end 1 sent goes to the same engine through front end 2, although
        # by front end 2's own counts the other engine is the less busy (route alone: nothing sent)
        head = list(range(3000, 3000 + PREFIX_TOKENS))
        assert wait_for(lambda: [g1._load(i) for i in range(2)] == [(0, 0), (0, 0)], 10)
        assert g1.route(head + [1]) == 0
        assert g2.route([5]) == 0
        assert g2.route(head + [2]) == 0 and g2.inflight() == [2, 0]
        g1.release(0, PREFIX_TOKENS + 1)
        g2.release(0, 1)
        g2.release(0, PREFIX_TOKENS + 1)
        # the KV state each front end reads is the engine's, reported or not to it
        assert all(isinstance(g.members[i].kv_state(), KVState) for g in (g1, g2) for i in range(2))
        # each sequence's end reached the reporting front end only
        assert wait_for(lambda: sum(len(o.finished) for o in obs1) == 4, 10)
        assert sum(len(o.finished) for o in obs2) == 0 and not any(o.steps for o in obs2)

        # front end 1 leaves: front end 2 takes over the series, from the last report front end 1 got
        g1.shutdown()
        g2.stats()                               # asks each engine for a report
        assert wait_for(lambda: g2.reports() == [True, True], 10)
        assert all(o.primed for o in obs2) and all(o.steps for o in obs2)
        assert asyncio.run(_text(g2, "Hi", "after", max_tokens=3, temperature=0))
    finally:
        g2.shutdown()
        host.stop()


@pytest.mark.slow
def test_a_stuck_shared_engine_stands_aside_in_every_front_end():
    settings = SETTINGS.replace(engine_stall_timeout_s=2.0)
    host = EngineHost.start(settings, [None, None])
    groups = []
    try:
        groups = [EngineGroup.start(settings, [None, None], shared=host.directory) for _ in range(2)]
        host.procs[1].send_signal(signal.SIGSTOP)          # engine 2 stops answering
        assert wait_for(lambda: all([s for _, s in g.engine_statuses()] == ["ready", "stuck"] for g in groups), 20)
        for g in groups:                                   # every request goes to engine 1 meanwhile
            assert [g.route(list(range(10))) for _ in range(3)] == [0, 0, 0]
            for _ in range(3):
                g.release(0, 10)
            assert asyncio.run(_text(g, "Hi", "while-stuck", max_tokens=2, temperature=0))
        host.procs[1].send_signal(signal.SIGCONT)
        assert wait_for(lambda: all([s for _, s in g.engine_statuses()] == ["ready", "ready"] for g in groups), 20)
    finally:
        host.procs[1].send_signal(signal.SIGCONT)
        for g in groups:
            g.shutdown()
        host.stop()


async def _text(eng, prompt, rid: str, **kw) -> str:
    params = SamplingParams(**kw)
    ids = eng.prepare(prompt, params)
    return "".join([o.text async for o in eng.generate(ids, params, request_id=rid)])


# ------------------------------------------------------------------------------ a real server

def _children(server, marker: str) -> list:
    import psutil
    return [p for p in psutil.Process(server.proc.pid).children()
            if any(marker in part for part in p.cmdline())]


def _workers(server) -> list:
    return _children(server, "_bentoml_impl.worker")


def _engines(server) -> list:
    return sorted(_children(server, "realizar_backend.engine.shared"), key=lambda p: int(p.cmdline()[-1]))


def _complete_retrying(server, i: int) -> dict:
    for _ in range(60):
        r = httpx.post(server.url + "/v1/completions", headers=server.auth,
                       json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0},
                       timeout=120)
        if r.status_code != 503:
            break
        assert "Retry-After" in r.headers and r.json()["error"]["code"] == "model_not_ready", r.text
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _streamed(server, prompt: str) -> str:
    text = []
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.auth, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(text)


FRONTS_KV_TOKENS = 1024          # 64 blocks an engine: four long requests fill one


@pytest.fixture(scope="module")
def fronts():
    s = start_server({**ENV, "REALIZAR_KV_CACHE_TOKENS": str(FRONTS_KV_TOKENS)})
    yield s
    s.stop()


@pytest.mark.server
@pytest.mark.slow
def test_both_front_ends_and_both_engines_serve_and_metrics_count_once(fronts):
    server = fronts
    assert len(_workers(server)) == 2 and len(_engines(server)) == 2
    assert wait_for(lambda: server.worker_statuses() == {"1": "ready", "2": "ready"}, 30), server.log_tail()
    assert wait_for(lambda: server.engine_statuses() == {"1": ("cpu", "ready"), "2": ("cpu", "ready")}, 30)
    # each sequence's end is written once (by the front end its engine reports to)
    usages, delta = counted_burst(server, 24, settle_s=0.5)
    after = delta.after
    per = delta.finished_by_engine()
    assert min(per) >= len(usages) // 4, per
    # each engine's series are written by one front end: one series each, not one per front end
    for e in ("1", "2"):
        for name in ("realizar_engine_steps_total", "realizar_requests_running", "realizar_requests_total"):
            writers = {dict(k[1])["worker"] for k in after if k[0] == name and dict(k[1])["engine"] == e}
            assert len(writers) == 1, (name, e, writers)
        statuses = [k for k, v in after.items() if k[0] == "realizar_engine_status" and v == 1.0
                    and dict(k[1])["engine"] == e]
        assert len(statuses) == 1, statuses
    # both front ends took requests from the one port (BentoML's access log names the worker)
    log = server.log_tail(2000)
    for w in ("1", "2"):
        assert any(f"[:{w}]" in line and "path=/v1/completions" in line for line in log.splitlines()), w


@pytest.mark.server
@pytest.mark.slow
def test_streamed_greedy_text_equals_one_engine_servers(fronts, server):
    prompts = [f"Write a word about {t}:" for t in ("rain", "bread", "the sea", "winter")]
    with cf.ThreadPoolExecutor(4) as pool:
        mine = list(pool.map(lambda p: _streamed(fronts, p), prompts))
    assert mine == [_streamed(server, p) for p in prompts]
    assert all(mine)


def _served_by_engine(metrics) -> dict[str, float]:
    """Requests each engine has finished (their length or a stop), as /metrics says."""
    return {e: sum(sample(metrics, "realizar_requests_total", engine=e, finish_reason=r)
                   for r in ("length", "stop")) for e in ("1", "2")}


def _completions_per_worker(server) -> dict[str, int]:
    lines = server.log_path.read_text(errors="replace").splitlines()
    return {w: sum(1 for line in lines if f"[:{w}]" in line and "path=/v1/completions" in line) for w in ("1", "2")}


# a prompt head of more than PREFIX_TOKENS tokens, the same for every request that starts with it
_HEAD = "Here is the preamble every question shares: the lighthouse, the sea, the keeper and his log. " * 4


def _stream_until(server, prompt: str, stop, max_tokens: int = 260) -> None:
    """A greedy stream that the client leaves once `stop` is set (its request is aborted)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.auth, json=body, timeout=300) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            if stop.is_set():
                break


def _in_flight(server, engine: str) -> float:
    """Requests running or waiting (a preempted one waits again) on an engine, as /metrics says."""
    m = server.metrics()
    return sample(m, "realizar_requests_running", engine=engine) + sample(m, "realizar_requests_waiting", engine=engine)


@pytest.mark.server
@pytest.mark.slow
def test_requests_sharing_a_prefix_go_to_one_engine_through_every_front_end(fronts):
    """A head's first request goes to engine 1 while it is the busier one (a long stream on each
    engine, then engine 2's ends): so a front end that did not know the head would send it to
    engine 2, the less busy. Every later request with that head, through whichever front end,
    goes to engine 1."""
    import threading

    server = fronts
    stops = [threading.Event(), threading.Event()]

    def ask(i: int) -> None:
        r = httpx.post(server.url + "/v1/completions", headers=server.auth, timeout=120,
                       json={"model": MODEL, "prompt": f"{_HEAD}Question {i}: what comes after {i}?",
                             "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > PREFIX_TOKENS

    with cf.ThreadPoolExecutor(2) as streams:
        busy = []
        try:
            for k, want in enumerate([(1, 0), (1, 1)]):  # one after the other: the idle one each time
                busy.append(streams.submit(_stream_until, server, f"Count to {k}00:", stops[k], 500))
                assert wait_for(lambda: (_in_flight(server, "1"), _in_flight(server, "2")) == want, 60)
            ask(0)                           # a tie: engine 1, which holds the head from now on
            stops[1].set()
            busy[1].result()
            assert wait_for(lambda: _in_flight(server, "2") == 0, 30)
            before, calls = server.metrics(), _completions_per_worker(server)
            # three at a time: engine 1 stays within PREFIX_SLACK of the idle engine 2
            with cf.ThreadPoolExecutor(3) as pool:
                list(pool.map(ask, range(1, 5)))
                assert not busy[0].done()                # engine 1 was the busier all along
                stops[0].set()                           # (its abort is not counted as served)
                busy[0].result()
                list(pool.map(ask, range(5, 17)))
        finally:
            for stop in stops:
                stop.set()
        for f in busy:
            f.result()
    assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 60)
    time.sleep(0.5)
    after, calls_after = server.metrics(), _completions_per_worker(server)
    served = {e: n - _served_by_engine(before)[e] for e, n in _served_by_engine(after).items()}
    assert served == {"1": 16, "2": 0}, served
    # through both front ends (the kernel hands each connection to one of them)
    assert all(calls_after[w] > calls[w] for w in ("1", "2")), (calls, calls_after)
    # and engine 1's prefix cache served the shared head
    hits = sample(after, "realizar_prefix_cache_hit_tokens_total") - sample(before, "realizar_prefix_cache_hit_tokens_total")
    assert hits >= 16 * PREFIX_TOKENS, hits


@pytest.mark.server
@pytest.mark.slow
def test_an_engine_with_its_kv_pool_full_gets_no_new_request_while_the_other_has_room(fronts):
    """Four long requests of one prompt head (240 prompt tokens, 260 generated) fill one engine's
    64-block pool (they go where their head is, through either front end) until it preempts;
    short requests sent meanwhile all go to the other engine,
    although by requests in flight the full one would get some (4 there, 0 here, eight sent)."""
    import threading

    server = fronts
    stop = threading.Event()

    def fill(i: int) -> None:
        _stream_until(server, f"{_HEAD}Now count from {i} upwards, slowly: " + f"{i} " * 73, stop)

    running = functools.partial(_in_flight, server)

    with cf.ThreadPoolExecutor(4) as fillers:
        first = fillers.submit(fill, 0)
        try:
            assert wait_for(lambda: running("1") + running("2") >= 1, 60), server.log_tail()
            full = "1" if running("1") else "2"
            rest = []
            for i in range(1, 4):            # one at a time: none waits for blocks while the next is routed
                rest.append(fillers.submit(fill, i))
                assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running", engine=full) == i + 1,
                                60), server.log_tail()
            assert wait_for(lambda: sample(server.metrics(), "realizar_kv_cache_usage_ratio", engine=full)
                            >= 1 - 1 / 16, 120), server.log_tail()
            other = "2" if full == "1" else "1"
            assert running(full) == 4 and running(other) == 0
            before = server.metrics()

            def short(i: int) -> None:           # long enough that they are in flight together
                r = httpx.post(server.url + "/v1/completions", headers=server.auth, timeout=120,
                               json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 48,
                                     "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text

            with cf.ThreadPoolExecutor(8) as pool:
                list(pool.map(short, range(8)))
            time.sleep(0.5)
            after = server.metrics()
            assert running(full) == 4        # the long ones were running all along
            served = {e: n - _served_by_engine(before)[e] for e, n in _served_by_engine(after).items()}
            assert served == {full: 0, other: 8}, served
        finally:
            stop.set()
        for f in [first, *rest]:
            f.result()
    assert wait_for(lambda: sample(server.metrics(), "realizar_requests_running") == 0, 60)


@pytest.mark.server
@pytest.mark.slow
def test_a_killed_front_end_comes_back_and_the_other_serves_meanwhile(fronts):
    server = fronts
    engines = [p.pid for p in _engines(server)]
    victim = max(_workers(server), key=lambda p: p.pid)
    victim.kill()
    victim.wait(10)
    # the other front end serves on; the one BentoML starts again takes connections at once and
    # answers 503 with Retry-After (model_not_ready) until it has connected to the engines, as a
    # server that starts does: a client retries
    with cf.ThreadPoolExecutor(4) as pool:
        assert len(list(pool.map(lambda i: _complete_retrying(server, i), range(8)))) == 8
    assert wait_for(lambda: len(_workers(server)) == 2, 30)
    assert wait_for(lambda: server.worker_statuses() == {"1": "ready", "2": "ready"}, 60), server.log_tail()
    assert [p.pid for p in _engines(server)] == engines          # the engines were not started again
    with cf.ThreadPoolExecutor(6) as pool:
        assert len(list(pool.map(lambda i: count_to(server, i), range(12)))) == 12
    assert wait_for(lambda: server.engine_statuses() == {"1": ("cpu", "ready"), "2": ("cpu", "ready")}, 30)
    assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200


@pytest.mark.server
@pytest.mark.slow
def test_a_killed_engine_stands_aside_in_every_front_end(fronts):
    server = fronts
    _engines(server)[1].kill()                          # the OOM killer takes engine 2
    assert wait_for(lambda: server.engine_statuses().get("2") == ("cpu", "dead"), 30), server.log_tail()
    with cf.ThreadPoolExecutor(4) as pool:
        assert len(list(pool.map(lambda i: count_to(server, i), range(12)))) == 12     # all 200
    assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
    assert server.engine_statuses()["1"] == ("cpu", "ready")
    assert server.worker_statuses() == {"1": "ready", "2": "ready"}


@pytest.mark.server
@pytest.mark.slow
def test_a_server_whose_engines_cannot_load_exits_with_one_line(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        start_server({**ENV, "REALIZAR_MODEL": str(missing)}, timeout=120)
    log = str(e.value)
    errors = [line for line in log.splitlines() if "cannot serve the model" in line]
    assert len(errors) == 1 and f"ModelFormatError: {missing}: no such file" in errors[0], log[-2000:]
    assert "Traceback" not in log


@pytest.mark.server
@pytest.mark.slow
def test_the_engines_end_with_a_killed_server():
    import psutil

    server = start_server(ENV)
    children = psutil.Process(server.proc.pid).children(recursive=True)
    try:
        assert len(_engines(server)) == 2
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        for p in children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        server.stop()


@pytest.mark.server
@pytest.mark.slow
def test_a_stopped_server_stops_its_engines_and_exits_0():
    import psutil

    server = start_server(ENV)
    engines = _engines(server)
    assert len(engines) == 2
    t0 = time.monotonic()
    server.stop()                                      # SIGTERM to the server's process group
    assert server.proc.returncode == 0, server.log_tail()
    gone, alive = psutil.wait_procs(engines, timeout=20)
    assert not alive and time.monotonic() - t0 < 40, [p.cmdline() for p in alive]
    assert "Traceback" not in server.log_tail(400)


def test_a_front_end_that_reads_nothing_is_hung_up_on_and_never_holds_up_the_engine(monkeypatch):
    import socket as socketlib
    from multiprocessing.connection import Connection

    from realizar_backend.engine import shared

    monkeypatch.setattr(shared, "BACKLOG", 64)
    mine, theirs = socketlib.socketpair()
    hub = shared._Hub.__new__(shared._Hub)
    peer = shared._Peer(hub, Connection(mine.detach()), 0, 1)
    big = ("out", [("r", "x" * 65536)], [])
    t0 = time.monotonic()
    for _ in range(200):                 # the other end reads nothing: its socket buffer fills
        peer.channel.send(big)
    assert time.monotonic() - t0 < 5     # queued, never waited for
    # past BACKLOG unread messages the engine hangs up: the front end reads what was written, then the end
    theirs.settimeout(10)
    got = 0
    while chunk := theirs.recv(1 << 20):
        got += len(chunk)
    assert got < 200 * 65536
    peer.channel.close()
    theirs.close()
