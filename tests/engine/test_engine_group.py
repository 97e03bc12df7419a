"""Engine cores behind one front end (engine/group.py): one engine process per GPU on a GPU host,
REALIZAR_WORKERS of them on the CPU.

The engine-to-GPU mapping is plain logic, tested here for N GPUs without one. The router runs real
engine processes (the NumPy backend, SmolLM2): a group's text equals one engine's, requests in
flight spread evenly, a prompt whose head an engine served goes back to it (and hits its prefix
cache), and an engine that dies ends its own streams while the others serve on. Then a real
`bentoml serve` with two engines: /metrics shows what each served, adding up to what was sent,
and names each engine's state; killing one leaves a server that answers every request."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import signal
import time

import httpx
import pytest

from support.server import count_to, counted_burst, start_server, wait_for

from realizar_backend.engine.group import KV_REPORT_TTL_S, PREFIX_SLACK, PREFIX_TOKENS, EngineGroup
from realizar_backend.engine.process import EngineClient
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.errors import CapacityError, SettingsError
from realizar_backend.settings import Settings, gpu_environ, serve_engines, visible_gpus

SETTINGS = Settings(backend="cpu", max_num_seqs=4, context_length=512)


# ------------------------------------------------------------------------------ the mapping

@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_each_of_n_engines_gets_its_own_gpu(n):
    gpus = visible_gpus(n, {})                       # no CUDA_VISIBLE_DEVICES: the driver's GPUs
    assert gpus == [str(i) for i in range(n)]
    assert serve_engines(Settings(), gpus, use_gpu=True) == n


def test_engines_follow_cuda_visible_devices_as_bentoml_sets_it():
    # BentoML gives the worker "2,3" (or the user set it, and BentoML left it alone)
    gpus = visible_gpus(8, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert gpus == ["2", "3"]
    assert serve_engines(Settings(), gpus, use_gpu=True) == 2
    assert gpu_environ("3")["CUDA_VISIBLE_DEVICES"] == "3"        # engine 2's process sees GPU 3 alone
    # UUIDs pass through; CUDA ignores what follows an invalid (negative) entry
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "GPU-1a,GPU-2b"}) == ["GPU-1a", "GPU-2b"]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_engine_count_from_the_settings():
    assert serve_engines(Settings(workers=2), ["0", "1", "2"], use_gpu=True) == 2
    with pytest.raises(SettingsError, match="REALIZAR_WORKERS=3: one GPU per engine, and 2 are visible"):
        serve_engines(Settings(workers=3), ["0", "1"], use_gpu=True)
    # a machine without GPUs that builds the Bento for a GPU host takes the setting as it is
    assert serve_engines(Settings(workers=4), [], use_gpu=True) == 4
    assert serve_engines(Settings(), [], use_gpu=True) == 1
    # the CPU backend: as many engines as asked, one by default
    assert serve_engines(Settings(), ["0", "1"], use_gpu=False) == 1
    assert serve_engines(Settings(workers=3), [], use_gpu=False) == 3
    with pytest.raises(SettingsError, match="REALIZAR_DEVICE=1"):
        serve_engines(Settings(device=1), ["0", "1"], use_gpu=True)
    with pytest.raises(SettingsError, match="REALIZAR_WORKERS"):
        Settings.from_env({"REALIZAR_WORKERS": "-1"})


# ------------------------------------------------------------------------------ the router

@pytest.fixture(scope="module")
def group():
    g = EngineGroup.start(SETTINGS, [None, None])
    yield g
    g.shutdown()


async def _text(eng, prompt, rid: str, **kw) -> str:
    params = SamplingParams(**kw)
    ids = eng.prepare(prompt, params)
    return "".join([o.text async for o in eng.generate(ids, params, request_id=rid)])


async def _ids(eng, ids: list[int], rid: str) -> None:
    params = SamplingParams(max_tokens=2, temperature=0)
    eng.prepare(ids, params)
    async for _ in eng.generate(ids, params, request_id=rid):
        pass


async def _hold(eng, prompt, rid: str, release: asyncio.Event, started: asyncio.Event | None = None) -> int:
    """A long stream that stops once `release` is set; returns the outputs it read."""
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    n = 0
    async for _ in eng.generate(eng.prepare(prompt, params), params, request_id=rid):
        n += 1
        if started is not None:
            started.set()
        if release.is_set():
            break
    return n


def test_a_group_serves_the_text_one_engine_serves(group):
    one = EngineClient.start(SETTINGS)
    try:
        want = asyncio.run(_text(one, "The capital of France is", "a", max_tokens=12, temperature=0))
    finally:
        one.shutdown()
    got = asyncio.run(_text(group, "The capital of France is", "b", max_tokens=12, temperature=0))
    assert got == want and got
    # one tokenizer and one grammar compiler on this side, whichever engine serves
    assert group.members[0].tokenizer is group.members[1].tokenizer
    assert group.members[0].guidance is group.members[1].guidance


def test_requests_in_flight_spread_evenly_and_the_count_returns_to_zero(group):
    async def run():
        release = asyncio.Event()
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(_hold(group, f"Count to {i}:", f"h{i}", release, started[i])) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
        spread = group.inflight()
        release.set()
        await asyncio.gather(*tasks)
        return spread

    assert asyncio.run(run()) == [2, 2]
    assert group.inflight() == [0, 0]


def test_a_prompt_head_stays_with_its_engine_while_it_is_not_far_busier(group):
    """route() alone (nothing is sent): every request it routes here is released at the end."""
    head = list(range(1000, 1000 + PREFIX_TOKENS))
    routed: list[tuple[int, int]] = []

    def route(ids: list[int]) -> int:
        i = group.route(ids)
        routed.append((i, len(ids)))
        return i

    def end(k: int) -> None:
        group.release(*routed.pop(k))

    try:
        assert route(head + [1]) == 0                     # two idle engines: the first
        # short prompts go by load alone (to both); then some on engine 1 end
        for _ in range(2 * PREFIX_SLACK):
            route([7])
        while group.inflight()[0] - group.inflight()[1] < PREFIX_SLACK:
            end(routed.index(next(r for r in routed if r[0] == 1)))
        # the head's engine is PREFIX_SLACK ahead: the head still goes back to it ...
        assert route(head + [2]) == 0
        # ... and one more ahead, to the least busy engine, which owns it from then on
        assert route(head + [3]) == 1
        while len(routed) > 1:                            # all but that one end: loads [0, 1]
            end(0 if routed[0] != (1, len(head) + 1) else 1)
        assert group.inflight() == [0, 1]
        assert route(head + [4]) == 1                     # by load alone engine 1 (index 0), but the head stays
        assert route([10] * (PREFIX_TOKENS - 1)) == 0     # shorter than the head: by load alone
    finally:
        for i, n in routed:
            group.release(i, n)
    assert group.inflight() == [0, 0]


def test_a_repeated_prompt_hits_the_prefix_cache_of_its_engine(group):
    """The second request of a prompt goes where its head's KV blocks are, although the other
    engine is less busy: its prompt tokens come from that engine's prefix cache."""
    head = [int(t) for t in group.prepare("Tell me a long story about a lighthouse keeper and the sea. " * 6,
                                          SamplingParams(max_tokens=2))]
    assert len(head) >= PREFIX_TOKENS

    async def run():
        await _ids(group, head, "p0")                 # engine 1 serves it (both idle)
        before = group.stats()["prefix_cache_hit_tokens"]
        release, started = asyncio.Event(), asyncio.Event()
        hold = asyncio.create_task(_hold(group, "Count:", "busy", release, started))   # engine 1 again
        await started.wait()
        busy = group.inflight()
        await _ids(group, head, "p1")
        release.set()
        await hold
        return busy, before

    busy, before = asyncio.run(run())
    assert busy == [1, 0]
    assert wait_for(lambda: group.stats()["prefix_cache_hit_tokens"] - before >= PREFIX_TOKENS, 20), group.stats()
    assert group.inflight() == [0, 0]


