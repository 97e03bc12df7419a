"""The engine on the real SmolLM2 (NumPy backend): batching, sampling, stops, cancel, errors."""

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from realizar_backend.backends.base import PrefillItem
from realizar_backend.engine.engine import Engine
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.errors import CapacityError, ContextOverflowError, RequestError
from realizar_backend.settings import Settings


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_settings(Settings(backend="cpu", max_num_seqs=4, context_length=256))
    yield eng
    eng.shutdown()


def run(engine, prompt, **kw):
    params = SamplingParams(**kw)
    ids = engine.prepare(prompt, params)
    outs = list(engine.generate_sync(ids, params))
    return "".join(o.text for o in outs), outs


def test_greedy_engine_equals_plain_backend_loop(engine):
    text, outs = run(engine, "The capital of France is", max_tokens=10, temperature=0)
    ids = engine.tokenizer.encode("The capital of France is")
    be = engine.backend
    slot = be.max_slots - 1   # the engine is idle: any slot and free block is ours for a moment
    engine.kv.allocate("plain", lambda a, b: ids[a:b], len(ids) + 10)
    be.set_block_table(slot, engine.kv.table("plain"))
    logits = be.prefill([PrefillItem(slot, np.array(ids, dtype=np.int32), 0)])[0]
    want = []
    for i in range(10):
        want.append(int(np.argmax(logits)))
        logits = be.decode([slot], [want[-1]], [len(ids) + i])[0]
    be.release(slot)
    engine.kv.free("plain")
    assert [t for o in outs for t in o.token_ids] == want
    assert text == engine.tokenizer.decode(want)
    assert "Paris" in text
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 10


FIRST_TOKEN_CASES = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9),
                     dict(temperature=1.3, min_p=0.02), dict(temperature=0, repetition_penalty=1.8),
                     dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
                     dict(temperature=0, logit_bias={"504": 8.0}), dict(temperature=1.0, logit_bias={"30": -100}),
                     dict(temperature=0.7, logprobs=1), dict(temperature=0.7, logprobs=4), "grammar"]


@pytest.mark.parametrize("case", FIRST_TOKEN_CASES, ids=str)
def test_first_token_is_the_twins_draw_from_the_prompts_logits(engine, case):
    """The backend samples a sequence's first token (no logits come to the engine): with a fixed
    seed it is the token the host drew before, the NumPy twin's draw from the prompt's last-row
    logits, with the prompt's tokens counted for the penalties, the logit bias and a grammar's
    mask applied, logprobs of the raw distribution."""
    from dataclasses import replace

    from realizar_backend.backends.sampling import sample_logits
    from realizar_backend.engine.guidance import Constraint
    from realizar_backend.engine.sampling import Sampler, token_logprobs
    prompt = "Name a colour:"          # < one KV block: no prefix-cache hit, the whole prompt runs
    kw = dict(constraint=Constraint("regex", "(red|green|blue|yellow) ?[a-z]*"), temperature=0.9) \
        if case == "grammar" else dict(case)
    ids = engine.tokenizer.encode(prompt)
    be = engine.backend
    slot = be.max_slots - 1   # the engine is idle: any slot and free block is ours for a moment
    engine.kv.allocate("plain", lambda a, b: ids[a:b], len(ids))
    be.set_block_table(slot, engine.kv.table("plain"))
    logits = be.prefill([PrefillItem(slot, np.array(ids, dtype=np.int32), 0)])[0, :engine.config.vocab_size]
    be.release(slot)
    engine.kv.free("plain")
    V = engine.config.vocab_size
    for seed in range(5):
        text, outs = run(engine, prompt, max_tokens=1, seed=seed, **kw)
        params = SamplingParams(seed=seed, **kw).validate(V)
        row = Sampler(params, V).row(0)
        counts = np.zeros(V, np.int32)
        counts[ids] = 1
        mask = None
        if case == "grammar":
            guide = engine.guidance.guide(params.constraint)
            mask = guide.compute_mask().copy()
            engine.guidance.release(guide)
        want = sample_logits(logits, replace(row, mask=mask), counts if row.penalties else None)
        assert outs[0].token_ids == [want], (seed, text)
        if params.logprobs is not None:
            (_, lp, top), = outs[0].logprobs
            chosen, top_want = token_logprobs(logits, want, params.logprobs)
            assert lp == pytest.approx(chosen, abs=1e-4)
            assert [engine.tokenizer.token_text(i) for i, _ in top_want] == [t for t, _ in top]
            assert [v for _, v in top] == pytest.approx([v for _, v in top_want], abs=1e-4)
    if case == "grammar":
        assert engine.tokenizer.decode([want])[:1] in ("r", "g", "b", "y")


