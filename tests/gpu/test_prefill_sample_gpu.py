"""A sequence's first token sampled on the GPU (a prompt step: CUDABackend.execute / sample /
result): the decode steps' sampler run on the prompt step's last-row logits gives the NumPy twin's token for those logits and
seed (greedy under a logit bias, greedy and sampled with penalties on the prompt's counts, top-k/p,
min-p, a mask, logprobs), and the NumPy backend's token wherever the twin draws the same token
from both backends' logits; a chunk in the middle of a prompt draws nothing. Only tokens come back to the host
(16 bytes a row, 4 when every row is a plain argmax), the logits only of a row that asks for them;
and the engine serves first tokens (greedy, sampled, logprobs, a grammar) without ever asking the
backend for a row of logits."""

from __future__ import annotations

import numpy as np
import pytest
from support.paging import contiguous_tables
from realizar_backend.backends import Step, run_step
from test_model_parity import TWINS, _open, _real_smol

pytestmark = pytest.mark.gpu

LENS = (9, 14, 30, 5, 21)       # item 2 is the first chunk of a longer prompt: it draws nothing


def _model(name):
    path = _real_smol() if name == "real" else TWINS / f"{name}.gguf"
    if path is None or not path.exists():
        pytest.skip(f"{name} not on this machine")
    return _open(path)


def _gpu(model):
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    return contiguous_tables(CUDABackend(model, max_slots=8, max_context=128, settings=Settings(self_check=False)))


def _mask(ids, V):
    from realizar_backend.backends.sampling import mask_words
    m = np.zeros(mask_words(V), np.int32)
    ids = np.asarray(ids, np.int64)
    np.bitwise_or.at(m, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)).view(np.int32))
    return m


def _rows(logits, seed):
    """The first draws of the five items, from their prompts' logits [5, V]: greedy with a bias
    that forces the 4th-ranked token; sampled with penalties, filters and logprobs; nothing (a
    chunk mid-prompt); sampled under a mask of the ranks 5..40, with its logits asked for;
    greedy with a repetition penalty."""
    from realizar_backend.backends.base import LogitBias, SampleRow
    V = logits.shape[1]
    order = np.argsort(-logits, axis=1, kind="stable")
    bias = LogitBias(np.array([order[0, 3]], np.int32), np.array([100.0], np.float32))
    return [SampleRow(temperature=0.0, seed=seed, logit_bias=bias),
            SampleRow(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                      frequency_penalty=0.5, seed=seed, logprobs=True),
            None,
            SampleRow(temperature=1.2, min_p=0.01, seed=seed + 100, mask=_mask(order[3, 5:40], V), want_logits=True),
            SampleRow(temperature=0.0, repetition_penalty=1.8, seed=seed)]


def _counts(prompt, V):
    c = np.zeros(V, np.int32)
    c[prompt] = 1
    return c


def _items(rng, V):
    from realizar_backend.backends.base import PrefillItem
    prompts = [rng.integers(0, V, n).astype(np.int32) for n in LENS]
    return prompts, [PrefillItem(s, p) for s, p in enumerate(prompts)]


@pytest.fixture
def host_copies(monkeypatch):
    """Bytes copied from device to host by cupy.ndarray.get while `on` is set (a list: append
    True to count)."""
    import cupy
    got, on = [], []
    own = cupy.ndarray.get

    def get(self, *a, **k):
        if on:
            got.append(int(self.nbytes))
        return own(self, *a, **k)
    monkeypatch.setattr(cupy.ndarray, "get", get)
    return got, on


@pytest.mark.parametrize("name", ["smol135", "qwen05", "real"])
def test_prompt_step_gives_the_twins_token_and_only_tokens(name, rng, host_copies):
    from realizar_backend.backends.base import SampleRow
    from realizar_backend.backends.sampling import draw_detail, raw_logprobs, sample_logits
    got, on = host_copies
    model = _model(name)
    gpu = _gpu(model)
    V = model.config.vocab_size
    prompts, items = _items(rng, V)
    for seed in range(4):
        on.append(True)
        logits = gpu.prefill(items)[:, :V]            # the reference: the same step's logits, copied back
        on.clear()
        assert sum(got) >= len(items) * 4 * V         # (the counter sees the copies)
        got.clear()
        rows = _rows(logits, seed)
        for s in (1, 4):
            gpu.reset_counts(s, prompts[s])
        on.append(True)
        res = run_step(gpu, Step(prompts=items), rows)
        on.clear()
        # the tokens, logprobs and the one row asked for: less than two rows of logits in all
        assert 4 * V <= sum(got) < 4 * V + 4096, got
        got.clear()
        assert res.tokens[2] == -1 and set(res.logits) == {3}
        assert np.array_equal(res.logits[3][:V], logits[3])
        assert res.top_ids.tolist() == [int(np.argmax(x)) for x in logits]
        for i, row in enumerate(rows):
            if row is None:
                continue
            counts = _counts(prompts[i], V) if row.penalties else None
            want = sample_logits(logits[i], row, counts)
            if int(res.tokens[i]) != want:      # the twin is bit-exact: only a CDF boundary may split them
                dr = draw_detail(logits[i], row, counts)
                assert dr is not None and dr.boundary_distance() < 1e-6, (name, seed, i, int(res.tokens[i]), want)
        assert int(res.tokens[0]) == int(rows[0].logit_bias.ids[0])
        lp, top, top_lp = raw_logprobs(logits[1], int(res.tokens[1]))
        assert res.logprobs[1] == pytest.approx(lp, abs=1e-4)
        assert res.top_logprobs[1] == pytest.approx(top_lp, abs=1e-4)
        assert np.isnan(res.logprobs[[0, 2, 3, 4]]).all()
        # every row a plain argmax (or nothing): the LM head's argmax, 4 bytes a row
        plain = [SampleRow(temperature=0.0)] * 2 + [None] + [SampleRow(temperature=0.0)] * 2
        on.append(True)
        res = run_step(gpu, Step(prompts=items), plain)
        on.clear()
        assert sum(got) < 4096, got
        got.clear()
        assert res.tokens.tolist() == [-1 if r is None else int(np.argmax(x)) for r, x in zip(plain, logits)]


