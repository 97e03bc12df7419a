"""The decode step on the device, pipelined: step n+1 starts on the device's own tokens before the
host reads step n's, so the GPU does not wait for the host's per-token work.

The engine (engine/engine.py) owns one DecodePipeline and hands it each step's decode batch; the
pipeline runs the step on the backend (greedy: the device's argmax; sampled: the backend samples,
with the constrained rows' masks filled while the forward pass runs), queues the step's prefill
behind it, starts the next step ahead when it can, and returns the step's tokens. What the host
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

from ..backends import SampleResult, SampleRow
from .scheduler import Sequence, StepPlan


class StepOwner(Protocol):
    """What the pipeline reads through its engine (engine.py's Engine), never a copy: a tool may
    swap the backend for a wrapper."""
    backend: Any
    scheduler: Any
    guidance: Any
    pipelined: bool


# why a decode step was not started ahead: a prefill in the step before (no longer a reason: the
# prefill queues behind the step; the label stays, at 0, so that figures from before compare), every
# row stopping after it (max_tokens or the context's end), no free KV block for a row's next
# position, the engine made unpipelined, the batch changed under a step started ahead (a cancellation or a
# preemption), greedy and sampled batches switching, no decode step before it
PIPELINE_REASONS = ("prefill", "finishing", "no_block", "off", "changed", "kind", "start")


class DecodePipeline:
    def __init__(self, engine: StepOwner, prefill: Callable[[list], None], flush: Callable[[], None]):
        """prefill: runs a step's prompt chunks (the engine's); flush: delivers the outputs queued
        so far to their callers."""
        self.engine = engine
        self._prefill = prefill
        self._flush = flush
        # a step started ahead: (batch, handle, greedy | sample, the sequences of its batch that ended
        # since it started: their slots and blocks are freed once it is done)
        self.ahead: tuple[list[Sequence], Any, str, list[Sequence]] | None = None
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
             ) -> tuple[list[Sequence], set[int], str, Any]:
        """One decode step for `decode` (the plan's), started ahead by the step before or now; the
        step's prefill runs once the step is queued, and the next step is started ahead over the
        rows that go on and the sequences that prefill completed, before this one's tokens are read.
        Returns (the step's rows, the ids of those in `decode`: a row not in it stopped after the
        step started and its token is dropped, greedy | sample, the tokens: an array for greedy, a
        SampleResult for sample); the sequences the step held are freed by then."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            batch, h, kind, held = ahead
            self.steps["ahead"] += 1
        else:
            batch, h, held = decode, None, []
            kind = "greedy" if all(_plain_greedy(s) for s in decode) else "sample"
            self.steps[self.why] += 1
        self.why = "start"
        live = {id(s) for s in decode}      # a row of `batch` not in it stopped after the step started
        if kind == "greedy":
            out = self._greedy_step(batch, h, prefill, live)
        else:
            out = self._sampled_step(batch, h, prefill, live)
        self.free_held(held)
        return batch, live, kind, out

    def _greedy_step(self, batch: list[Sequence], h: Any, prefill: list, live: set[int]) -> np.ndarray:
        """A greedy step, pipelined: the step after it is started (on the device's own argmax
        tokens) before this one's tokens are read, so the GPU does not wait for the host's per-token
        work; the step's prefill is queued behind it first (its new sequences join the next step)."""
        if h is None:
            h = self.backend.decode_argmax_start([s.slot for s in batch], [s.output_ids[-1] for s in batch],
                                                 [s.num_computed for s in batch])
        if prefill:
            self._prefill(prefill)
        self._go_ahead(batch, live, prefill, "greedy")
        # the previous step's outputs go to the event loop now, while this thread waits for the
        # device anyway: the loop takes the GIL without making the step's launches wait for it
        self._flush()
        return self.backend.decode_argmax_finish(h)

    def _sampled_step(self, batch: list[Sequence], h: Any, prefill: list, live: set[int]) -> SampleResult:
        """A step sampled by the backend, pipelined like the greedy one: its forward pass was
        started ahead (on the tokens the device sampled) while the host consumed the previous
        step's tokens; now the host fills the constrained rows' masks (each guide has consumed the
        token this step feeds), launches the sampling, runs the step's prefill, starts the next
        step's forward pass, and only then waits for this step's tokens. Only rows asking for top
        logprobs beyond one get logits back. The tokens are the unpipelined ones: a row's draw is
        keyed by (seed, step) and its penalties count the token it is fed, which the host knows at
        the launch. A row that stopped since the step started is sampled, unconstrained, and dropped."""
        if h is None:
            h = self.backend.decode_sample_start([s.slot for s in batch], [s.output_ids[-1] for s in batch],
                                                 [s.num_computed for s in batch])
        self.backend.decode_sample_launch(h, *self.draw_rows(batch))
        if prefill:
            self._prefill(prefill)
        self._go_ahead(batch, live, prefill, "sample")
        self._flush()
        return self.backend.decode_sample_finish(h)

    def draw_rows(self, seqs: list[Sequence]) -> tuple[list[SampleRow], Callable[[], None] | None]:
        """Each sequence's next draw as the backend samples it (decode_sample_launch, or
        prefill_sample for a first token): its seed and step (the tokens it has), logprobs as asked
        (the top one from the backend; more from the row's logits), its mask; and the `prepare`
        that fills the grammars' masks and applies the host's rules to them, which the backend
        calls while the forward pass runs (None: no sequence has a grammar). The masks live in one
        buffer of the pipeline's: a backend copies a step's masks when it takes its rows, so the
        next call may reuse it."""
        guides = [s.guide for s in seqs if s.guide is not None]
        masks = self._mask_rows(len(guides)) if guides else None
        rows, k = [], 0
        ruled = []          # (sequence, its grammar's mask): the host's rules apply once the mask is filled
        for s in seqs:
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

    def _go_ahead(self, batch: list[Sequence], live: set[int], prefill: list, kind: str) -> None:
        """Start the step after this one before this one's tokens are read: over this step's rows
        that go on (not past max_tokens or the context after it; a row that stops on a stop token
        is only known later, and dropped then) and the sequences whose prompt this step's prefill
        completed, on the same path (greedy or sampled). The kept rows' tokens stay on the device;
        the pool gives every row a block for the position it writes, or nothing goes ahead."""
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
        if ("greedy" if all(_plain_greedy(s) for s in nxt) else "sample") != kind:
            self.why = "kind"
            return
        pos = [s.num_computed + 1 for s in nxt[:len(keep)]] + [s.num_computed for s in new]
        tables = self.scheduler.grow_for_next_step(nxt, pos)
        if tables is None:
            self.why = "no_block"
            return
        if tables:
            self.backend.set_block_tables(tables)
        slots = [s.slot for s in nxt]
        if len(keep) == len(batch) and not new:        # the same rows: a plain continuation
            prev_rows = tokens = pos = None
        else:
            prev_rows = keep + [-1] * len(new)
            tokens = [0] * len(keep) + [s.output_ids[-1] for s in new]
        if kind == "greedy":
            h = self.backend.decode_argmax_start(slots, tokens, pos, prev_rows)
        else:
            h = self.backend.decode_sample_start(slots, tokens, pos, prev_rows)
        self.ahead = (nxt, h, kind, [])
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
            (_, h, kind, held), self.ahead = self.ahead, None
            if kind == "greedy":
                self.backend.decode_argmax_finish(h)
            else:
                self.backend.decode_sample_finish(h)     # never launched: nothing comes back
            self.free_held(held)

    def abandon_ahead(self) -> None:
        """After a failed step: forget the step started ahead without waiting for it, and free the
        sequences it held."""
        if self.ahead is not None:
            (_, _, _, held), self.ahead = self.ahead, None
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
            self.ahead[3].append(seq)
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
    """A row the greedy path (the device's argmax, nothing else) decodes."""
    return (seq.params.greedy and not seq.sampler.needs_counts and seq.params.logprobs is None
            and not seq.constrained)
