"""The model runner's calls (Backend.execute / sample / result) written once for every backend.

StepRunner checks a step and the order of the calls, resolves a continuation's rows against the
decode step it continues, keeps what each call needs in the step's handle, and maps them onto a
backend's own four hooks:

    _run_prompts(h)       enqueue the forward pass of h.prompts
    _run_decode(h)        enqueue a decode step: h.tokens[i] is -1 for a kept row (the previous
                          step's output; fed_tokens(h) reads it on the host where a backend needs it)
    _sample(h, rows)      enqueue the sampling of every row; returns a callable giving the
                          SampleResult (it may wait for the device)
    _wait(h)              wait for a step never sampled (its forward pass may still write)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .base import GREEDY, PrefillItem, SampleResult, SampleRow, Step, continued_inputs


@dataclass(eq=False)
class StepHandle:
    """A step executed: Backend.execute's handle."""
    prompts: list[PrefillItem]
    slots: list[int]
    tokens: list[int]                   # a decode step's tokens fed; -1: a kept row's, not read yet
    positions: list[int]
    prev: "StepHandle | None" = None    # the decode step it continues, until its tokens are read
    prev_rows: list[int] | None = None  # row i continues row prev_rows[i] of prev (-1: a new row)
    rows: list[SampleRow | None] | None = None     # as sample was given them
    finish: Callable[[], SampleResult] | None = None   # set by sample: the result, once ready
    result: SampleResult | None = None
    state: Any = None                   # the backend's own (the CPU's logits)

    @property
    def sampled(self) -> bool:
        return self.finish is not None


def greedy_result(tokens: np.ndarray) -> SampleResult:
    """The result of a step whose rows are all plain: the argmax tokens, nothing else asked."""
    nan = np.full(len(tokens), np.nan, np.float32)
    return SampleResult(tokens, nan, tokens.copy(), nan.copy(), {})


def all_plain(rows: Sequence[SampleRow]) -> bool:
    """Whether every row is plain (the forward pass's argmax is the token); GREEDY, the engine's
    row for a plain greedy sequence, is known plain without reading its fields (a step's hot path)."""
    return all(r is GREEDY or r.plain for r in rows)


def fill_rows(rows: Sequence[SampleRow | None]) -> list[SampleRow]:
    """A prompt step's rows as rows a sampler takes, one per item: a chunk that draws nothing (None)
    as a plain argmax, which costs a backend next to nothing, its token then dropped."""
    return [GREEDY if r is None else r for r in rows]


def drop_unsampled(res: SampleResult, rows: Sequence[SampleRow | None]) -> SampleResult:
    """The result of `fill_rows(rows)` with token -1 where rows[i] is None."""
    res.tokens[[i for i, r in enumerate(rows) if r is None]] = -1
    return res


class StepRunner:
    """execute / sample / result over the hooks above (a backend class derives from it)."""

    _last: StepHandle | None = None          # the last step executed
    _last_decode: StepHandle | None = None   # the last decode step executed: a continuation's

    def execute(self, step: Step) -> StepHandle:
        if step.prompts and len(step.slots):
            raise ValueError("a step runs prompt chunks or decode rows, not both")
        if not step.prompts and not len(step.slots):
            raise ValueError("a step without prompt chunks or decode rows")
        if step.prompts:
            h = StepHandle(list(step.prompts), [it.slot for it in step.prompts], [], [])
        else:
            h = self._decode_handle(step)          # checked before anything changes
        if step.tables:
            self.set_block_tables(step.tables)
        if step.prompts:
            self._run_prompts(h)
        else:
            self._run_decode(h)
            self._last_decode = h
        self._last = h
        return h

    def _decode_handle(self, step: Step) -> StepHandle:
        slots = [int(s) for s in step.slots]
        if not step.continues:
            if step.positions is None or not len(slots) == len(step.tokens) == len(step.positions):
                raise ValueError("slots, tokens and positions must have the same length")
            if len(set(slots)) != len(slots):
                raise ValueError("a decode step names each slot once")
            return StepHandle([], slots, [int(t) for t in step.tokens], [int(p) for p in step.positions])
        prev = self._last_decode
        if prev is None or not prev.sampled:
            raise ValueError("a continuation follows the last decode step executed, once it is sampled")
        rows, tokens, positions = continued_inputs(prev.slots, prev.positions, slots, step.tokens,
                                                   step.positions, step.prev_rows)
        return StepHandle([], slots, tokens, positions, prev, rows)

    def fed_tokens(self, h: StepHandle) -> list[int]:
        """The tokens a decode step feeds, a kept row's read from the result of the step it
        continues (waits for it)."""
        if h.prev is not None:
            drawn = self.result(h.prev).tokens
            h.tokens = [int(drawn[r]) if r >= 0 else t for r, t in zip(h.prev_rows, h.tokens)]
            h.prev = None
        return h.tokens

    def sample(self, h: StepHandle, rows: Sequence[SampleRow | None],
               prepare: Callable[[], None] | None = None) -> None:
        rows = list(rows)
        if len(rows) != len(h.slots):
            raise ValueError("one SampleRow per row of the step (None: a prompt chunk that draws nothing)")
        if not h.prompts and any(r is None for r in rows):
            raise ValueError("every decode row is sampled")
        if h.sampled or h is not self._last:
            raise ValueError("sample: the step is sampled already, or another step ran since")
        if prepare is not None:
            prepare()
        h.rows = rows
        h.finish = self._sample(h, fill_rows(rows) if h.prompts else rows)
        h.prev = None            # a continuation's kept tokens are read by now, or not needed

    def result(self, h: StepHandle) -> SampleResult | None:
        if h.result is None:
            if not h.sampled:
                self._wait(h)
                return None
            res = h.finish()
            h.result = drop_unsampled(res, h.rows) if h.prompts else res
        return h.result

    def _run_prompts(self, h: StepHandle) -> None:
        raise NotImplementedError

    def _run_decode(self, h: StepHandle) -> None:
        raise NotImplementedError

    def _sample(self, h: StepHandle, rows: list[SampleRow]) -> Callable[[], SampleResult]:
        raise NotImplementedError

    def _wait(self, h: StepHandle) -> None:
        """A step never sampled: wait for its forward pass (nothing to wait for where it ran at once)."""


def run_step(backend, step: Step, rows: Sequence[SampleRow | None],
             prepare: Callable[[], None] | None = None) -> SampleResult:
    """One step executed, sampled and read, nothing started ahead of it (prompt steps, tools, tests)."""
    h = backend.execute(step)
    backend.sample(h, rows, prepare)
    return backend.result(h)