@pytest.mark.parametrize("name", ["smol135", "real"])
def test_first_token_matches_the_numpy_backend(name, rng):
    """The same prompts, rows and seeds on both backends: the same first tokens, wherever the twin
    draws the same token from the two backends' logits (parity-close, not bit-equal: a draw on a
    CDF step may move); that is most draws."""
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.backends.sampling import draw_detail, sample_logits
    model = _model(name)
    cpu = contiguous_tables(CPUBackend(model, max_slots=8, max_context=128, kv_dtype=np.float16))
    gpu = _gpu(model)
    V = model.config.vocab_size
    prompts, items = _items(rng, V)
    lc, lg = cpu.prefill(items)[:, :V], gpu.prefill(items)[:, :V]
    compared = moved = 0
    for seed in range(8):
        rows = _rows(lc, seed)
        for be in (cpu, gpu):
            for s in (1, 4):
                be.reset_counts(s, prompts[s])
        tc = run_step(cpu, Step(prompts=items), rows).tokens
        tg = run_step(gpu, Step(prompts=items), rows).tokens
        for i, row in enumerate(rows):
            if row is None:
                assert tc[i] == tg[i] == -1
                continue
            counts = _counts(prompts[i], V) if row.penalties else None
            if sample_logits(lc[i], row, counts) != sample_logits(lg[i], row, counts):
                moved += 1              # the backends' logits differ enough to move this draw
                continue
            if int(tc[i]) != int(tg[i]):
                dr = draw_detail(lg[i], row, counts)
                assert dr is not None and dr.boundary_distance() < 1e-6, (name, seed, i, int(tc[i]), int(tg[i]))
            compared += 1
    print(f"{name}: {compared} first tokens compared, {moved} moved by the logits' differences")
    assert compared >= 8 and compared >= 3 * moved


def test_the_engine_reads_no_logits(host_copies):
    """The CUDA engine's first tokens (and the rest) come from its prompt and decode steps, sampled
    on the device: a backend whose prefill and decode (the calls that return logits) fail
    serves greedy, sampled, penalised, logprob and grammar requests, and the host copies of a
    request without top logprobs stay far below one row of logits."""
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.engine.engine import Engine
    from realizar_backend.engine.guidance import Constraint
    from realizar_backend.engine.sampling import SamplingParams
    from realizar_backend.model.tokenizer import Tokenizer
    from realizar_backend.settings import Settings

    class NoLogits(CUDABackend):
        def prefill(self, items):
            raise AssertionError("the engine asked for a prompt's logits")

        def decode(self, slots, tokens, positions):
            raise AssertionError("the engine asked for a decode step's logits")

    got, on = host_copies
    model = _model("real")
    settings = Settings(backend="cuda", max_num_seqs=4, context_length=256, self_check=False)
    eng = Engine(NoLogits(model, max_slots=4, max_context=256, settings=settings),
                 Tokenizer.from_model_file(model), settings)
    V = model.config.vocab_size

    def run(**kw):
        params = SamplingParams(**kw)
        outs = list(eng.generate_sync(eng.prepare("Name a colour:", params), params))
        return [t for o in outs for t in o.token_ids], outs

    try:
        for kw in (dict(temperature=0), dict(temperature=0.9, seed=3, top_p=0.9),
                   dict(temperature=0.8, seed=4, repetition_penalty=1.3, presence_penalty=0.4),
                   dict(temperature=0, logprobs=1),
                   dict(temperature=0.9, seed=5, constraint=Constraint("regex", "(red|green|blue) ?[a-z]*"))):
            on.append(True)
            toks, outs = run(max_tokens=6, **kw)
            on.clear()
            assert len(toks) >= 1 and outs[-1].finish_reason in ("length", "stop"), kw
            assert sum(got) < 4 * V, (kw, sum(got))
            got.clear()
        toks, outs = run(max_tokens=3, temperature=0, logprobs=3)       # top 3: the rows' logits come back
        assert all(len(o.logprobs[0][2]) == 3 for o in outs if o.logprobs)
    finally:
        eng.shutdown()
