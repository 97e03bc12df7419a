"""The KV block manager: which blocks of the backend's KV pool each sequence owns.

The pool is `num_blocks` blocks of `block_size` positions. A sequence owns a block table (block
ids in position order); it takes a new block only when its next position crosses a block
boundary, and gives them all back when it finishes, is cancelled or is preempted.

Automatic prefix caching: once every position of a full block is computed, the block is keyed by
a hash of its tokens chained with the key of the block before it (so the key names the whole
prefix up to the block's end). A later sequence whose tokens start with the same prefix takes
those blocks instead of computing them again: they are shared (reference-counted) and never
written, since a sequence writes only positions past its cached prefix. A freed block keeps its
key and stays reusable until its memory is needed for something else: free blocks are handed out
least recently freed first, blocks without a key before any with one (LRU eviction).
A hit never covers a prompt's last token: its logits must be computed.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Hashable, Sequence

import numpy as np

TokenSlice = Callable[[int, int], Sequence[int]]   # (start, end) -> the sequence's tokens there


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}        # prefix key -> block holding it
        # free blocks, the next to hand out first; a block with a key is evicted when handed out
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}     # positions each sequence holds
        self._keys: dict[Hashable, list[bytes]] = {}   # keys of each sequence's leading full blocks
        self._shared_extra = 0                     # sum over blocks of (refs - 1): shared, counted once
        self._logical_tokens = 0
        # cumulative counters (prompt tokens looked up in the prefix cache, and found there)
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------ sizes and usage
    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now (free ones, cached or not)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_tokens(self) -> int:
        """Positions held by sequences, a shared block counted once."""
        return self._logical_tokens - self._shared_extra * self.block_size

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def table(self, seq: Hashable) -> list[int]:
        return self._tables[seq]

    def holds(self, seq: Hashable) -> bool:
        return seq in self._tables

    # ------------------------------------------------------------ prefix cache
    def _chain(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(parent or b"root")
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        return h.digest()

    def _lookup(self, tokens: TokenSlice, n_tokens: int) -> tuple[list[int], list[bytes]]:
        """The cached blocks of the longest cached prefix of the first n_tokens tokens (full
        blocks only, and never the block of the last token), with their keys."""
        if not self.prefix_caching:
            return [], []
        blocks, keys = [], []
        parent = None
        bs = self.block_size
        for i in range((n_tokens - 1) // bs):
            k = self._chain(parent, tokens(i * bs, (i + 1) * bs))
            b = self._cached.get(k)
            if b is None:
                break
            blocks.append(b)
            keys.append(k)
            parent = k
        return blocks, keys

    # ------------------------------------------------------------ allocation
    def can_allocate(self, tokens: TokenSlice, n_tokens: int, reserve: int = 0) -> bool:
        """Whether `allocate` for the first n_tokens tokens would succeed and still leave
        `reserve` blocks free."""
        return self._fits(self._lookup(tokens, n_tokens)[0], n_tokens, reserve)

    def _fits(self, hits: list[int], n_tokens: int, reserve: int) -> bool:
        taken_from_free = sum(1 for b in hits if self._ref[b] == 0)
        return self.blocks_for(n_tokens) - len(hits) + taken_from_free + reserve <= len(self._free)

    def allocate(self, seq: Hashable, tokens: TokenSlice, n_tokens: int) -> int:
        """Give `seq` blocks for its first n_tokens positions, reusing the longest cached prefix;
        returns how many leading tokens are already computed there (a multiple of block_size).
        Raises MemoryError when the pool cannot hold them (nothing changes then)."""
        hit = self.try_allocate(seq, tokens, n_tokens)
        if hit is None:
            raise MemoryError(f"{n_tokens} tokens need {self.blocks_for(n_tokens)} KV blocks; "
                              f"{len(self._free)} of {self.num_blocks} are free")
        return hit

    def try_allocate(self, seq: Hashable, tokens: TokenSlice, n_tokens: int, reserve: int = 0) -> int | None:
        """`allocate`, or None (and no change) when the pool cannot hold the sequence and still
        leave `reserve` blocks free. The prefix is looked up (its blocks hashed) once: a hit on a
        long prompt hashes hundreds of blocks."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} already holds KV blocks")
        hits, keys = self._lookup(tokens, n_tokens)
        if not self._fits(hits, n_tokens, reserve):
            return None
        table = []
        for b in hits:
            self._take(b)
            table.append(b)
        for _ in range(self.blocks_for(n_tokens) - len(hits)):
            table.append(self._new_block())
        self._tables[seq] = table
        self._tokens[seq] = n_tokens
        self._logical_tokens += n_tokens
        self._keys[seq] = keys
        hit = len(hits) * self.block_size
        if self.prefix_caching:
            self.queried_tokens += n_tokens
            self.hit_tokens += hit
        return hit

    def append(self, seq: Hashable, n_tokens: int) -> bool:
        """Grow `seq` to hold n_tokens positions (new blocks only past a block boundary).
        False, and no change, when the pool has too few free blocks."""
        table = self._tables[seq]
        need = self.blocks_for(n_tokens) - len(table)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._new_block())
        if n_tokens > self._tokens[seq]:
            self._logical_tokens += n_tokens - self._tokens[seq]
            self._tokens[seq] = n_tokens
        return True

    def commit(self, seq: Hashable, tokens: TokenSlice, n_computed: int) -> None:
        """The first n_computed positions of `seq` now hold computed K/V for these tokens: key
        the full blocks among them, so later sequences can share them."""
        if not self.prefix_caching or seq not in self._tables:
            return
        keys, table, bs = self._keys[seq], self._tables[seq], self.block_size
        for i in range(len(keys), min(n_computed // bs, len(table))):
            k = self._chain(keys[-1] if keys else None, tokens(i * bs, (i + 1) * bs))
            keys.append(k)
            b = table[i]
            # the same prefix computed twice (two sequences at once): the first copy is the key's
            if k not in self._cached and self._key[b] is None:
                self._cached[k] = b
                self._key[b] = k

    def free(self, seq: Hashable) -> None:
        """Return every block of `seq` (a no-op for a sequence that holds none). Blocks go back
        last first, so a sequence's tail is evicted before the prefix others may share."""
        table = self._tables.pop(seq, None)
        if table is None:
            return
        self._logical_tokens -= self._tokens.pop(seq)
        del self._keys[seq]
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] > 0:
                self._shared_extra -= 1
                continue
            self._free[b] = None
            if self._key[b] is None:
                self._free.move_to_end(b, last=False)    # worth nothing: handed out first

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks in use stay where they are)."""
        for k, b in self._cached.items():
            self._key[b] = None
        self._cached.clear()

    # ------------------------------------------------------------ internals
    def _take(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._free[b]
        else:
            self._shared_extra += 1
        self._ref[b] += 1

    def _new_block(self) -> int:
        b, _ = self._free.popitem(last=False)
        k = self._key[b]
        if k is not None:                       # evict: its prefix is no longer cached
            del self._cached[k]
            self._key[b] = None
        self._ref[b] = 1
        return b
