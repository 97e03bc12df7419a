"""Decode steps started ahead across changes of the batch, on the real SmolLM2 (NumPy backend).

Protocol: a continuation over another batch (prev_rows: some of the previous step's rows, in any
order, plus new rows with host inputs) gives the tokens of the same step run with host inputs,
greedy and sampled (seeded draws, penalties counting the fed token).
Engine: sequences that finish at different steps (max_tokens), others that arrive while the batch
decodes, and one cancelled: each sequence's tokens are the same with and without the pipeline, the
steps start ahead across both (realizar_decode_steps_total counts them), and every KV block is free
at the end."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from realizar_backend.backends import GREEDY, PrefillItem, SampleRow, Step, run_step
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.engine.engine import Engine
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.settings import Settings

PROMPTS = [[1, 504, 3458, 282], [1, 9690, 17, 2397, 314], [1, 2593, 253], [1, 1978, 1162, 744, 29]]


def _backend(model):
    be = CPUBackend(model, max_slots=4, max_context=64)
    for s in range(4):
        be.set_block_table(s, list(range(s * 4, s * 4 + 4)))
    logits = be.prefill([PrefillItem(s, np.asarray(p, np.int32), 0) for s, p in enumerate(PROMPTS)])
    for s, p in enumerate(PROMPTS):
        be.reset_counts(s, np.asarray(p, np.int32))
    return be, [int(t) for t in logits.argmax(-1)]


def _row(step):
    return SampleRow(temperature=0.9, top_k=40, seed=11, step=step, repetition_penalty=1.2, presence_penalty=0.3)


# each step's batch, as (slot, previous row or -1); -1 rows are fed the host's token at the slot's
# next position. Rows move, leave (slot 2 after step 1), and join (slot 3 at step 2).
PLAN = [[(0, -1), (1, -1), (2, -1)],
        [(1, 1), (0, 0), (2, 2)],
        [(0, 1), (3, -1), (1, 0)],
        [(3, 1), (1, 2)],
        [(1, 1), (0, -1), (3, 0)]]


@pytest.mark.parametrize("sampled", [False, True])
def test_a_continuation_over_another_batch_gives_the_tokens_of_host_inputs(smol_model, sampled):
    def run(piped):
        be, first = _backend(smol_model)
        toks, pos = {s: first[s] for s in range(4)}, {s: len(PROMPTS[s]) for s in range(4)}
        drawn = {s: 0 for s in range(4)}
        out = []
        for i, batch in enumerate(PLAN):
            slots = [s for s, _ in batch]
            prev = [r for _, r in batch]
            if piped and i > 0:
                feed = [toks[s] if r < 0 else -7 for s, r in batch]      # kept rows: the backend's own
                step = Step(slots=slots, tokens=feed, positions=[pos[s] for s in slots], prev_rows=prev)
            else:
                step = Step(slots=slots, tokens=[toks[s] for s in slots], positions=[pos[s] for s in slots])
            ids = run_step(be, step, [_row(drawn[s]) if sampled else GREEDY for s in slots]).tokens
            for s, t in zip(slots, ids):
                toks[s], pos[s], drawn[s] = int(t), pos[s] + 1, drawn[s] + 1
            out.append(dict(zip(slots, ids.tolist())))
        return out

    assert run(True) == run(False)


def test_a_continuation_names_the_rows_it_keeps(smol_model):
    be, first = _backend(smol_model)
    h = be.execute(Step(slots=[0, 1], tokens=first[:2], positions=[4, 5]))
    with pytest.raises(ValueError):
        be.execute(Step(slots=[0, 1]))                            # the step it continues is not sampled
    be.sample(h, [GREEDY, GREEDY])
    with pytest.raises(ValueError):
        be.sample(h, [GREEDY, GREEDY])                            # a step is sampled once
    with pytest.raises(ValueError):
        be.execute(Step(slots=[1, 0], prev_rows=[0, 1]))          # row 0 was slot 0, not slot 1
    with pytest.raises(ValueError):
        be.execute(Step(slots=[0, 0], prev_rows=[0, 0]))          # a row kept twice
    with pytest.raises(ValueError):
        be.execute(Step(slots=[0, 2], prev_rows=[0, -1]))         # a new row without its token
    nxt = be.execute(Step(slots=[1, 0], prev_rows=[1, 0]))
    be.execute(Step(prompts=[PrefillItem(2, np.asarray(PROMPTS[2], np.int32), 0)]))
    with pytest.raises(ValueError):
        be.sample(nxt, [GREEDY, GREEDY])                          # another step ran since it was executed
    assert be.result(nxt) is None                                 # never sampled: nothing comes back


BASE = dict(backend="cpu", max_num_seqs=4, context_length=128)
# (prompt, max_tokens, sampling, arrives after the first stream has this many tokens, cancel after)
JOBS = [("The capital of France is", 14, {}, 0, None),
        ("Once upon a time", 5, {}, 0, None),
        ("def add(a, b):", 9, {"temperature": 0.8, "seed": 5}, 2, None),
        ("Roses are red,", 4, {}, 4, None),
        ("A list of fruits:", 12, {"temperature": 0.7, "seed": 2, "frequency_penalty": 0.4}, 6, 5),
        ("The sun", 3, {}, 9, None)]


def _run_all(engine, jobs):
    async def one(first_seen, prompt, max_tokens, kw, after, cancel):
        while first_seen[0] < after:
            await asyncio.sleep(0.001)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **kw})
        toks = []
        agen = engine.generate(engine.prepare(prompt, params), params)
        async for o in agen:
            toks += o.token_ids
            if after == 0 and prompt == jobs[0][0]:
                first_seen[0] = len(toks)
            if cancel is not None and len(toks) >= cancel:
                await agen.aclose()
                break
        return toks

    async def go():
        seen = [0]
        return await asyncio.gather(*[one(seen, *j) for j in jobs])
    return asyncio.run(go())


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "mixed"])
def test_engine_tokens_are_the_same_with_and_without_steps_started_ahead(smol_model, sampled):
    """Rows reach max_tokens at different steps and sequences arrive while others decode (one is
    cancelled): the same tokens either way; pipelined, no step waits for a finishing row or a
    prefill, and at the end the KV pool is empty."""
    jobs = JOBS if sampled else [(p, n, {}, a, None) for p, n, _, a, _ in JOBS]
    got, steps = {}, {}
    for pipelined in (False, True):
        eng = Engine.from_settings(Settings(**BASE), prewarm_guidance=False, pipelined=pipelined)
        try:
            got[pipelined] = _run_all(eng, jobs)
            deadline = time.monotonic() + 10
            while eng.stats()["kv_used_blocks"] and time.monotonic() < deadline:
                time.sleep(0.01)
            st = eng.stats()
            assert st["kv_used_blocks"] == 0 and st["running"] == 0
            steps[pipelined] = st["decode_steps"]
        finally:
            eng.shutdown()
    assert got[True] == got[False]
    assert [len(t) for t in got[True]] == [n if c is None else c for _, n, _, _, c in jobs]
    off, on = steps[False], steps[True]
    assert off["ahead"] == 0 and off["off"] > 0
    # started ahead across rows finishing and arrivals, greedy and sampled rows alike; not ahead
    # only where no decode ran before and after the cancellation (its step is waited for)
    assert on["prefill"] == on["finishing"] == on["no_block"] == on["off"] == on["kind"] == 0
    assert on["changed"] <= 1
    assert on["ahead"] == sum(on.values()) - on["start"] - on["changed"] > 2 * (on["start"] + on["changed"])


def test_a_row_that_stops_on_a_stop_token_frees_its_blocks_after_the_step_ahead(smol_model):
    """A sequence that stops on its own (EOS, a stop string) is known only once its token is read,
    after the step after it was started with it: that step's output for it is dropped, and its
    blocks come free once that step is done, also when nothing else runs."""
    eng = Engine.from_settings(Settings(**BASE), prewarm_guidance=False)
    try:
        async def go():
            async def one(prompt, **kw):
                params = SamplingParams(temperature=0.0, **kw)
                out = []
                async for o in eng.generate(eng.prepare(prompt, params), params):
                    out.append(o)
                return "".join(o.text for o in out), out[-1].finish_reason
            return await asyncio.gather(one("The capital of France is", max_tokens=20, stop=["e"]),
                                        one("Once upon a time", max_tokens=20, stop=["a"]),
                                        one("1, 2, 3,", max_tokens=12))
        res = asyncio.run(go())
        assert res[0][1] == "stop" and res[1][1] == "stop"
        deadline = time.monotonic() + 10
        while eng.stats()["kv_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
        assert st["kv_used_blocks"] == 0 and st["running"] == 0
        assert st["decode_steps"]["changed"] >= 1 or st["decode_steps"]["ahead"] > 0
    finally:
        eng.shutdown()
