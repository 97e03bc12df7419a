"""The Backend protocol: the seam between the engine and the hardware.

The engine owns scheduling, KV-block allocation (engine/kv_manager.py) and the sampling
parameters; a backend owns the weights, the KV pool, the forward pass and the sampling of every
token, a sequence's first as the rest (backends/sampling.py defines the algorithm, which both
backends implement, so that the same logits and seed give the same token). The engine drives it
as a model runner, through two calls per step (vLLM's execute_model and sample_tokens):

    h = backend.execute(Step(...))        # enqueue the step's forward pass; returns at once
    backend.sample(h, rows, prepare)      # enqueue its sampling (prepare fills the masks first)
    res = backend.result(h)               # the sampled tokens (and logprobs): waits for them

`run_step` is the three in a row. Vocabulary-wide logits cross to the host only for the callers
that read them (`prefill` and `decode`: parity tests, tools) and for rows that ask
(SampleRow.want_logits).

KV memory is one pool of `num_blocks` blocks of `block_size` positions each (K and V of every
layer). A running sequence lives in a *slot* (0 .. max_slots-1: its row of the block tables and
of the penalty counts) and owns a list of blocks, its block table: blocks[i] holds its positions
[i * block_size, (i + 1) * block_size). The engine hands out slots and blocks, and gives the
backend a slot's table (`set_block_table(s)`, or a step's `tables`) before any step that reads or
writes a position the slot's previous table did not cover. Two slots may name the same block (a
shared prefix) as long as no step writes it.

A step is prompt chunks or decode rows. A decode step continues the last decode step executed
(Step.prev_rows, or tokens None: every row kept in order) without its tokens passing through the
host: a GPU backend runs it on the tokens the device wrote into its inputs, so the engine can
execute step n+1 before it reads step n's tokens. The order of the calls, and what the engine
guarantees while a step is in flight (executed, its result not read yet), so that a backend that
runs steps asynchronously knows what may happen meanwhile:
- sample(h) follows execute(h) with no step executed between them; a continuation is executed
  after the step it continues is sampled, and only then; a step's result is read once it is
  sampled (a step never sampled, a continuation the engine dropped, gives None and is waited for).
- set_block_table(s) (or a step's tables) may name a slot of the step in flight only to append
  blocks to its table (for the next step's position); it must take effect for steps executed
  after the call and leave the step in flight as it was. Any other table change waits until the
  step's result is read.
- release may be called for a slot of the step in flight (its sequence just stopped); the step's
  writes into that slot's blocks are harmless (nothing reads them), but release must not disturb it.
- a prompt step (executed, sampled and read) may run while a decode step is in flight, after that
  step's sample; it leaves the decode step as it was (its results, and the decode inputs a
  continuation reads).
A continuation may change the batch (prev_rows): keep any of the previous step's rows, in any
order (a row that must stop after the previous step is left out), and add new rows whose token
and position the host gives (a sequence whose prompt was just prefilled).
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
    def plain(self) -> bool:
        """A greedy row asking nothing else: its token is the forward pass's argmax (a backend
        may skip its sampler for a step whose rows are all plain)."""
        return (self.temperature == 0.0 and not self.logprobs and not self.want_logits
                and not self.penalties and not self.constrained)

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


GREEDY = SampleRow(temperature=0.0)     # a plain greedy draw (never changed: rows are read, not written)


@dataclass
class Step:
    """One step of the model runner (Backend.execute): prompt chunks, or decode rows (never both:
    a backend runs them as separate forward passes).
    Decode row i feeds tokens[i] to slots[i] at positions[i]; or, in a continuation of the last
    decode step executed (tokens None, or prev_rows given), row i continues row prev_rows[i] of
    that step (its slot must be that row's; its token is that row's output and its position the
    next) or is new (-1: tokens[i] and positions[i]). prev_rows None with tokens None: every row
    of that step kept, in order. See `continued_inputs`.
    tables: block tables set before the step runs (set_block_tables')."""
    prompts: Sequence[PrefillItem] = ()
    slots: Sequence[int] = ()
    tokens: Sequence[int] | None = None
    positions: Sequence[int] | None = None
    prev_rows: Sequence[int] | None = None
    tables: Mapping[int, Sequence[int]] | None = None

    @property
    def continues(self) -> bool:
        return not self.prompts and (self.tokens is None or self.prev_rows is not None)


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

    def execute(self, step: Step) -> Any:
        """Enqueue the step's forward pass (its tables first) and return a handle for sample and
        result; a GPU backend returns before the device has run it."""

    def sample(self, handle: Any, rows: Sequence[SampleRow | None],
               prepare: Callable[[], None] | None = None) -> None:
        """Enqueue the sampling of an executed step: one row per decode row, or per prompt chunk
        (the sequence's first token: its prompt is complete with this chunk; None: a chunk in the
        middle of a prompt draws nothing, its token is -1). prepare: called once, before the
        rows' masks are read, while the forward pass runs: the caller fills the masks there. The
        rows are copied before this returns (the caller may reuse their masks). For a decode row
        with penalties the token it feeds (its sequence's newest) is counted as generated before
        the penalties apply; a prompt feeds none (the caller resets a penalised row's counts,
        reset_counts, before). A decode step's tokens become the inputs of its continuation on
        the device. A backend may take the forward pass's argmax when every row is plain."""

    def result(self, handle: Any) -> SampleResult | None:
        """The sampled step's tokens (logprobs where asked, logits of rows with want_logits); waits
        for them; may be asked again. None for a step never sampled (waited for all the same)."""

    def prefill(self, items: Sequence[PrefillItem]) -> np.ndarray:
        """Run prompts (or chunks of them: start_pos > 0 continues the slot's sequence) into their
        slots' KV blocks; float32 logits [len(items), vocab] at each item's last token, for the
        callers that read them (parity tests, `realizar check`, tools): the engine's prompts are
        steps."""

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One decode step outside the runner's order, for the callers that read logits: token i
        goes to slot i at position i. float32 logits [n, vocab]. A later step cannot continue it."""

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
