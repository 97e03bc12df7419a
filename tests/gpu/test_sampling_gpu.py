"""GPU sampling (kernels/sampling.cu through backends/cuda/sampling.py) against the NumPy twin
(backends/sampling.py) on fresh random logits: same tokens (the twin is bit-exact by design; any
disagreement must sit on a CDF boundary), device token counts for the penalties, logprobs,
outputs poisoned before every launch and the per-row scratch left zeroed, constrained rows (masks
and logit biases) among plain ones; then the whole engine
on the CUDA backend: seeded requests reproduce and greedy output is unchanged."""

from __future__ import annotations


import numpy as np
import pytest
from support.steps import greedy_step

from realizar_backend.backends.base import SampleRow
from realizar_backend.backends.sampling import draw_detail, raw_logprobs, sample_logits

pytestmark = pytest.mark.gpu

VOCABS = [1000, 32001, 49152, 151936, 262144]
COMBOS = [dict(), dict(temperature=0.7, top_p=0.9), dict(top_k=40), dict(top_k=50, top_p=0.95, temperature=0.8),
          dict(min_p=0.05), dict(temperature=1.3, top_p=0.98, min_p=0.01), dict(top_p=0.5, logprobs=True),
          dict(temperature=0.0), dict(temperature=0.0, logprobs=True), dict(temperature=2.0),
          dict(top_k=2000, top_p=0.999), dict(top_k=1), dict(min_p=1.0)]
MAX_ROWS = 8

_samplers: dict[int, object] = {}


def sampler(V):
    from realizar_backend.backends.cuda.sampling import GpuSampler
    if V not in _samplers:
        _samplers[V] = GpuSampler(0, V, MAX_ROWS, MAX_ROWS)
    return _samplers[V]


def llm_like(rng, n, V):
    """A bulk of small logits and a few large ones, at a random scale per row."""
    x = rng.standard_normal((n, V)) * rng.uniform(1.0, 3.5, (n, 1))
    for r in range(n):
        x[r, rng.choice(V, 8, replace=False)] += rng.uniform(4, 14, 8)
    return x.astype(np.float32)


