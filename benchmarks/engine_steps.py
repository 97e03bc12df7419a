"""The engine's steps through a backend's public calls, for host_cost.py's --record: decode steps
pipelined as engine/pipeline.py runs them (a decode step, its sampling, a prompt step behind it,
the next step started ahead on the device's tokens: the same rows, then another batch, a row
dropped and the prompt's sequence added, the step's tokens read) and prompt steps that draw a
first token, greedy and sampled (penalties, a mask, a bias, logprobs). A tree from before the
model runner's calls (execute / sample / result) runs them on its own calls, so that --check
compares the two."""

from __future__ import annotations

import numpy as np

PIPELINED = ("pipelined greedy", "pipelined sampled", "prompt greedy", "prompt sampled")


def _rows(name: str, n: int, vocab: int) -> list:
    from realizar_backend.backends.base import LogitBias, SampleRow
    if "greedy" in name:
        return [SampleRow(temperature=0.0) for _ in range(n)]
    mask = np.zeros(-(-vocab // 32), np.int32)
    mask[:4] = -1
    kinds = [dict(temperature=0.8, seed=7), dict(temperature=0.0, repetition_penalty=1.2),
             dict(temperature=0.7, top_k=20, mask=mask), dict(temperature=1.0, logprobs=True, seed=3,
             logit_bias=LogitBias(np.array([5], np.int32), np.array([2.0], np.float32)))]
    return [SampleRow(step=i, **kinds[i % len(kinds)]) for i in range(n)]


class _Calls:
    """The step calls of a tree: execute / sample / result, or (a tree from before them) the
    greedy and sampled start / launch / finish and prefill_sample."""

    def __init__(self, be, greedy: bool):
        self.be, self.greedy, self.new = be, greedy, hasattr(be, "execute")

    def decode(self, slots, tokens=None, positions=None, prev_rows=None):
        if self.new:
            from realizar_backend.backends.base import Step
            return self.be.execute(Step(slots=slots, tokens=tokens, positions=positions, prev_rows=prev_rows))
        start = self.be.decode_argmax_start if self.greedy else self.be.decode_sample_start
        return start(slots, tokens, positions, prev_rows)

    def sample(self, h, rows):
        if self.new:
            self.be.sample(h, rows)
        elif not self.greedy:
            self.be.decode_sample_launch(h, rows)

    def result(self, h):
        if self.new:
            return self.be.result(h)
        return self.be.decode_argmax_finish(h) if self.greedy else self.be.decode_sample_finish(h)

    def prompts(self, items, rows):
        if self.new:
            from realizar_backend.backends.base import Step
            h = self.be.execute(Step(prompts=items))
            self.be.sample(h, rows)
            return self.be.result(h)
        return self.be.prefill_sample(items, rows)


def pipelined(be, name: str, rng) -> None:
    from realizar_backend.backends import PrefillItem
    greedy = "greedy" in name
    calls, V = _Calls(be, greedy), be.config.vocab_size
    prompt = [PrefillItem(8, rng.integers(3, 200, 40).astype(np.int32), 0),
              PrefillItem(9, rng.integers(3, 200, 24).astype(np.int32), 8)]
    with be.device, be.stream:
        if name.startswith("prompt"):
            calls.prompts(prompt, [None] + _rows(name, 1, V))
            return
        slots, pos = [0, 1, 2, 3], [30, 31, 32, 33]
        h = calls.decode(slots, [5, 6, 7, 8], pos)
        for i in range(3):
            calls.sample(h, _rows(name, len(slots), V))
            if i == 1:
                calls.prompts(prompt[:1], _rows(name, 1, V))
            nxt = calls.decode(slots)
            calls.result(h)
            h, pos = nxt, [p + 1 for p in pos]
        calls.sample(h, _rows(name, len(slots), V))
        nxt = calls.decode([2, 0, 8], [0, 0, 11], [pos[2] + 1, pos[0] + 1, 40], [2, 0, -1])
        calls.result(h)
        calls.sample(nxt, _rows(name, 3, V))
        calls.result(nxt)