def _probe(g, ids: list[int]) -> int:
    """Where a request of this prompt would go now (routed, then released: nothing is sent)."""
    i = g.route(ids)
    g.release(i, len(ids))
    return i


def test_an_engine_whose_kv_pool_is_full_gets_nothing_new_while_another_has_room():
    """Four long requests sent to engine 1 directly (as another front end's would be: the router
    has none of them in flight) fill its 64-block pool until it preempts. Then new requests go to
    engine 2 although it is the busier by the router's counts; when engine 1's reports stop (it
    is stopped) they stop counting after KV_REPORT_TTL_S, and it gets work again; and once its
    requests end, its pool has room again."""
    g = EngineGroup.start(SETTINGS.replace(kv_cache_tokens=1024), [None, None])
    routed: list[tuple[int, int]] = []
    try:
        async def run():
            release, started = asyncio.Event(), [asyncio.Event() for _ in range(4)]
            one = g.members[0]
            params = SamplingParams(max_tokens=260, temperature=0, ignore_eos=True)

            async def fill(k: int) -> None:
                ids = [100 + k] + list(range(2000, 2239))                  # 240 tokens, 15 blocks each
                async for _ in one.generate(one.prepare(ids, params), params, request_id=f"fill{k}"):
                    started[k].set()
                    if release.is_set():
                        break

            tasks = [asyncio.create_task(fill(k)) for k in range(4)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
            full = await asyncio.to_thread(wait_for, lambda: _probe(g, [7]) == 1, 60)
            assert full, one.kv_state()
            assert g.inflight() == [0, 0]
            # engine 1 has nothing in flight by the router's counts, engine 2 more and more
            for n in range(3):
                i = g.route([7, n])
                routed.append((i, 2))
                assert i == 1, (n, one.kv_state())
            # a stale report cannot keep work off an engine: engine 1 stopped, its last report ages out
            one._proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(KV_REPORT_TTL_S + 0.5)
                assert _probe(g, [7]) == 0
            finally:
                one._proc.send_signal(signal.SIGCONT)
            assert await asyncio.to_thread(wait_for, lambda: _probe(g, [7]) == 1, 30)
            release.set()
            await asyncio.gather(*tasks)

        asyncio.run(run())
        # its requests ended, engine 1 has room again: the fewest in flight takes the next
        assert wait_for(lambda: _probe(g, [7]) == 0, 30)
    finally:
        for i, n in routed:
            g.release(i, n)
        g.shutdown()


def test_an_engine_that_dies_ends_its_streams_and_the_others_serve_on():
    died = []
    g = EngineGroup.start(SETTINGS, [None, None], on_exit=died.append)
    try:
        async def run():
            release = asyncio.Event()
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(_hold(g, f"Go {i}:", f"k{i}", release, started[i])) for i in range(2)]
            await asyncio.gather(*(s.wait() for s in started))
            assert g.inflight() == [1, 1]
            g.members[1]._proc.kill()
            with pytest.raises(CapacityError, match="engine process exited"):
                await asyncio.wait_for(tasks[1], 60)
            release.set()
            return await tasks[0]

        assert asyncio.run(run()) > 1                  # engine 1's stream went on
        assert wait_for(lambda: [s for _, s in g.engine_statuses()] == ["ready", "dead"], 20)
        assert g.alive and g.stall() is None and not died
        async def four():
            return await asyncio.gather(*[_text(g, f"Hi {i}", f"n{i}", max_tokens=3, temperature=0) for i in range(4)])
        assert all(asyncio.run(four()))
        g.members[0]._proc.kill()
        assert wait_for(lambda: bool(died), 20) and not g.alive
        with pytest.raises(CapacityError):
            asyncio.run(_text(g, "Hi", "last", max_tokens=2))
    finally:
        g.shutdown()