def test_concurrent_requests_match_their_solo_runs(engine):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(6)]
    solo = [run(engine, p, max_tokens=8, temperature=0)[0] for p in prompts]

    async def one(p):
        params = SamplingParams(max_tokens=8, temperature=0)
        ids = engine.prepare(p, params)
        return "".join([o.text async for o in engine.generate(ids, params)])

    async def many():
        sampled = [one(p) for p in prompts]
        noisy = engine.generate(engine.prepare("Tell me a joke", sp := SamplingParams(
            max_tokens=8, temperature=1.0, top_p=0.9, seed=3)), sp)
        return await asyncio.gather(*sampled, _drain(noisy))

    together = asyncio.run(many())
    assert together[:6] == solo


async def _drain(agen):
    return "".join([o.text async for o in agen])


def test_seed_makes_sampling_reproducible(engine):
    a = run(engine, "Once upon a time", max_tokens=12, temperature=1.0, seed=1234)[0]
    b = run(engine, "Once upon a time", max_tokens=12, temperature=1.0, seed=1234)[0]
    others = {run(engine, "Once upon a time", max_tokens=12, temperature=1.0, seed=s)[0] for s in range(4)}
    assert a == b
    assert len(others) > 1


def test_stop_string_cuts_output_and_finishes(engine):
    full = run(engine, "The capital of France is", max_tokens=12, temperature=0)[0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    text, outs = run(engine, "The capital of France is", max_tokens=12, temperature=0, stop=[stop])
    assert text == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_stop_token_id_finishes_without_its_text(engine):
    _, outs = run(engine, "The capital of France is", max_tokens=10, temperature=0)
    ids = [t for o in outs for t in o.token_ids]
    first = ids.index(ids[3])          # the token may already occur earlier
    text, outs2 = run(engine, "The capital of France is", max_tokens=10, temperature=0, stop_token_ids=[ids[3]])
    assert outs2[-1].finish_reason == "stop"
    assert text == engine.tokenizer.decode(ids[:first])


def test_logprobs_are_the_models_distribution(engine):
    _, outs = run(engine, "The capital of France is", max_tokens=3, temperature=0, logprobs=3)
    for o in outs:
        (tok_text, lp, top), = o.logprobs
        assert lp <= 0 and len(top) == 3
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][1] == pytest.approx(lp)          # greedy: the chosen token is the most likely
        assert tok_text == top[0][0]


def test_cancel_frees_the_slot_and_blocks_at_once(engine):
    async def go():
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        agen = engine.generate(engine.prepare("Write a long story about a dragon.", params), params)
        async for _ in agen:
            break
        assert engine.stats()["running"] == 1
        await agen.aclose()
        for _ in range(100):
            if engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.02)
        return engine.stats()
    stats = asyncio.run(go())
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_used_blocks"] == 0 and stats["kv_used_tokens"] == 0 and stats["kv_usage"] == 0.0
    assert sorted(engine.scheduler.free_slots) == list(range(engine.backend.max_slots))


def test_more_requests_than_slots_all_complete(engine):
    async def go():
        async def one(i):
            p = SamplingParams(max_tokens=4, temperature=0)
            outs = [o async for o in engine.generate(engine.prepare(f"Item {i}:", p), p)]
            return outs[-1].finish_reason, outs[-1].completion_tokens
        return await asyncio.gather(*[one(i) for i in range(10)])   # 4 slots, 10 requests
    assert asyncio.run(go()) == [("length", 4)] * 10


