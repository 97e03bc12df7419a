"""Pipelined sampled decode steps (Backend.execute / sample / result, engine/pipeline.py's
DecodePipeline.step), on the real SmolLM2 (NumPy backend): the step after one is started on the
tokens the backend sampled before the host reads them, and the tokens are the unpipelined
ones: seeded draws, penalties (the fed token counted once), logit bias and masks that depend on the
previous token; in the engine, constrained JSON, penalties and seeded sampling give the same text
with and without the pipeline, also when sequences finish or are cancelled while a step is started
ahead."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from support.pipeline_rows import STEPS, fill_masks as _fill, rows as _rows

from realizar_backend.backends import PrefillItem, Step, run_step
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.backends.sampling import mask_words
from realizar_backend.engine.engine import Engine
from realizar_backend.engine.guidance import Constraint
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.settings import Settings

BASE = dict(backend="cpu", max_num_seqs=4, context_length=256)
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "size": {"enum": ["small", "large"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "size", "count"], "additionalProperties": False}


def _setup(model, prompt):
    be = CPUBackend(model, max_slots=4, max_context=64)
    for s in range(4):
        be.set_block_table(s, list(range(s * 4, s * 4 + 4)))
    logits = be.prefill([PrefillItem(s, prompt, 0) for s in range(4)])
    be.reset_counts(1, prompt)
    first = [int(np.argmax(logits[s])) for s in range(4)]
    return be, first


def test_pipelined_protocol_gives_the_eager_tokens(smol_model):
    prompt = np.array([1, 504, 3458, 282, 4649, 314], np.int32)
    V = smol_model.config.vocab_size
    slots = [0, 1, 2, 3]

    be, toks = _setup(smol_model, prompt)
    masks = np.zeros((2, mask_words(V)), np.int32)
    eager = []
    for i in range(STEPS):
        prev = list(toks)
        res = run_step(be, Step(slots=slots, tokens=toks, positions=[len(prompt) + i] * 4), _rows(i, masks),
                       lambda: _fill(masks, prev, V))
        toks = res.tokens.tolist()
        eager.append(toks)

    be, toks = _setup(smol_model, prompt)
    masks = np.zeros((2, mask_words(V)), np.int32)
    piped, prev = [], list(toks)
    h = be.execute(Step(slots=slots, tokens=toks, positions=[len(prompt)] * 4))
    for i in range(STEPS):
        be.sample(h, _rows(i, masks), lambda: _fill(masks, prev, V))
        nxt = be.execute(Step(slots=slots)) if i + 1 < STEPS else None
        prev = be.result(h).tokens.tolist()    # read after the next step started
        piped.append(prev)
        h = nxt
    assert piped == eager
    # a masked row never drew a refused token
    flat = np.array(eager)
    assert all(flat[i, 2] % 3 != flat[i - 1, 2] % 3 for i in range(1, STEPS))


def test_a_dropped_continuation_gives_nothing_and_the_next_step_starts_fresh(smol_model):
    prompt = np.array([1, 504, 3458, 282], np.int32)
    be, toks = _setup(smol_model, prompt)
    masks = np.zeros((2, mask_words(smol_model.config.vocab_size)), np.int32)
    h = be.execute(Step(slots=[0, 1], tokens=toks[:2], positions=[4, 4]))
    be.sample(h, _rows(0, masks)[:2])
    ahead = be.execute(Step(slots=[0, 1]))
    got = be.result(h).tokens.tolist()
    assert be.result(ahead) is None                        # dropped, never sampled
    with pytest.raises(ValueError):
        be.execute(Step(slots=[0, 1]))                     # nothing sampled to continue
    res = run_step(be, Step(slots=[0, 1], tokens=got, positions=[5, 5]), _rows(1, masks)[:2])
    assert len(res.tokens) == 2


async def _run(engine, prompt, cancel_after=None, **kw):
    params = SamplingParams(**kw)
    ids = engine.prepare(prompt, params)
    toks, text, reason = [], "", None
    agen = engine.generate(ids, params)
    async for o in agen:
        toks += o.token_ids
        text += o.text
        reason = o.finish_reason
        if cancel_after is not None and len(toks) >= cancel_after:
            await agen.aclose()
            reason = "cancelled"
            break
    return text, reason, toks


JOBS = [("An item as JSON:", dict(max_tokens=60, temperature=0.8, seed=4, constraint=Constraint("json_schema", ITEM))),
        ("The capital of France is", dict(max_tokens=16, temperature=0.9, seed=9, ignore_eos=True,
                                          repetition_penalty=1.3, frequency_penalty=0.5)),
        ("Once upon a time", dict(max_tokens=20, temperature=0.7, top_p=0.9, seed=123, ignore_eos=True,
                                  cancel_after=6)),
        ("def add(a, b):", dict(max_tokens=9, temperature=1.0, seed=1, ignore_eos=True,
                                logit_bias={13: 2.0}))]


def _all(engine):
    async def go():
        return await asyncio.gather(*[_run(engine, p, **kw) for p, kw in JOBS])
    return asyncio.run(go())


def test_engine_sampled_text_is_the_same_with_and_without_the_pipeline(smol_model):
    """Constrained JSON, penalties, a cancellation after 6 tokens and sequences ending (length, the
    grammar) while the next step is started ahead: each sequence's tokens are the same pipelined
    and not."""
    got = {}
    for pipelined in (False, True):
        eng = Engine.from_settings(Settings(**BASE), pipelined=pipelined)
        try:
            got[pipelined] = _all(eng)
        finally:
            eng.shutdown()
    assert [t for _, _, t in got[True]] == [t for _, _, t in got[False]]
    piped = got[True]
    assert piped[0][1] == "stop" and piped[1][1] == "length" and piped[2][1] == "cancelled"
    assert len(piped[2][2]) == 6 and len(piped[3][2]) == 9