# ------------------------------------------------------------------------------ a real server

@pytest.mark.server
@pytest.mark.slow
def test_two_engines_behind_one_front_end_serve_and_one_may_die():
    server = start_server({"REALIZAR_WORKERS": "2"})
    try:
        assert server.engine_statuses() == {"1": ("cpu", "ready"), "2": ("cpu", "ready")}
        assert len(server.engines()) == 2
        # the engines' events and reports add up to exactly what was served
        usages, delta = counted_burst(server, 18)
        assert delta("realizar_engine_steps_total", kind="decode") > 0
        # each engine's series: both served, about evenly (least in flight first)
        per = delta.finished_by_engine()
        assert sum(per) == len(usages) and min(per) >= len(usages) // 3, per

        server.engines()[1].kill()                   # the OOM killer takes engine 2
        assert wait_for(lambda: server.engine_statuses().get("2") == ("cpu", "dead"), 30), server.log_tail()
        with cf.ThreadPoolExecutor(4) as pool:
            assert len(list(pool.map(lambda i: count_to(server, i), range(8)))) == 8    # all 200
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
        assert httpx.get(server.url + "/livez", timeout=10).status_code == 200
        assert server.engine_statuses()["1"] == ("cpu", "ready")
        assert "engine 2 of 2 (cpu) is gone" in server.log_tail(400)
    finally:
        server.stop()