def gpu_sample(kernels, s, logits, rows, slots=None, tokens_in=None):
    """One launch on fresh device copies, outputs and scratch poisoned; returns the fetched outputs
    after checking that the kernels left the per-row scratch zeroed."""
    import cupy

    from realizar_backend.backends.cuda import ops
    n, V = logits.shape
    x = cupy.asarray(logits)
    am = cupy.full(n, -1, cupy.int32)
    ops.argmax_rows(kernels, x.data.ptr, V, V, am.data.ptr, n)
    s.out.fill(-7)
    s.zbuf.fill(np.nan)
    s.lsep.fill(np.nan)
    stream = cupy.cuda.get_current_stream()
    s.launch(x.data.ptr, V, am.data.ptr, rows, list(range(n)) if slots is None else slots, tokens_in, stream)
    got = s.fetch(n, stream)
    for a in (s.hcnt, s.hw, s.rowmax, s.zmass):
        assert not bool(a.any()), "scratch not left zeroed"
    assert np.array_equal(got[1], am.get())
    return got


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_kernel_matches_twin(kernels, rng, V, batch):
    s = sampler(V)
    reps = max(2, 24 // batch)
    total = agree = 0
    for rep in range(reps):
        logits = llm_like(rng, batch, V)
        rows = [SampleRow(seed=int(rng.integers(0, 2 ** 63)), step=int(rng.integers(0, 10 ** 6)),
                          **COMBOS[(rep * batch + i) % len(COMBOS)]) for i in range(batch)]
        toks, top, lp, top_lp = gpu_sample(kernels, s, logits, rows)
        for i, row in enumerate(rows):
            want = sample_logits(logits[i], row)
            total += 1
            if toks[i] == want:
                agree += 1
            else:
                dr = draw_detail(logits[i], row)
                assert dr is not None and dr.boundary_distance() < 1e-6, (V, row, toks[i], want)
                print(f"near-tie disagreement V={V} {row}: gpu {toks[i]} twin {want}")
            if row.logprobs:
                rl, rt, rtl = raw_logprobs(logits[i], int(toks[i]))
                assert lp[i] == pytest.approx(rl, abs=2e-3) and top_lp[i] == pytest.approx(rtl, abs=2e-3)
                assert top[i] == rt
            else:
                assert np.isnan(lp[i])
    print(f"V={V} batch {batch}: {agree}/{total} tokens equal to the twin")
    assert agree >= 0.995 * total


def test_ties_and_dense_bins(kernels, rng):
    """Thousands of equal or nearly equal logits: the dense-bin radix select and ties by index."""
    V = 151936
    s = sampler(V)
    lg = np.round(rng.standard_normal((6, V)) * 1.5).astype(np.float32)
    lg[0] = 0.0
    lg[1] = (1.0 + rng.uniform(0, 0.0075, V)).astype(np.float32)
    lg[1, 17] = 1.5
    rows = [SampleRow(seed=1, step=3), SampleRow(seed=2, step=4, top_k=3000), SampleRow(seed=3, step=5, top_p=0.3),
            SampleRow(seed=4, step=6, top_k=20000, top_p=0.9), SampleRow(seed=5, step=7, min_p=0.5),
            SampleRow(seed=6, step=8, top_k=10)]
    toks = gpu_sample(kernels, s, lg, rows)[0]
    assert [int(t) for t in toks] == [sample_logits(lg[i], r) for i, r in enumerate(rows)]


def test_penalties_with_device_counts(kernels, rng):
    """A few sequences with penalties over several steps: the device counts the fed token before
    the penalties, exactly as the twin with host counts."""
    import cupy
    V = 32001
    s = sampler(V)
    slots = [3, 0, 6]
    prompts = [rng.integers(0, V, n).astype(np.int32) for n in (40, 1, 300)]
    host = np.zeros((MAX_ROWS, V), np.int32)
    stream = cupy.cuda.get_current_stream()
    s.counts.fill(12345)                       # garbage a previous sequence left
    for slot, p in zip(slots, prompts):
        s.reset_counts(slot, p, stream)
        host[slot] = 0
        host[slot, p] = 1
    kinds = [dict(repetition_penalty=1.3, temperature=0.9, top_p=0.9),
             dict(frequency_penalty=0.7, presence_penalty=0.4, top_k=30),
             dict(repetition_penalty=0.9, presence_penalty=-0.5, temperature=0.0)]
    fed = [int(p[-1]) for p in prompts]
    for step in range(8):
        logits = llm_like(rng, 3, V)
        rows = [SampleRow(seed=100 + i, step=step, **kinds[i]) for i in range(3)]
        toks = gpu_sample(kernels, s, logits, rows, slots, fed)[0]
        for i, slot in enumerate(slots):
            host[slot, fed[i]] += 2
            assert int(toks[i]) == sample_logits(logits[i], rows[i], host[slot]), (step, i)
        fed = [int(t) for t in toks]
    for slot in slots:
        assert np.array_equal(s.counts[slot].get(), host[slot])


def _mask_words(allowed):
    from realizar_backend.backends.sampling import mask_words
    words = np.zeros(mask_words(allowed.size) * 4, np.uint8)
    packed = np.packbits(allowed, bitorder="little")
    words[:packed.size] = packed
    return words.view(np.int32)


@pytest.mark.parametrize("V", [1000, 32001, 151936, 262144])
def test_constrained_rows_match_twin(kernels, rng, V):
    """Rows with an allowed-token mask (grammar), a logit bias, both, and with penalties, beside
    plain rows: the GPU draws the twin's token, never a masked one, and the plain rows draw what
    they draw in a batch without constrained rows."""
    import cupy

    from realizar_backend.backends.base import LogitBias
    from realizar_backend.backends.sampling import allowed_tokens
    s = sampler(V)
    stream = cupy.cuda.get_current_stream()
    for rep in range(3):
        logits = llm_like(rng, MAX_ROWS, V)
        best = np.argmax(logits, axis=1)

        def mask(r, density):
            allowed = rng.random(V) < density
            allowed[best[r]] = False                 # the raw favourite is forbidden
            allowed[rng.integers(0, V)] = True
            return _mask_words(allowed)

        def bias(n):
            n = min(n, V // 2)
            return LogitBias(rng.choice(V, n, replace=False).astype(np.int32),
                             rng.uniform(-100, 100, n).astype(np.float32))

        kinds = [dict(temperature=0.0, mask=mask(0, 0.3)), dict(temperature=0.8, top_p=0.9, mask=mask(1, 0.001)),
                 dict(), dict(top_k=40, logit_bias=bias(300)), dict(temperature=0.0),
                 dict(temperature=0.0, logit_bias=LogitBias(np.array([V - 1], np.int32), np.array([100.0], np.float32))),
                 dict(min_p=0.05, mask=mask(6, 0.5), logit_bias=bias(1024), repetition_penalty=1.2, logprobs=True),
                 dict(temperature=0.0, mask=mask(7, 0.02), frequency_penalty=0.5)]
        rows = [SampleRow(seed=int(rng.integers(0, 2 ** 63)), step=rep, **k) for k in kinds]
        slots = list(range(MAX_ROWS))
        fed = [int(t) for t in rng.integers(0, V, MAX_ROWS)]
        host = np.zeros((MAX_ROWS, V), np.int32)
        for i, row in enumerate(rows):
            if row.penalties:
                s.reset_counts(slots[i], np.zeros(0, np.int32), stream)
                host[i, fed[i]] += 2
        toks, top, lp, top_lp = gpu_sample(kernels, s, logits, rows, slots, fed)
        for i, row in enumerate(rows):
            want = sample_logits(logits[i], row, host[i] if row.penalties else None)
            if row.mask is not None:
                assert allowed_tokens(row.mask, V)[toks[i]], (V, i)
            if toks[i] != want:
                dr = draw_detail(logits[i], row, host[i] if row.penalties else None)
                assert dr is not None and dr.boundary_distance() < 1e-6, (V, i, toks[i], want)
                print(f"near-tie disagreement V={V} row {i}: gpu {toks[i]} twin {want}")
        plain = [i for i, r in enumerate(rows) if not r.constrained and not r.penalties]
        alone = gpu_sample(kernels, s, logits[plain], [rows[i] for i in plain])[0]
        assert alone.tolist() == [int(toks[i]) for i in plain]


# ------------------------------------------------------------------ the whole engine on CUDA

def _smol_path():
    from test_model_parity import _real_smol
    p = _real_smol()
    return None if p is None else str(p)


@pytest.fixture(scope="module")
def cuda_engine():
    path = _smol_path()
    if path is None:
        pytest.skip("SmolLM2 not on this machine")
    from realizar_backend.engine.engine import Engine
    from realizar_backend.settings import Settings
    eng = Engine.from_settings(Settings(model=path, backend="cuda", max_num_seqs=4, context_length=256,
                                        self_check=False))
    yield eng
    eng.shutdown()


def _run(engine, prompt, **kw):
    from realizar_backend.engine.sampling import SamplingParams
    params = SamplingParams(**kw)
    outs = list(engine.generate_sync(engine.prepare(prompt, params), params))
    return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs


def test_engine_seeded_requests_reproduce(cuda_engine):
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a = _run(cuda_engine, "Once upon a time", **kw)
    b = _run(cuda_engine, "Once upon a time", **kw)
    assert a[0] == b[0] and a[1] == b[1]
    others = {_run(cuda_engine, "Once upon a time", **{**kw, "seed": s})[0] for s in range(4)}
    assert len(others) > 1
    kw = dict(max_tokens=16, temperature=0.8, top_k=40, min_p=0.05, repetition_penalty=1.2,
              frequency_penalty=0.3, presence_penalty=0.2, seed=7)
    assert _run(cuda_engine, "My favourite food is", **kw)[1] == _run(cuda_engine, "My favourite food is", **kw)[1]


def test_engine_greedy_is_unchanged(cuda_engine):
    from realizar_backend.backends.base import PrefillItem
    prompt = "The capital of France is"
    text, toks, _ = _run(cuda_engine, prompt, max_tokens=12, temperature=0)
    be = cuda_engine.backend
    ids = cuda_engine.tokenizer.encode(prompt)
    slot = be.max_slots - 1   # the engine is idle: any slot and free block is ours for a moment
    cuda_engine.kv.allocate("plain", lambda a, b: ids[a:b], len(ids) + 12)
    be.set_block_table(slot, cuda_engine.kv.table("plain"))
    want = [int(np.argmax(be.prefill([PrefillItem(slot, np.array(ids, np.int32))])[0]))]
    for i in range(11):
        want.append(int(greedy_step(be, [slot], [want[-1]], [len(ids) + i])[0]))
    be.release(slot)
    cuda_engine.kv.free("plain")
    assert toks == want
    # greedy with logprobs goes through the sampling kernels: same tokens, the chosen one on top
    _, toks_lp, outs = _run(cuda_engine, prompt, max_tokens=12, temperature=0, logprobs=1)
    assert toks_lp == want
    for o in outs:
        for tok_text, lp, top in o.logprobs or []:
            assert lp <= 0 and top[0][1] == pytest.approx(lp, abs=1e-4)


def test_engine_constrained_requests(cuda_engine):
    """Constrained decoding on the CUDA backend: schema output validates (greedy and sampled, the
    masks filled while each step's forward pass runs), a logit bias forces its token on the
    decoded steps, and plain greedy rows batched with constrained rows keep their text (buckets
    below 8 rows compute each row alone)."""
    import asyncio
    import json

    import jsonschema

    from realizar_backend.engine.guidance import Constraint
    from realizar_backend.engine.sampling import SamplingParams
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "size": {"enum": ["small", "large"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "size", "count"], "additionalProperties": False}
    c = Constraint("json_schema", schema)

    async def run(prompt, **kw):
        params = SamplingParams(**kw)
        ids = cuda_engine.prepare(prompt, params)
        outs = [o async for o in cuda_engine.generate(ids, params)]
        return "".join(o.text for o in outs), outs[-1].finish_reason, [t for o in outs for t in o.token_ids]

    def together(jobs):
        async def go():
            return await asyncio.gather(*[run(p, **kw) for p, kw in jobs])
        return asyncio.run(go())

    plain = [("The capital of France is", dict(max_tokens=16, temperature=0, ignore_eos=True)),
             ("One, two, three,", dict(max_tokens=16, temperature=0, ignore_eos=True))]
    alone = [together([job])[0] for job in plain]
    mixed = together([plain[0], ("An item as JSON:", dict(max_tokens=48, temperature=0, constraint=c)),
                      plain[1], ("An item as JSON:", dict(max_tokens=48, temperature=0.9, seed=4, constraint=c))])
    assert [mixed[0], mixed[2]] == alone
    for text, reason, _ in (mixed[1], mixed[3]):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    forced = alone[0][2][0] + 7
    _, _, toks = together([(plain[0][0], dict(max_tokens=6, temperature=0, ignore_eos=True,
                                               logit_bias={forced: 100}))])[0]
    assert toks == [forced] * 6
