"""Time to first token under a burst, in engine steps (NumPy backend, a tiny synthetic model): a
load test's wave of requests arrives together, and each request's first token must reach its
caller in the step that completes its prompt, not a step (or a sync) later. Steps, not seconds:
the count is what a GPU's step time multiplies."""

import threading

import numpy as np
import pytest

from realizar_backend.engine.engine import Engine
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.settings import Settings
from support.synth import write_gguf

BURST = 64
PROMPT = 128
BUDGET = 2048          # prefill_chunk_tokens: BUDGET // PROMPT prompts complete per step


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    m = write_gguf(tmp_path_factory.mktemp("burst") / "tiny.gguf", arch="qwen2", seed=1, context_length=1024)
    # no prefix cache: every burst's prompts are prefilled whole, as a load test's fresh ones
    eng = Engine.from_settings(Settings(backend="cpu", model=str(m.path), max_num_seqs=256, context_length=1024,
                                        prefill_chunk_tokens=BUDGET, enable_prefix_caching=False),
                               prewarm_guidance=False)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_burst_gets_each_first_token_in_the_step_that_completes_its_prompt(engine, temperature):
    """64 requests of 128-token prompts queued together (by the step thread itself, from a finishing
    request's output, so that the next step finds all of them waiting), 2048 prompt tokens a step:
    16 prompts complete in each of 4 steps, and each request's first token is delivered during the
    step that completed its prompt: the k-th 16 in the k-th step after their arrival."""
    done = threading.Event()
    steps_at_submit, steps_at_first, ends = {}, {}, []
    rng = np.random.default_rng(0)

    def step_now() -> int:       # the step running now (step_counts counts those finished)
        return sum(engine.step_counts.values()) + 1

    def sink_of(rid):
        def sink(item):
            if isinstance(item, BaseException):
                ends.append(item)
                done.set()
                return
            if item.token_ids and rid not in steps_at_first:
                steps_at_first[rid] = step_now()
            if item.finish_reason is not None:
                ends.append(rid)
                if len(ends) == BURST:
                    done.set()
        return sink

    def burst(item):             # the trigger's outputs, on the step thread: its end queues the burst
        if isinstance(item, BaseException) or item.finish_reason is not None:
            for i in range(BURST):
                rid = f"burst-{temperature}-{i}"
                params = SamplingParams(max_tokens=4, temperature=temperature, seed=i, ignore_eos=True)
                steps_at_submit[rid] = step_now()
                engine.submit(rng.integers(10, 280, PROMPT).tolist(), params, rid, sink_of(rid))

    engine.submit([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0), f"trigger-{temperature}", burst)
    assert done.wait(120), "the burst did not finish"
    assert all(isinstance(e, str) for e in ends), ends

    per_step = BUDGET // PROMPT
    waits = sorted(steps_at_first[r] - steps_at_submit[r] for r in steps_at_submit)
    assert waits == [1 + i // per_step for i in range(BURST)], waits
