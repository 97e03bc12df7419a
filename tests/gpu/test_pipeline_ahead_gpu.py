"""Continuations over another batch on the GPU (prev_rows): decode_io_merge against its NumPy twin,
and CUDABackend steps whose kept rows' tokens never pass through the host give the tokens of the
same steps run on host inputs (greedy, sampled, and the two alternating: a sampled continuation of
a step the forward pass's argmax answered, and the reverse; rows moving, leaving and joining,
buckets changing), also with more steps in flight than the token ring has rows; the engine on the
GPU gives the same tokens with and without steps started ahead while rows finish and sequences
arrive."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from support.paging import contiguous_tables

pytestmark = pytest.mark.gpu

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))


def merge_twin(io: np.ndarray, stage: np.ndarray, n: int, b: int, scratch_slot: int, ring_row: int) -> np.ndarray:
    """elementwise.cu decode_io_merge: row j < n of the inputs is row stage[3, j] of the previous
    outputs (token, next position, slot), or stage[0..2, j] where that is -1; rows n..b-1 padding."""
    out = io.copy()
    for j in range(n):
        src = stage[3, j]
        out[:3, j] = io[:3, src] if src >= 0 else stage[:3, j]
    out[0, n:b], out[1, n:b], out[2, n:b] = 0, 0, scratch_slot
    out[3, :b] = ring_row
    return out


@pytest.mark.parametrize("n_prev,n,b", [(5, 3, 4), (3, 7, 8), (64, 64, 64), (200, 130, 256), (1, 1, 1)])
def test_decode_io_merge_matches_its_twin(kernels, rng, n_prev, n, b):
    import cupy
    from realizar_backend.backends.cuda import ops
    stride = 256
    io = rng.integers(0, 1 << 20, (4, stride)).astype(np.int32)
    stage = rng.integers(0, 1 << 20, (4, stride)).astype(np.int32)
    kept = rng.permutation(n_prev)[:rng.integers(0, min(n, n_prev) + 1)]
    src = np.full(n, -1, np.int32)
    src[rng.permutation(n)[:kept.size]] = kept          # kept rows anywhere, in any order
    stage[3, :n] = src
    d_io, d_stage = cupy.asarray(io), cupy.asarray(stage)
    ops.decode_io_merge(kernels, d_io.data.ptr, stride, d_stage.data.ptr, n, b, 999, 3)
    np.testing.assert_array_equal(d_io.get(), merge_twin(io, stage, n, b, 999, 3))


def _backend(name, rng, slots=4):
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded")
    model = open_model(path)
    gpu = contiguous_tables(CUDABackend(model, max_slots=slots, max_context=128, settings=Settings(self_check=False)))
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, 9 + s).astype(np.int32) for s in range(slots)]

    def prefill():
        logits = gpu.prefill([PrefillItem(s, p) for s, p in enumerate(prompts)])
        for s, p in enumerate(prompts):
            gpu.reset_counts(s, p)
        return [int(t) for t in logits.argmax(-1)]
    return gpu, prompts, prefill


def _row(step):
    from realizar_backend.backends.base import SampleRow
    return SampleRow(temperature=0.9, top_k=40, seed=11, step=step, repetition_penalty=1.2, presence_penalty=0.3)


# each step's batch as (slot, row of the previous step or -1: the host's token at the slot's next
# position); rows move, leave, join; the bucket goes 4 -> 4 -> 4 -> 2 -> 4 -> 1
PLAN = [[(0, -1), (1, -1), (2, -1)],
        [(1, 1), (0, 0), (2, 2)],
        [(0, 1), (3, -1), (1, 0)],
        [(3, 1), (1, 2)],
        [(1, 1), (0, -1), (3, 0), (2, -1)],
        [(2, 3)]]


@pytest.mark.parametrize("name", ["qwen05", "qwen15"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "alternating"])
def test_continuations_over_another_batch_give_the_host_inputs_tokens(name, kind, rng):
    """Eager: every step on host inputs, read before the next. Piped: every step after the first a
    continuation, all executed and sampled before any is read (more than the token ring's rows);
    the host reads a step early only where a new row needs its slot's last token."""
    from realizar_backend.backends.base import GREEDY, Step
    gpu, prompts, prefill = _backend(name, rng)

    def run(piped):
        first = prefill()                     # the same KV rows and counts again
        pos = {s: len(p) for s, p in enumerate(prompts)}
        drawn = dict.fromkeys(range(4), 0)
        last: dict[int, tuple[int, int]] = {}          # slot -> (step, row) that decoded it last
        handles, got = [], {}

        def result(i):
            if i not in got:
                got[i] = gpu.result(handles[i]).tokens.tolist()
            return got[i]

        def token(s):
            return first[s] if s not in last else result(last[s][0])[last[s][1]]

        for i, batch in enumerate(PLAN):
            slots = [s for s, _ in batch]
            p = [pos[s] for s in slots]
            if piped and i > 0:
                step = Step(slots=slots, tokens=[token(s) if r < 0 else 0 for s, r in batch], positions=p,
                            prev_rows=[r for _, r in batch])
            else:
                step = Step(slots=slots, tokens=[token(s) for s in slots], positions=p)
            h = gpu.execute(step)
            sampled = kind == "sampled" or (kind == "alternating" and i % 2 == 1)
            gpu.sample(h, [_row(drawn[s]) if sampled else GREEDY for s in slots])
            handles.append(h)
            if not piped:
                result(i)
            for j, s in enumerate(slots):
                pos[s] += 1
                drawn[s] += 1
                last[s] = (i, j)
        return [dict(zip([s for s, _ in batch], result(i))) for i, batch in enumerate(PLAN)]

    eager = run(False)
    assert run(True) == eager
    gpu.close()


def test_engine_steps_ahead_match_unpipelined_on_the_gpu():
    """The engine on the CUDA backend (qwen05 twin): rows reaching max_tokens at different steps,
    sequences arriving while others decode, greedy and seeded sampling with penalties: the same
    tokens with and without steps started ahead; pipelined, no step waits for a finishing row, a
    prefill or a batch whose rows switch between plain greedy and sampled."""
    from realizar_backend.engine.engine import Engine
    from realizar_backend.engine.sampling import SamplingParams
    from realizar_backend.settings import Settings
    path = TWINS / "qwen05.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded")
    # (prompt, max_tokens, sampling, arrives once the first stream has this many tokens)
    greedy = [("Stream 0 says", 40, {}, 0)] + [(f"Stream {i} says", 5 + 4 * i, {}, 3 * (i // 2)) for i in range(1, 8)]
    mixed = greedy[:4] + [(f"Sampled {i}", 9 + 3 * i, {"temperature": 0.8, "seed": i, "repetition_penalty": 1.2}, 4 + i)
                          for i in range(3)]

    async def one(eng, seen, prompt, n, kw, after):
        while seen[0] < after:
            await asyncio.sleep(0.0005)
        params = SamplingParams(max_tokens=n, ignore_eos=True, **{"temperature": 0.0, **kw})
        toks = []
        async for o in eng.generate(eng.prepare(prompt, params), params):
            toks += o.token_ids
            if after == 0 and prompt == "Stream 0 says":
                seen[0] = len(toks)
        return toks

    for jobs in (greedy, mixed):
        got, steps = {}, {}
        for pipelined in (False, True):
            eng = Engine.from_settings(Settings(model=str(path), backend="cuda", max_num_seqs=8, context_length=256,
                                                self_check=False), pipelined=pipelined)
            try:
                async def all_():
                    seen = [0]
                    return await asyncio.gather(*[one(eng, seen, *j) for j in jobs])
                got[pipelined] = asyncio.run(all_())
                steps[pipelined] = eng.stats()["decode_steps"]
            finally:
                eng.shutdown()
        assert got[True] == got[False]
        assert [len(t) for t in got[True]] == [j[1] for j in jobs]
        on = steps[True]
        assert on["prefill"] == on["finishing"] == on["no_block"] == on["off"] == on["kind"] == 0
        assert on["ahead"] > 0
