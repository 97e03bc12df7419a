"""The scheduler over the paged KV cache, on the real SmolLM2 (NumPy backend): preemption under a
tiny pool, chunked prefill between the others' decode steps, prefix caching, cancellation."""

import asyncio
import math

import numpy as np
import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.errors import ContextOverflowError
from realizar_backend.settings import Settings

pytestmark = pytest.mark.slow

BASE = dict(backend="cpu", max_num_seqs=4, context_length=256)


@pytest.fixture(scope="module")
def ref():
    """Room for everything at once; prompts prefilled in one piece."""
    eng = Engine.from_settings(Settings(**BASE))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tiny():
    """Six blocks of 16 tokens for four sequences; prompts in chunks of 16."""
    eng = Engine.from_settings(Settings(**BASE, kv_cache_tokens=96, prefill_chunk_tokens=16))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def nocache():
    eng = Engine.from_settings(Settings(**BASE, enable_prefix_caching=False, prefill_chunk_tokens=16))
    yield eng
    eng.shutdown()


async def _text(engine, prompt, **kw):
    params = SamplingParams(**kw)
    ids = engine.prepare(prompt, params)
    outs = [o async for o in engine.generate(ids, params)]
    return "".join(o.text for o in outs), outs


def _together(engine, jobs):
    async def go():
        return await asyncio.gather(*[_text(engine, p, **kw) for p, kw in jobs])
    return asyncio.run(go())


def _wait_idle(engine):
    async def go():
        for _ in range(500):
            st = engine.stats()
            if st["running"] == 0 and st["waiting"] == 0:
                return st
            await asyncio.sleep(0.02)
        return engine.stats()
    return asyncio.run(go())


JOBS = [(f"Story {i}: the {w} cat sat on the", dict(max_tokens=30, temperature=0, ignore_eos=True))
        for i, w in enumerate(["black", "small", "happy", "old"])]
# sampled with penalties, and the last of the four first admitted: the first preempted, its token
# counts must come back as they were when it resumes
JOBS.insert(3, ("A list of fruits: apple, banana,", dict(max_tokens=30, temperature=0.8, seed=11,
                                                        repetition_penalty=1.3, frequency_penalty=0.5,
                                                        ignore_eos=True)))


def test_preemption_under_a_tiny_pool_gives_the_same_text(ref, tiny):
    """Five sequences of ~42 tokens each in a pool of 96 tokens: they take turns (preempted and
    recomputed), yet each gets exactly the text it gets with room to spare."""
    want = [t for t, _ in _together(ref, JOBS)]
    before = tiny.stats()["preemptions"]
    got = _together(tiny, JOBS)
    assert tiny.stats()["preemptions"] > before
    assert [t for t, _ in got] == want
    for _, outs in got:
        assert [o.finish_reason for o in outs[-1:]] == ["length"]
        assert sum(len(o.token_ids) for o in outs) == 30
    st = _wait_idle(tiny)
    assert st["kv_used_blocks"] == 0 and st["kv_used_tokens"] == 0


def test_chunked_prefill_gives_the_one_shot_logits(ref, tiny):
    prompt = ("The history of the city began long ago, when a small group of farmers settled by the "
              "river. Over the centuries it grew into a busy port, and its people became known for")
    n = len(ref.prepare(prompt, SamplingParams(max_tokens=1)))
    assert n > 2 * 16      # more than two chunks of tiny's 16 tokens
    one = asyncio.run(_text(ref, prompt, max_tokens=3, temperature=0, logprobs=5))[1]
    chunked = asyncio.run(_text(tiny, prompt, max_tokens=3, temperature=0, logprobs=5))[1]
    # the same tokens and logprobs; how many tokens each output carries depends on when the consumer
    # read it (steps started ahead may deliver two at once)
    assert [t for o in chunked for t in o.token_ids] == [t for o in one for t in o.token_ids]
    lps_one = [lp for o in one for lp in o.logprobs]
    lps_chunked = [lp for o in chunked for lp in o.logprobs]
    assert len(lps_one) == len(lps_chunked) == 3
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(lps_one, lps_chunked):
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        np.testing.assert_allclose([v for _, v in top_b], [v for _, v in top_a], atol=1e-3)


def test_a_long_prompt_does_not_stop_the_others_streams(ref, nocache):
    """While a 200-token prompt is prefilled in 16-token chunks, a running stream keeps receiving
    tokens: one per chunk step, before the long prompt's first token arrives."""
    long_prompt = " ".join(f"item{i}" for i in range(70))
    long_params = SamplingParams(max_tokens=4, temperature=0)
    long_ids = nocache.prepare(long_prompt, long_params)
    assert 180 <= len(long_ids) <= 240
    chunks = math.ceil(len(long_ids) / 16)

    async def go():
        events = []
        params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
        stream = nocache.generate(nocache.prepare("Count slowly: one, two,", params), params)

        async def streamer():
            async for o in stream:
                events.append(("short", len(o.token_ids)))
                if len(events) == 1:
                    started.set()

        async def long_one():
            await started.wait()
            events.append(("long submitted", 0))
            outs = []
            async for o in nocache.generate(long_ids, long_params):
                if not outs:
                    events.append(("long first token", 0))
                outs.append(o)
            return "".join(o.text for o in outs)

        started = asyncio.Event()
        _, text = await asyncio.gather(streamer(), long_one())
        return events, text

    events, text = asyncio.run(go())
    names = [e for e, _ in events]
    a, b = names.index("long submitted"), names.index("long first token")
    between = sum(n for e, n in events[a:b] if e == "short")
    assert between >= chunks - 1, f"{between} tokens streamed during {chunks} prefill chunks"
    assert text == asyncio.run(_text(ref, long_ids, max_tokens=4, temperature=0))[0]


