"""One constrained row's mask computed on several threads: the vocabulary cut in parts.

llguidance computes a matcher's mask on one thread, walking the token trie; inside a bounded
string near its maxLength that walk covers most of a large vocabulary, longer than the
slack a batch-1 step leaves. Here each of K "part" tokenizers holds the tokens whose first two
bytes fall in its part (parts balanced by the bytes they hold), plus every single-byte token and
every special token; the other ids have no bytes, so no walk visits them. A sequence's K part matchers
follow its main matcher (each consumes every token as itself when it holds it, else as its
bytes, one single-byte token each), and the row's mask is the OR of the part masks, each cut to
the tokens its part owns: the bits a part computes for the tokens it holds are the main matcher's,
because the grammar sees the same bytes.

Except where the grammar forces bytes (llguidance's `compute_ff_bytes`): there llguidance
restricts the mask to the tokenizations of the forced text, and those depend on the vocabulary,
so a part would answer differently. Those states are cheap; the main matcher serves them
(guidance.Guidance.fill_masks)."""

from __future__ import annotations

import logging
from typing import Sequence

import llguidance
import numpy as np

log = logging.getLogger(__name__)


class _PartTokenizer:
    """What llguidance.TokenizerWrapper needs: the part's token bytes (b"" for ids it does not
    hold), the special ids, and an encoder (text as single-byte tokens, which every part holds)."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, single: dict[int, int],
                 main: "llguidance.LLTokenizer"):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = None
        self._single, self._main = single, main

    def __call__(self, data) -> list[int]:
        b = data if isinstance(data, bytes) else data.encode()
        if all(x in self._single for x in b):
            return [self._single[x] for x in b]
        return self._main.tokenize_bytes(b)


class VocabSplit:
    """A vocabulary in `parts` parts: the part tokenizers, which part owns each token (`own`,
    one bitmask per part, SampleRow.mask's layout) and how each part spells each token."""

    def __init__(self, main: "llguidance.LLTokenizer", n_vocab: int, words: int, parts: int,
                 slices: Sequence[str]):
        if parts < 2:
            raise ValueError("a split needs 2 or more parts")
        self.parts = parts
        data = [main.decode_bytes([t]) for t in range(n_vocab)]
        special = [t for t in range(n_vocab) if main.is_special_token(t)]
        is_special = np.zeros(n_vocab, bool)
        is_special[special] = True
        single: dict[int, int] = {}
        for t, b in enumerate(data):
            if len(b) == 1 and not is_special[t]:
                single.setdefault(b[0], t)
        # a token with a byte no single-byte token spells is held by every part (and owned by 0)
        spellable = np.array([all(x in single for x in b) for b in data])
        # parts by the first two bytes (a trie's subtrees stay whole; one first byte alone, the
        # space, starts 40% of a BPE vocabulary), balanced by the bytes they hold: the walk's work
        lengths = np.array([len(b) for b in data])
        head = np.array([(b[0] << 8) | b[1] if len(b) > 1 else 0 for b in data])
        weight = np.bincount(head, weights=np.where(is_special, 0, lengths), minlength=1 << 16)
        part_of_head = np.zeros(1 << 16, np.int64)
        load = np.zeros(parts)
        for h in np.argsort(-weight, kind="stable")[:np.count_nonzero(weight)]:   # heaviest first, to the lightest
            k = int(np.argmin(load))
            part_of_head[h] = k
            load[k] += weight[h]
        owned_by = np.where(is_special | (lengths <= 1) | ~spellable, 0, part_of_head[head])
        everywhere = is_special | ~spellable | (lengths <= 1)
        self.holds = np.stack([(owned_by == k) | everywhere for k in range(parts)])   # [parts, n_vocab]
        bits = np.zeros((parts, words * 32), bool)
        bits[:, :n_vocab] = owned_by[None, :] == np.arange(parts)[:, None]
        self.own = np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy()    # [parts, words]
        self._data, self._single = data, single
        eos = main.eos_tokens
        self.tokenizers = [
            llguidance.LLTokenizer(llguidance.TokenizerWrapper(_PartTokenizer(
                [b if self.holds[k, t] else b"" for t, b in enumerate(data)], special, eos[0], single, main)),
                n_vocab=n_vocab, eos_token=list(eos), slices=list(slices))
            for k in range(parts)]
        log.info("guidance: vocabulary split in %d parts for masks on threads", parts)

    def spell(self, part: int, token: int) -> list[int]:
        """The tokens part `part` consumes for `token`: itself if the part holds it, else its bytes."""
        if token >= self.holds.shape[1] or self.holds[part, token]:
            return [token]
        return [self._single[x] for x in self._data[token]]

    def matchers(self, grammar: str) -> list["llguidance.LLMatcher"]:
        return [llguidance.LLMatcher(t, grammar, log_level=0) for t in self.tokenizers]
