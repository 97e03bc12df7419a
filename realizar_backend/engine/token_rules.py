"""Rules the host sets on a sequence's next token, beside its grammar (engine/guidance.py):

- `min_tokens` (vLLM's): the sequence's stop tokens (its `stop_token_ids`, and the model's own
  unless `ignore_eos`) are banned until it has generated that many tokens;
- a thinking budget (`Thinking.max_tokens`): once a thought has taken that many tokens, the tokens
  of its close tag are forced, one a draw, so that the model goes on to its answer.

A ruled draw is sampled with a mask (SampleRow.mask, the grammar's layout): the rule's own, or the
grammar's with the rule applied. The grammar wins a conflict: a ban that would leave no token
allowed, or a forced token the grammar does not allow, is not applied. A sequence whose rules may
still apply is kept off the plain greedy path (Sequence.constrained), so every one of its draws
can take a mask; once they cannot (min_tokens reached, the thought closed), it goes back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thought as the engine follows it: its tags (text and token ids), whether
    the prompt left the model inside one (set by RequestPrep.prepare from the rendered prompt), and
    the most tokens the thought may take before its close tag is forced (None: no limit)."""
    open_text: str
    close_text: str
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    max_tokens: int | None = None
    inside: bool = False

    def after_prompt(self, prompt: str) -> "Thinking":
        """This thought for a rendered prompt: inside when its last open tag follows its last close tag."""
        return replace(self, inside=prompt.rfind(self.open_text) > prompt.rfind(self.close_text))


def _bit(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(word index, bit within the word as int32) of each token id in a mask."""
    ids = np.asarray(ids, np.int64)
    return ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)).view(np.int32)


class TokenRules:
    """One sequence's rules. `constrains(n)`: whether the draw of output token n, or a later one,
    may be ruled; `mask(output_ids, mask)`: the mask for the next draw; `observe(output_ids)`:
    after each token is appended."""

    def __init__(self, params, model_stop_ids, words: int):
        self.min_tokens = params.min_tokens or 0
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(model_stop_ids))
        self._ban = _bit(sorted(stops)) if stops and self.min_tokens else None
        t: Thinking | None = params.thinking
        self.budget = t.max_tokens if t is not None else None
        self.thinking = t
        # before: a thought may still open (only at the reply's start) | inside | done
        self.state = "done" if t is None else ("inside" if t.inside else "before")
        self.count = 0                      # tokens the thought has taken
        self.words = words
        self._own = np.empty(words, np.int32)

    @classmethod
    def for_params(cls, params, model_stop_ids, words: int) -> "TokenRules | None":
        """The rules of a request, or None when it has none that can ever apply."""
        budget = params.thinking is not None and params.thinking.max_tokens is not None
        if not (params.min_tokens or budget):
            return None
        return cls(params, model_stop_ids, words)

    def constrains(self, n: int) -> bool:
        return n < self.min_tokens or (self.budget is not None and self.state != "done")

    def observe(self, output_ids: list[int]) -> None:
        t = self.thinking
        if t is None or self.state == "done":
            return
        n = len(output_ids)
        if self.state == "before":
            k = len(t.open_ids)
            if output_ids != list(t.open_ids[:n]):
                self.state = "done"          # the reply did not open with a thought
            elif n == k:
                self.state = "inside"
            return
        self.count += 1
        k = len(t.close_ids)
        if n >= k and output_ids[-k:] == list(t.close_ids):
            self.state = "done"

    def _forced(self, output_ids: list[int]) -> int | None:
        """The close tag's next token, once the thought has spent its budget."""
        if self.budget is None or self.state != "inside" or self.count < self.budget:
            return None
        close = self.thinking.close_ids
        for k in range(min(len(close) - 1, len(output_ids)), 0, -1):
            if output_ids[-k:] == list(close[:k]):
                return close[k]
        return close[0]

    def mask(self, output_ids: list[int], mask: np.ndarray | None) -> np.ndarray | None:
        """The mask for the draw of the next token: `mask` (a grammar's, changed in place) or this
        sequence's own buffer, or None when nothing rules the draw."""
        forced = self._forced(output_ids)
        ban = self._ban if len(output_ids) < self.min_tokens else None
        if forced is None and ban is None:
            return mask
        if mask is None:
            mask = self._own
            mask.fill(-1)
        if forced is not None:
            (w,), (b,) = _bit([forced])
            if mask[w] & b:
                mask.fill(0)
                mask[w] = b
                return mask
        if ban is not None:
            w, b = ban
            w = w[w < len(mask)]
            b = b[:len(w)]
            before = mask[w].copy()
            np.bitwise_and.at(mask, w, ~b)
            if not mask.any():                # the grammar allows nothing else: it wins
                mask[w] = before
        return mask
