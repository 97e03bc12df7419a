"""The engine's paged-KV call pattern on the CUDA backend, real SmolLM2: block tables that grow
while a greedy step started ahead is in flight, prompts in chunks between decode steps, prefix
blocks shared between slots, preemption and recompute under a tiny pool. Each run must write the
text the same engine writes with room to spare (and, for the greedy runs, the CPU oracle's)."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.gpu


def _smol_path():
    from test_model_parity import _real_smol
    p = _real_smol()
    return None if p is None else str(p)


def _engine(**kw):
    from realizar_backend.engine.engine import Engine
    from realizar_backend.settings import Settings
    path = _smol_path()
    if path is None:
        pytest.skip("SmolLM2 not on this machine")
    return Engine.from_settings(Settings(model=path, max_num_seqs=8, context_length=512, self_check=False, **kw))


@pytest.fixture(scope="module")
def roomy():
    eng = _engine(backend="cuda")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tiny():
    """Eight blocks of 16 tokens for eight sequences; prompts in chunks of 16 tokens."""
    eng = _engine(backend="cuda", kv_cache_tokens=128, prefill_chunk_tokens=16)
    assert eng.kv.num_blocks * eng.backend.block_size <= 128
    yield eng
    eng.shutdown()


def _together(engine, jobs):
    from realizar_backend.engine.sampling import SamplingParams

    async def one(prompt, kw):
        params = SamplingParams(**kw)
        ids = engine.prepare(prompt, params)
        return "".join([o.text async for o in engine.generate(ids, params)])

    async def go():
        return await asyncio.gather(*[one(p, kw) for p, kw in jobs])
    return asyncio.run(go())


GREEDY = dict(max_tokens=40, temperature=0, ignore_eos=True)
JOBS = [(f"Story {i}: the {w} cat sat on the", GREEDY) for i, w in enumerate(["black", "small", "happy"])]
# Penalties across a preemption (the counts rebuilt by reset_counts), greedy: a recomputed row's
# logits come from the prompt kernels, equal to the decode step's only to rounding, so a seeded
# draw may land on the other side of a CDF step (the CPU tests cover seeded draws across preemption).
JOBS.append(("A list of fruits: apple, banana,", dict(max_tokens=40, temperature=0, repetition_penalty=1.3,
                                                     frequency_penalty=0.5, ignore_eos=True)))
JOBS += [(f"Story {i}: the {w} dog ran to the", GREEDY) for i, w in enumerate(["old", "big"])]


def test_preemption_and_chunks_on_the_gpu_give_the_roomy_text(roomy, tiny):
    want = _together(roomy, JOBS)
    before = tiny.stats()["preemptions"]
    got = _together(tiny, JOBS)
    st = tiny.stats()
    print(f"preemptions {st['preemptions'] - before}")
    assert st["preemptions"] > before
    assert got == want
    for _ in range(100):
        if tiny.stats()["running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    st = tiny.stats()
    assert (st["running"], st["kv_used_blocks"], st["kv_used_tokens"]) == (0, 0, 0)


def test_greedy_batch_with_growing_tables_equals_the_cpu_oracle(roomy):
    """Greedy sequences that cross several block boundaries while steps run ahead: the CPU
    engine's text (both keep fp32-class numerics; SmolLM2 has no near-tie in these prompts)."""
    cpu = _engine(backend="cpu")
    try:
        jobs = [(p, GREEDY) for p, kw in JOBS if kw is GREEDY]
        assert _together(roomy, jobs) == _together(cpu, jobs)
    finally:
        cpu.shutdown()


def test_a_shared_prefix_is_reused_on_the_gpu(roomy):
    system = ("You are a meticulous assistant for a botanical garden. Answer visitors' questions about "
              "plants, opening hours and events in one short sentence, and never make anything up.\n")
    prompts = [system + "Q: When do you open?\nA:", system + "Q: Do you have cacti?\nA:"]
    h0 = roomy.stats()["prefix_cache_hit_tokens"]
    with_cache = [_together(roomy, [(p, dict(max_tokens=16, temperature=0))])[0] for p in prompts]
    assert roomy.stats()["prefix_cache_hit_tokens"] - h0 >= 2 * roomy.backend.block_size
    off = _engine(backend="cuda", enable_prefix_caching=False)
    try:
        assert [_together(off, [(p, dict(max_tokens=16, temperature=0))])[0] for p in prompts] == with_cache
    finally:
        off.shutdown()


def _fill_kv(engine, byte: int) -> None:
    """Every byte of the engine's KV pool set to `byte` (0xff: fp16 NaN in every K and V)."""
    import cupy
    kv = engine.backend.kv
    with engine.backend.device:
        for a in (kv.k, kv.v):
            cupy.cuda.runtime.memset(a.data.ptr, byte, a.nbytes)
        cupy.cuda.runtime.deviceSynchronize()


def test_a_pool_full_of_nan_gives_the_text_of_a_zeroed_one():
    """The KV pool is not zeroed at start (kv_cache.py): no kernel may read a row that nobody wrote.
    A pool of NaN must then give exactly the text of a zeroed pool, over padded buckets (6 rows in
    a bucket of 8), batches on the MMQ and flash-decoding kernels (17 rows), a long row (flash
    decoding from position 384) and prompts in chunks."""
    from realizar_backend.engine.engine import Engine
    from realizar_backend.settings import Settings
    path = _smol_path()
    if path is None:
        pytest.skip("SmolLM2 not on this machine")
    words = "red blue green old new tall short wide calm wild shy bold warm cold dark pale odd".split()
    many = [(f"Note {i}: the {w} bird flew over the", GREEDY) for i, w in enumerate(words)]
    long = [("Count the apples: " + "apple, " * 200 + "and one more", dict(max_tokens=40, temperature=0,
                                                                        ignore_eos=True))]
    texts = []
    for byte in (0x00, 0xFF):
        eng = Engine.from_settings(Settings(model=path, backend="cuda", max_num_seqs=32, context_length=512,
                                            prefill_chunk_tokens=128, self_check=False))
        try:
            _fill_kv(eng, byte)
            texts.append([_together(eng, jobs) for jobs in (JOBS, many, long)])
        finally:
            eng.shutdown()
    assert len(long[0][0]) > 1000
    assert texts[1] == texts[0]
    assert all(t for run in texts[1] for t in run)
