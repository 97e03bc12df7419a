"""Block tables for tests that drive a backend directly (no engine, no KV manager)."""

from __future__ import annotations


def contiguous_table(backend, slot: int):
    """Give `slot` its own run of blocks covering the whole context (slot s: blocks s*n .. s*n+n-1,
    n blocks per context), as a fixed-slot cache had it; returns the backend."""
    n = -(-backend.max_context // backend.block_size)
    if backend.num_blocks < (slot + 1) * n:
        raise ValueError(f"{backend.num_blocks} KV blocks cannot give slot {slot} blocks {slot * n}..{(slot + 1) * n - 1}")
    backend.set_block_table(slot, range(slot * n, (slot + 1) * n))
    return backend


def contiguous_tables(backend):
    """contiguous_table for every slot."""
    for s in range(backend.max_slots):
        contiguous_table(backend, s)
    return backend
