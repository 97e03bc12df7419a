"""Pipelined sampled steps on the GPU (CUDABackend.execute / sample / result): the step after one
runs on the tokens sample_final wrote into the decode inputs, executed before the host reads them, and gives the eager path's tokens and logprobs, step for step, on the qwen05 and
qwen15 twins: seeded draws, penalties on device counts, masks that depend on the previous token,
a logit bias, a padded bucket (3 rows in bucket 4); a continuation dropped unsampled gives nothing
and the next step with host inputs is the eager one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from support.paging import contiguous_tables
from support.pipeline_rows import STEPS, fill_masks, rows
from realizar_backend.backends import Step, run_step

pytestmark = pytest.mark.gpu

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))


def _backend(name, rng):
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded")
    model = open_model(path)
    gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=128, settings=Settings(self_check=False)))
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, 9 + s).astype(np.int32) for s in range(4)]
    return gpu, prompts, V


def _prefill(gpu, prompts):
    from realizar_backend.backends.base import PrefillItem
    logits = gpu.prefill([PrefillItem(s, p) for s, p in enumerate(prompts)])
    for s, p in enumerate(prompts):
        gpu.reset_counts(s, p)
    return [int(t) for t in logits.argmax(-1)]


@pytest.mark.parametrize("name", ["qwen05", "qwen15"])
@pytest.mark.parametrize("n", [4, 3])
def test_pipelined_sampled_steps_give_the_eager_tokens(name, n, rng):
    from realizar_backend.backends.sampling import mask_words
    gpu, prompts, V = _backend(name, rng)
    slots = list(range(n))
    pos = [len(p) for p in prompts[:n]]
    masks = np.zeros((2, mask_words(V)), np.int32)

    def step_rows(i):
        r = rows(i, masks)
        return r[:2] + r[3:] if n == 3 else r        # 3 rows: one masked row (the sampled, biased one)

    def fill(prev):
        p = list(prev) + [prev[-1]] if n == 3 else prev
        fill_masks(masks, p, V)
        if n == 3:
            masks[0] = masks[1]

    toks = _prefill(gpu, prompts)[:n]
    eager, elp = [], []
    for i in range(STEPS):
        prev = list(toks)
        res = run_step(gpu, Step(slots=slots, tokens=toks, positions=[p + i for p in pos]), step_rows(i),
                       lambda: fill(prev))
        toks = res.tokens.tolist()
        eager.append(toks)
        elp.append(res.logprobs[0])

    toks = _prefill(gpu, prompts)[:n]                    # the same KV rows and counts again
    piped, plp, prev = [], [], list(toks)
    h = gpu.execute(Step(slots=slots, tokens=toks, positions=pos))
    for i in range(STEPS):
        gpu.sample(h, step_rows(i), lambda: fill(prev))
        nxt = gpu.execute(Step(slots=slots)) if i + 1 < STEPS else None
        res = gpu.result(h)
        prev = res.tokens.tolist()
        piped.append(prev)
        plp.append(res.logprobs[0])
        h = nxt
    assert piped == eager
    np.testing.assert_allclose(plp, elp, rtol=0, atol=1e-6)

    # a continuation dropped unsampled, then a step with host inputs: the eager step's tokens
    toks = _prefill(gpu, prompts)[:n]
    h = gpu.execute(Step(slots=slots, tokens=toks, positions=pos))
    gpu.sample(h, step_rows(0), lambda: fill(toks))
    ahead = gpu.execute(Step(slots=slots))
    first = gpu.result(h).tokens.tolist()
    assert gpu.result(ahead) is None
    assert first == eager[0]
    prev = first
    res = run_step(gpu, Step(slots=slots, tokens=first, positions=[p + 1 for p in pos]), step_rows(1),
                   lambda: fill(prev))
    assert res.tokens.tolist() == eager[1]
    gpu.close()


def test_engine_sampled_pipeline_matches_unpipelined_on_the_gpu():
    """The engine on the CUDA backend (qwen05 twin), seeded sampling with penalties, a JSON schema
    (the twin's tokenizer) and a biased greedy row, pipelined and not: the same tokens. Requests run
    one at a time, so that prefills batch the same way in both runs (the CPU tests cover batches
    whose rows finish or are cancelled mid-pipeline)."""
    import asyncio

    from realizar_backend.engine.engine import Engine
    from realizar_backend.engine.guidance import Constraint
    from realizar_backend.engine.sampling import SamplingParams
    from realizar_backend.settings import Settings
    path = TWINS / "qwen05.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"], "additionalProperties": False}
    jobs = [dict(max_tokens=40, temperature=0.8, seed=4, constraint=Constraint("json_schema", schema)),
            dict(max_tokens=24, temperature=0.9, seed=9, ignore_eos=True, repetition_penalty=1.3,
                 frequency_penalty=0.5),
            dict(max_tokens=17, temperature=0.0, ignore_eos=True, logit_bias={13: 2.0})]

    async def one(eng, kw):
        params = SamplingParams(**kw)
        ids = eng.prepare("Hello there, give me", params)
        return [t async for o in eng.generate(ids, params) for t in o.token_ids]

    async def all_(eng):
        return [await one(eng, kw) for kw in jobs]

    got = {}
    for pipelined in (False, True):
        eng = Engine.from_settings(Settings(model=str(path), backend="cuda", max_num_seqs=4, context_length=256,
                                            self_check=False), pipelined=pipelined)
        try:
            got[pipelined] = asyncio.run(all_(eng))
        finally:
            eng.shutdown()
    assert got[True] == got[False]
    assert [len(t) for t in got[True]][1:] == [24, 17]
