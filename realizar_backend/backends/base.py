"""The Backend protocol: the seam between the engine and the hardware.

The engine owns scheduling, KV-block allocation (engine/kv_manager.py) and the sampling
parameters; a backend owns the weights, the KV pool, the forward pass and the sampling of every
token, a sequence's first (prefill_sample) as the rest (decode_sample) (backends/sampling.py
defines the algorithm, which both backends implement, so that the same logits and seed give the
same token). Vocabulary-wide logits cross to the host only for the callers that read them
(`prefill` and `decode`: parity tests, tools) and for rows that ask (SampleRow.want_logits).

KV memory is one pool of `num_blocks` blocks of `block_size` positions each (K and V of every
layer). A running sequence lives in a *slot* (0 .. max_slots-1: its row of the block tables and
of the penalty counts) and owns a list of blocks, its block table: blocks[i] holds its positions
[i * block_size, (i + 1) * block_size). The engine hands out slots and blocks, and gives the
backend a slot's table (`set_block_table`, or several at once: `set_block_tables`) before any step that reads or writes a position the
slot's previous table did not cover. Two slots may name the same block (a shared prefix) as long
as no step writes it.

What the engine guarantees about started greedy steps (decode_argmax_start), so a backend that
runs them asynchronously knows what may happen while one is in flight:
- set_block_table(s) may be called for a slot of the step in flight only to append blocks to its
  table (for the next step's position); it must take effect for steps started after the call and
  leave the step in flight as it was. Any other table change waits until the step is finished.
- release may be called for a slot of the step in flight (its sequence just stopped); the step's
  writes into that slot's blocks are harmless (nothing reads them), but release must not disturb it.
- decode_sample is never called while a started step is in flight; prefill and prefill_sample
  may be, after the step's start (for a sampled step, after its launch), and leave the step as it
  was (its results, and the decode inputs a continuation reads).
- a continuation (a step started without tokens, or with prev_rows) always directly follows the
  started step it continues, apart from prefills between them.
The same holds for sampled steps (decode_sample_start / _launch / _finish), started, launched and
finished in this order, with at most one continuation started between a step's launch and its
finish; a continuation started but never launched (the engine dropped it) is finished unlaunched.

A continuation may change the batch (prev_rows): keep any of the previous step's rows, in any
order (a row that must stop after the previous step is left out), and add new rows whose token
and position the host gives (a sequence whose prompt was just prefilled). The kept rows' tokens
never pass through the host: on a GPU the device gathers them from the previous step's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ..model.config import ModelConfig


@dataclass
class PrefillItem:
    slot: int
    tokens: np.ndarray      # int32 [n] prompt tokens to run
    start_pos: int = 0      # position of tokens[0]; > 0 continues a sequence already in the slot
                            # (a later chunk of its prompt, or a prompt whose prefix is cached)


@dataclass(frozen=True)
class LogitBias:
    """Additive biases for a few tokens (OpenAI's logit_bias): ids unique, in [0, vocab)."""
    ids: np.ndarray                 # int32 [n]
    values: np.ndarray              # float32 [n]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class SampleRow:
    """How one row of a decode step is sampled (the fields of engine.sampling.SamplingParams that
    pick the token, plus the draw's place in its sequence)."""
    temperature: float = 1.0        # 0: greedy (argmax of the penalised logits)
    top_k: int = 0                  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0                   # the sequence's seed, 0 .. 2**64-1
    step: int = 0                   # index of the token being drawn within its sequence
    logprobs: bool = False          # return the chosen token's logprob and the top-1 (raw distribution)
    want_logits: bool = False       # also return the row's raw logits (top logprobs beyond one)
    # constrained decoding: the tokens the row may draw, as int32 words [ceil(vocab / 32)] (token
    # i allowed when bit i % 32 of word i // 32 is set; tokens past the mask's end are not).
    # None: every token. A backend copies it when the step starts, so the caller may reuse it.
    mask: np.ndarray | None = None
    logit_bias: LogitBias | None = None

    @property
    def constrained(self) -> bool:
        """A mask or a bias changes the row's logits before the penalties (and makes a greedy
        row take the argmax of the changed logits, not the forward pass's)."""
        return self.mask is not None or (self.logit_bias is not None and len(self.logit_bias) > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class SampleResult:
    tokens: np.ndarray              # int32 [n] sampled token ids
    logprobs: np.ndarray            # float32 [n] logprob of the chosen token (raw logits); NaN unless asked
    top_ids: np.ndarray             # int32 [n] argmax of the raw logits
    top_logprobs: np.ndarray        # float32 [n] its logprob; NaN unless asked
    logits: dict[int, np.ndarray]   # row -> raw logits [vocab], for rows with want_logits


@runtime_checkable
class Backend(Protocol):
    name: str               # "cpu" | "cuda"
    config: ModelConfig
    max_slots: int          # sequences live at once (rows of the block tables)
    max_context: int        # positions per sequence
    block_size: int         # positions per KV block
    num_blocks: int         # blocks in the KV pool

    def set_block_table(self, slot: int, blocks: Sequence[int]) -> None:
        """The KV blocks of the sequence in `slot`, in position order (replaces the slot's table;
        a backend may copy only what changed). len(blocks) <= ceil(max_context / block_size)."""

    def set_block_tables(self, tables: Mapping[int, Sequence[int]]) -> None:
        """set_block_table for several slots at once (slot -> blocks); a GPU backend copies them
        in one transfer. A bad entry raises before any table changes."""

    def prefill(self, items: Sequence[PrefillItem]) -> np.ndarray:
        """Run prompts (or chunks of them: start_pos > 0 continues the slot's sequence) into their
        slots' KV blocks; float32 logits [len(items), vocab] at each item's last token, for the
        callers that read them (parity tests, `realizar check`, tools): the engine's prompts go
        through prefill_sample."""

    def prefill_sample(self, items: Sequence[PrefillItem], rows: Sequence[SampleRow | None],
                       prepare: Callable[[], None] | None = None) -> SampleResult:
        """prefill, then item i's last token sampled by rows[i] as decode_sample samples a row (a
        sequence's first token: its prompt is complete with this chunk); rows[i] None: the item
        samples nothing (a chunk in the middle of a prompt) and its token is -1. One result row
        per item; only tokens (and logprobs where asked, logits for rows with want_logits) come
        back. No token is fed to the penalties: the caller resets a penalised row's slot counts
        (reset_counts) before the call. prepare: as in decode_sample (after the forward pass is
        started, before the rows' masks are read). At most max_slots items."""

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One step for a batch: token i goes to slot i at position i. float32 logits [n, vocab]."""

    def decode_argmax(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Greedy step: like decode, but only the argmax ids (int32 [n]) come back."""

    def decode_argmax_start(self, slots: Sequence[int], tokens: Sequence[int] | None = None,
                            positions: Sequence[int] | None = None,
                            prev_rows: Sequence[int] | None = None) -> Any:
        """Start a greedy step and return a handle for decode_argmax_finish. tokens and positions
        None: continue the previous greedy step's sequences (the same slots, in order) with its
        argmax tokens at the next positions; a GPU backend runs that step without waiting for the
        host, so the engine can start step n+1 before it reads step n's tokens. prev_rows: a
        continuation over another batch (see `continued_inputs`): row i continues row prev_rows[i]
        of the previous step (its slot must be that row's), or is new (-1) and takes tokens[i]
        and positions[i]."""

    def decode_argmax_finish(self, handle: Any) -> np.ndarray:
        """The ids (int32 [n]) of a started step; waits for it."""

    def decode_sample(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                      rows: Sequence[SampleRow], prepare: Callable[[], None] | None = None) -> SampleResult:
        """One step sampled on the backend: only token ids (and logprobs where asked) come back.
        For rows with penalties, tokens[i] (the sequence's newest token) is counted as generated
        before the penalties of this step apply. prepare: called once, after the step's forward
        pass is started and before the rows' masks are read; the caller fills the masks there,
        so that this host work overlaps a device's forward pass."""

    def decode_sample_start(self, slots: Sequence[int], tokens: Sequence[int] | None = None,
                            positions: Sequence[int] | None = None,
                            prev_rows: Sequence[int] | None = None) -> Any:
        """Start a sampled step's forward pass; returns a handle. tokens and positions None:
        continue the previous sampled step (launched; the same slots, in order) with its sampled
        tokens at the next positions; a GPU backend runs it without waiting for the host (the
        sampling writes its tokens into the next step's inputs), so the engine can start step n+1
        before it reads step n's tokens. prev_rows: as in decode_argmax_start."""

    def decode_sample_launch(self, handle: Any, rows: Sequence[SampleRow],
                             prepare: Callable[[], None] | None = None) -> None:
        """Sample the started step's rows (prepare first, as in decode_sample; the rows' masks are
        read after it). Returns once the rows are copied; no other step may run between the
        step's start and its launch. The tokens fed (counted for penalties) are the step's own,
        or for a continuation the step's it continues."""

    def decode_sample_finish(self, handle: Any) -> SampleResult | None:
        """The results of a launched step (waits for them), the same as decode_sample's for the
        same rows and inputs; None for a step never launched."""

    def reset_counts(self, slot: int, prompt: np.ndarray, generated: np.ndarray | None = None) -> None:
        """A sequence with penalties starts (or, after a preemption, resumes) in `slot`: forget the
        slot's token counts, mark the prompt's tokens and count each generated token once (the
        repetition penalty covers prompt and output; presence and frequency penalties only the
        output)."""

    def release(self, slot: int) -> None:
        """The slot's sequence is gone (its blocks are the engine's to reuse)."""

    def stats(self) -> dict[str, Any]:
        """Numbers for the metrics: graph status per bucket, graph replays and captures (totals),
        pool bytes, KV pool bytes, device memory."""

    def close(self) -> None:
        """Free device resources."""


def checked_tables(tables: Mapping[int, Sequence[int]], max_slots: int, max_blocks: int, num_blocks: int,
                   dtype=np.int32) -> list[tuple[int, np.ndarray]]:
    """set_block_tables' argument checked, every entry before any is used (a bad one changes
    nothing): (slot, blocks as an array) for each slot, or ValueError naming the slot."""
    checked = []
    for slot, blocks in tables.items():
        if not 0 <= slot < max_slots:
            raise ValueError(f"slot {slot} out of range 0..{max_slots - 1}")
        b = np.asarray(blocks, dtype).reshape(-1)
        if b.size > max_blocks:
            raise ValueError(f"slot {slot}: {b.size} blocks exceed the {max_blocks} of a whole context")
        if b.size and (b.min() < 0 or b.max() >= num_blocks):
            raise ValueError(f"slot {slot}: block ids must be in 0..{num_blocks - 1}")
        checked.append((slot, b))
    return checked


def continued_inputs(prev_slots: Sequence[int], prev_positions: Sequence[int], slots: Sequence[int],
                     tokens: Sequence[int] | None, positions: Sequence[int] | None,
                     prev_rows: Sequence[int] | None) -> tuple[list[int], list[int], list[int]]:
    """A continuation's rows, checked: (prev_rows, tokens, positions) with one entry per row of
    `slots`. A kept row (prev_rows[i] >= 0) is at the next position of the previous step's row
    prev_rows[i] and in its slot; its token (-1 here) is that row's output, which the host may not
    know yet. A new row (-1) takes tokens[i] and positions[i]. prev_rows None: every row kept, in
    order."""
    n = len(slots)
    if prev_rows is None:
        prev_rows = list(range(len(prev_slots)))
    prev_rows = [int(r) for r in prev_rows]
    if len(prev_rows) != n or (any(r < 0 for r in prev_rows) and (tokens is None or positions is None
                                                                  or len(tokens) != n or len(positions) != n)):
        raise ValueError("a continuation names one previous row (or -1 and a token and position) per slot")
    kept = [r for r in prev_rows if r >= 0]
    if len(set(kept)) != len(kept):
        raise ValueError("a continuation keeps each previous row at most once")
    toks, pos = [], []
    for i, r in enumerate(prev_rows):
        if r >= 0:
            if r >= len(prev_slots) or int(slots[i]) != int(prev_slots[r]):
                raise ValueError(f"row {i} continues row {r} of the previous step, which is not in slot {slots[i]}")
            toks.append(-1)
            pos.append(int(prev_positions[r]) + 1)
        else:
            toks.append(int(tokens[i]))
            pos.append(int(positions[i]))
    if len({int(s) for s in slots}) != n:
        raise ValueError("a decode step names each slot once")
    return prev_rows, toks, pos
