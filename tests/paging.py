"""Block tables for tests that drive a backend directly (no engine, no KV manager)."""

from __future__ import annotations


def contiguous_tables(backend):
    """Give every slot its own run of blocks covering the whole context (slot s: blocks
    s*n .. s*n+n-1), as a fixed-slot cache had them; returns the backend."""
    n = -(-backend.max_context // backend.block_size)
    if backend.num_blocks < backend.max_slots * n:
        raise ValueError(f"{backend.num_blocks} KV blocks cannot give {backend.max_slots} slots {n} blocks each")
    for s in range(backend.max_slots):
        backend.set_block_table(s, range(s * n, (s + 1) * n))
    return backend