def test_a_shared_prefix_is_prefilled_once(ref, nocache):
    system = ("You are a meticulous assistant for a botanical garden. Answer visitors' questions about "
              "plants, opening hours and events in one short sentence, and never make anything up.\n")
    first, second = system + "Q: When do you open?\nA:", system + "Q: Do you have cacti?\nA:"
    ids1 = ref.prepare(first, SamplingParams(max_tokens=1))
    ids2 = ref.prepare(second, SamplingParams(max_tokens=1))
    common = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    bs = ref.backend.block_size
    assert common >= 2 * bs

    def hits():
        st = ref.stats()
        return st["prefix_cache_hit_tokens"], st["prefix_cache_queried_tokens"]

    h0, q0 = hits()
    out1 = asyncio.run(_text(ref, first, max_tokens=12, temperature=0))[0]
    h1, q1 = hits()
    out2 = asyncio.run(_text(ref, second, max_tokens=12, temperature=0))[0]
    h2, q2 = hits()
    assert (h1 - h0, q1 - q0) == (0, len(ids1))
    assert (h2 - h1, q2 - q1) == (common // bs * bs, len(ids2))
    # the same prompt again: everything but the block of its last token comes from the cache
    again = asyncio.run(_text(ref, second, max_tokens=12, temperature=0))[0]
    assert ref.stats()["prefix_cache_hit_tokens"] - h2 == (len(ids2) - 1) // bs * bs
    # and the text is what a server without the cache writes
    assert nocache.stats()["prefix_cache_queried_tokens"] == 0
    assert out1 == asyncio.run(_text(nocache, first, max_tokens=12, temperature=0))[0]
    assert out2 == again == asyncio.run(_text(nocache, second, max_tokens=12, temperature=0))[0]


def test_filling_the_pool_and_cancelling_everything_frees_every_block(tiny):
    async def go():
        params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True) for _ in range(7)]
        gens = [tiny.generate(tiny.prepare(f"Tell me about planet number {i}.", p), p)
                for i, p in enumerate(params)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.wait(firsts[:4])            # four running (the slots), three waiting
        for _ in range(1200):                     # until the pool is (nearly) full
            if tiny.stats()["kv_usage"] >= 0.8:
                break
            await asyncio.sleep(0.1)
        full = tiny.stats()
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return full
    full = asyncio.run(go())
    assert full["kv_usage"] >= 0.8 and full["running"] >= 1
    st = _wait_idle(tiny)
    assert (st["running"], st["waiting"], st["kv_used_blocks"], st["kv_used_tokens"], st["kv_usage"]) == \
        (0, 0, 0, 0, 0.0)
    assert sorted(tiny.scheduler.free_slots) == list(range(tiny.backend.max_slots))


def test_a_request_larger_than_the_whole_pool_is_refused(tiny):
    with pytest.raises(ContextOverflowError, match="KV cache"):
        tiny.prepare("word " * 120, SamplingParams(max_tokens=1))          # within the context
    with pytest.raises(ContextOverflowError, match="KV cache of 96 tokens"):
        tiny.prepare("Hello there", SamplingParams(max_tokens=95))
    params = SamplingParams(max_tokens=None)
    ids = tiny.prepare("Hello there", params)
    assert len(ids) + params.max_tokens == 96


def test_a_short_request_is_not_queued_behind_a_long_ones_prefill(nocache):
    """A request of three ~200-token prompts (its choices: one request id `big-<i>`) is prefilled
    16 tokens a step; a short request that arrives just after it gets the next step's budget (its
    request has been served nothing), so its first token comes before any of the long one's,
    which all wait for about 40 steps of prefill."""
    long_prompt = " ".join(f"item{i}" for i in range(70))

    async def go():
        order = []

        async def run(rid, prompt, max_tokens):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            async for o in nocache.generate(nocache.prepare(prompt, params), params, request_id=rid):
                if o.token_ids and rid not in order:
                    order.append(rid)

        big = [asyncio.ensure_future(run(f"big-{i}", f"{i} {long_prompt}", 2)) for i in range(3)]
        await asyncio.sleep(0)                 # the long request's choices are queued first
        await asyncio.gather(run("small-0", "Hi there", 1), *big)
        return order

    order = asyncio.run(go())
    assert order[0] == "small-0", order
