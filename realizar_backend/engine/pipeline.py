"""The decode step on the device, pipelined: step n+1 starts on the device's own tokens before the
host reads step n's, so the GPU does not wait for the host's per-token work.

The engine (engine/engine.py) owns one DecodePipeline and hands it each step's decode batch; the
pipeline runs the step on the backend's model runner (execute, then sample: the constrained rows'
masks are filled while the forward pass runs), queues the step's prefill behind it, executes the
next step ahead when it can, and returns the step's tokens (Backend.result). What the host
then does with them (stop checks, text, outputs) is the engine's. The state of the step started
ahead lives here: its batch and handle, the sequences that ended while it still computed them
(their slots and KV blocks are freed once it is done), and the count of decode steps by how each
started (Engine.stats()'s "decode_steps").

It reads the engine's backend, scheduler, settings and guidance through the engine, not copies of
them (a tool may swap engine.backend for a wrapper), and calls back the engine's prefill and
flush at the points of a step where they belong.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from ..backends import GREEDY, SampleResult, SampleRow, Step
from .scheduler import Sequence, StepPlan


class StepOwner(Protocol):
    """What the pipeline reads through its engine (engine.py's Engine), never a copy: a tool may
    swap the backend for a wrapper."""
    backend: Any
    scheduler: Any
    guidance: Any
    pipelined: bool


# why a decode step was not started ahead: a prefill in the step before, greedy and sampled batches
# switching (neither is a reason any more: the prefill queues behind the step, and every step is
# sampled the same way; the labels stay, at 0, so that figures from before compare), every row
# stopping after it (max_tokens or the context's end), no free KV block for a row's next position,
# the engine made unpipelined, the batch changed under a step started ahead (a cancellation or a
# preemption), no decode step before it
PIPELINE_REASONS = ("prefill", "finishing", "no_block", "off", "changed", "kind", "start")


class DecodePipeline:
    def __init__(self, engine: StepOwner, prefill: Callable[[list], None], flush: Callable[[], None]):
        """prefill: runs a step's prompt chunks (the engine's); flush: delivers the outputs queued
        so far to their callers."""
        self.engine = engine
        self._prefill = prefill
        self._flush = flush
        # a step started ahead: (batch, handle, the sequences of its batch that ended since it
        # started: their slots and blocks are freed once it is done)
        self.ahead: tuple[list[Sequence], Any, list[Sequence]] | None = None
        # decode steps by how they started: "ahead" (before the previous step's tokens were read)
        # or why not (PIPELINE_REASONS); why: the reason the next step will give if not ahead
        self.steps = dict.fromkeys(("ahead",) + PIPELINE_REASONS, 0)
        self.why = "start"
        self._masks: np.ndarray | None = None     # the constrained rows' masks of a decode step

    @property
    def backend(self):
        return self.engine.backend

    @property
    def scheduler(self):
        return self.engine.scheduler

    def step(self, decode: list[Sequence], prefill: list[tuple[Sequence, int, int]]
             ) -> tuple[list[Sequence], set[int], SampleResult]:
        """One decode step for `decode` (the plan's), started ahead by the step before or now, then
        sampled: the constrained rows' masks are filled (each guide has consumed the token this step
        feeds) while its forward pass runs. The step's prefill runs once the sampling is queued,
        and the next step is started ahead, on the tokens the device drew, over the rows that go on
        and the sequences that prefill completed, before this one's tokens are read, so that the
        device does not wait for the host's per-token work. Returns (the step's rows, the ids of
        those in `decode`: a row not in it stopped after the step started, and its token, drawn
        unconstrained, is dropped; the result); the sequences the step held are freed by then.
        The tokens are the unpipelined ones: a row's draw is keyed by (seed, step) and its
        penalties count the token it is fed, which the host knows when it samples."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            batch, h, held = ahead
            self.steps["ahead"] += 1
        else:
            batch, h, held = decode, None, []
            self.steps[self.why] += 1
        self.why = "start"
        live = {id(s) for s in decode}      # a row of `batch` not in it stopped after the step started
        if h is None:
            h = self.backend.execute(Step(slots=[s.slot for s in batch], tokens=[s.output_ids[-1] for s in batch],
                                          positions=[s.num_computed for s in batch]))
        self.backend.sample(h, *self.draw_rows(batch))
        if prefill:
            self._prefill(prefill)
        self._go_ahead(batch, live, prefill)
        # the previous step's outputs go to the event loop now, while this thread waits for the
        # device anyway: the loop takes the GIL without making the step's launches wait for it
        self._flush()
        out = self.backend.result(h)
        self.free_held(held)
        return batch, live, out

    def draw_rows(self, seqs: list[Sequence]) -> tuple[list[SampleRow], Callable[[], None] | None]:
        """Each sequence's next draw as the backend samples it (Backend.sample, a first token's
        too): GREEDY for a plain greedy sequence; else its seed and step (the tokens it has),
        logprobs as asked (the top one from the backend; more from the row's logits), its mask;
        and the `prepare` that fills the grammars' masks and applies the host's rules to them,
        which the backend calls while the forward pass runs (None: no sequence has a grammar). The
        masks live in one buffer of the pipeline's: a backend copies a step's masks when it takes
        its rows, so the next call may reuse it."""
        guides = [s.guide for s in seqs if s.guide is not None]
        masks = self._mask_rows(len(guides)) if guides else None
        rows, k = [], 0
        ruled = []          # (sequence, its grammar's mask): the host's rules apply once the mask is filled
        for s in seqs:
            if _plain_greedy(s):
                rows.append(GREEDY)
                continue
            mask = None
            if s.guide is not None:
                mask, k = masks[k], k + 1
                if s.rules is not None:
                    ruled.append((s, mask))
            elif s.rules is not None:
                mask = s.rules.mask(s.output_ids, None)
            rows.append(s.sampler.row(step=len(s.output_ids), logprobs=s.params.logprobs in (0, 1),
                                      want_logits=(s.params.logprobs or 0) > 1, mask=mask))
        if not guides:
            return rows, None

        def prepare() -> None:
            self.engine.guidance.fill_masks(guides, masks)
            for s, mask in ruled:
                s.rules.mask(s.output_ids, mask)
        return rows, prepare

    def _go_ahead(self, batch: list[Sequence], live: set[int], prefill: list) -> None:
        """Start the step after this one before this one's tokens are read: over this step's rows
        that go on (not past max_tokens or the context after it; a row that stops on a stop token
        is only known later, and dropped then) and the sequences whose prompt this step's prefill
        completed. The kept rows' tokens stay on the device; the pool gives every row a block for
        the position it writes (the step's tables), or nothing goes ahead."""
        if not self.engine.pipelined:
            self.why = "off"
            return
        room = self.backend.max_context - 1
        keep = [i for i, s in enumerate(batch) if id(s) in live and len(s.output_ids) + 1 < s.params.max_tokens
                and s.num_computed < room]
        done = {id(batch[i]) for i in keep}
        new = [s for s, _, _ in prefill if s in self.scheduler.running and not s.prefilling
               and s.output_ids and id(s) not in done]
        nxt = [batch[i] for i in keep] + new
        if not nxt:
            self.why = "finishing"
            return
        pos = [s.num_computed + 1 for s in nxt[:len(keep)]] + [s.num_computed for s in new]
        tables = self.scheduler.grow_for_next_step(nxt, pos)
        if tables is None:
            self.why = "no_block"
            return
        slots = [s.slot for s in nxt]
        if len(keep) == len(batch) and not new:        # the same rows: a plain continuation
            prev_rows = tokens = pos = None
        else:
            prev_rows = keep + [-1] * len(new)
            tokens = [0] * len(keep) + [s.output_ids[-1] for s in new]
        h = self.backend.execute(Step(slots=slots, tokens=tokens, positions=pos, prev_rows=prev_rows,
                                      tables=tables or None))
        self.ahead = (nxt, h, [])
        self.why = "changed"    # what the next step says if this one is dropped

    def serves(self, plan: StepPlan) -> bool:
        """Whether the step started ahead serves this plan's decode: it computes every sequence the
        plan decodes (its other rows have stopped since: their outputs are dropped) and the plan
        preempted or failed nothing; else it must be waited for first, so that no slot or block it
        writes changes hands under it."""
        return not (plan.preempted or plan.failed or not _covers(self.ahead[0], plan.decode))

    def drop_ahead(self) -> None:
        """Wait for the step started ahead, forget its outputs, free the sequences it held."""
        if self.ahead is not None:
            (_, h, held), self.ahead = self.ahead, None
            self.backend.result(h)      # never sampled: nothing comes back
            self.free_held(held)

    def abandon_ahead(self) -> None:
        """After a failed step: forget the step started ahead without waiting for it, and free the
        sequences it held."""
        if self.ahead is not None:
            (_, _, held), self.ahead = self.ahead, None
            self.free_held(held)

    def free_held(self, held: list[Sequence]) -> None:
        """Slots and KV blocks of sequences that ended while a step started ahead still computed
        them: that step is done now."""
        for seq in held:
            if seq.slot >= 0:
                self.backend.release(seq.slot)
            self.scheduler.free(seq)

    def hold(self, seq: Sequence) -> bool:
        """An ended sequence that the step started ahead computes leaves the scheduler now, but
        its slot and blocks stay taken until that step is done (free_held); False (nothing done)
        when no step started ahead computes it."""
        if self.ahead is not None and any(s is seq for s in self.ahead[0]):
            self.scheduler.remove(seq, hold=True)
            self.ahead[2].append(seq)
            return True
        return False

    def _mask_rows(self, n: int) -> np.ndarray:
        if self._masks is None:
            self._masks = np.zeros((self.backend.max_slots, self.engine.guidance.words), np.int32)
        return self._masks[:n]


def _covers(batch: list, decode: list) -> bool:
    """Every sequence of `decode` is a row of `batch`."""
    rows = {id(s) for s in batch}
    return all(id(s) in rows for s in decode)


def _plain_greedy(seq: Sequence) -> bool:
    """A sequence whose every draw is GREEDY: the forward pass's argmax, nothing else asked."""
    return (seq.params.greedy and not seq.sampler.needs_counts and seq.params.logprobs is None
            and not seq.constrained)