def test_step_accounts_add_up(engine):
    """stats()'s step totals (the engine_* counters on /metrics) say what the loop's time went to:
    the prompt tokens its steps computed, the steps by kind, and the time it sat idle."""
    import time
    before = engine.stats()
    time.sleep(0.3)                        # idle: counted when the next step starts
    prompts = [f"Entry {i} of the list:" for i in range(10)]
    lengths = [2 + i % 5 for i in range(10)]         # staggered ends: a freed slot is refilled while others decode
    ids = [engine.prepare(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    t0 = time.perf_counter()

    async def go():
        async def one(x, n):
            p = SamplingParams(max_tokens=n, temperature=0)
            return [o async for o in engine.generate(x, p)]
        return await asyncio.gather(*[one(x, n) for x, n in zip(ids, lengths)])     # 4 slots, 10 requests
    asyncio.run(go())
    wall = time.perf_counter() - t0
    after = engine.stats()
    steps = {k: after["engine_steps"][k] - before["engine_steps"][k] for k in after["engine_steps"]}
    secs = {k: after["engine_step_seconds"][k] - before["engine_step_seconds"][k] for k in steps}
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert after["engine_step_prompt_tokens"] - before["engine_step_prompt_tokens"] == sum(map(len, ids)) - hits
    # 10 requests through 4 slots: prompts arrive while others decode, so some steps do both
    assert steps["mixed"] >= 1 and steps["decode"] >= 1 and steps["prefill"] >= 1
    # the longest request's tokens after its first, at most one a step
    assert steps["decode"] + steps["mixed"] >= max(lengths) - 1
    assert all(secs[k] > 0 for k in steps if steps[k])
    assert sum(secs.values()) <= wall
    assert after["engine_idle_seconds"] - before["engine_idle_seconds"] >= 0.25


def test_step_trace_has_a_line_per_step(tmp_path):
    """REALIZAR_STEP_TRACE: one JSON line per step, whose sums are the engine's step accounts."""
    import json
    path = tmp_path / "steps.jsonl"
    eng = Engine.from_settings(Settings(backend="cpu", max_num_seqs=2, context_length=256, step_trace=str(path)))
    try:
        async def go():
            async def one(i):
                p = SamplingParams(max_tokens=3, temperature=0)
                return [o async for o in eng.generate(eng.prepare(f"Trace {i}:", p), p)]
            return await asyncio.gather(*[one(i) for i in range(3)])
        asyncio.run(go())
        stats = eng.stats()
    finally:
        eng.shutdown()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == sum(stats["engine_steps"].values())
    for kind in ("decode", "prefill", "mixed"):
        mine = [x for x in lines if x["kind"] == kind]
        assert len(mine) == stats["engine_steps"][kind]
        assert sum(x["ms"] for x in mine) == pytest.approx(1e3 * stats["engine_step_seconds"][kind], abs=0.01 * len(mine) + 1e-6)
    assert sum(x["prompt_tokens"] for x in lines) == stats["engine_step_prompt_tokens"]
    assert all((x["prompt_seqs"] > 0) == (x["kind"] != "decode") and (x["decode_rows"] > 0) == (x["kind"] != "prefill")
               for x in lines)
    assert [x["t_ms"] for x in lines] == sorted(x["t_ms"] for x in lines)
    assert lines[-1]["running"] == 0 and lines[-1]["waiting"] == 0
    assert max(x["running"] for x in lines) == 2         # two slots for three requests


def test_request_errors_are_typed(engine):
    with pytest.raises(ContextOverflowError):
        engine.prepare("hello", SamplingParams(max_tokens=1000))
    with pytest.raises(ContextOverflowError):
        engine.prepare("word " * 400, SamplingParams(max_tokens=1))
    with pytest.raises(RequestError) as e:
        engine.prepare("hello", SamplingParams(temperature=-1))
    assert e.value.param == "temperature" and e.value.status == 400
    with pytest.raises(RequestError):
        engine.prepare([1, 2, 10**9], SamplingParams())
    with pytest.raises(RequestError):
        engine.prepare("", SamplingParams())
    params = SamplingParams(max_tokens=None)
    ids = engine.prepare("hello", params)
    assert params.max_tokens == engine.max_context - len(ids)


def test_full_queue_is_a_capacity_error(engine):
    old = engine.scheduler.max_waiting
    engine.scheduler.max_waiting = 0
    try:
        with pytest.raises(CapacityError):
            list(engine.generate_sync([1, 2, 3], SamplingParams(max_tokens=1)))
    finally:
        engine.scheduler.max_waiting = old


def test_cli_generate_streams_only_the_completion():
    r = subprocess.run([sys.executable, "-m", "realizar_backend.cli", "generate", "The capital of France is",
                        "--max-tokens", "6", "--backend", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "The capital" not in r.stdout


def test_cli_reports_a_bad_model_file_cleanly(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all, just text" * 4)
    r = subprocess.run([sys.executable, "-m", "realizar_backend.cli", "inspect", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "bad.gguf" in r.stderr and "Traceback" not in r.stderr


def test_a_slow_reader_gets_queued_outputs_merged(engine):
    full, outs = run(engine, "The capital of France is", max_tokens=12, temperature=0, logprobs=1)

    async def slow():
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
        agen = engine.generate(engine.prepare("The capital of France is", params), params)
        got = []
        async for o in agen:
            got.append(o)
            await asyncio.sleep(0.3)      # the engine runs ahead meanwhile
        return got
    got = asyncio.run(slow())
    assert len(got) < len(outs)                               # fewer, bigger pieces
    assert "".join(o.text for o in got) == full
    assert [t for o in got for t in o.token_ids] == [t for o in outs for t in o.token_ids]
    assert sum(len(o.logprobs) for o in got) == 12
    assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 12
