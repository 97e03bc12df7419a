"""Block tables for tests that drive a backend directly, without the engine's KV manager."""

from __future__ import annotations

import numpy as np


def assign_blocks(*backends, rng: np.random.Generator | None = None) -> None:
    """Give every slot of the backends (same max_slots, max_context and block_size) its own blocks
    covering its whole context, in a random order when rng is given (block ids need not follow
    positions: the kernels must go through the tables)."""
    b0 = backends[0]
    mb = -(-b0.max_context // b0.block_size)
    ids = np.arange(b0.max_slots * mb)
    if rng is not None:
        ids = rng.permutation(ids)
    for b in backends:
        if (b.max_slots, b.max_context, b.block_size) != (b0.max_slots, b0.max_context, b0.block_size):
            raise ValueError("assign_blocks: the backends' slots, context and block size differ")
        if b.num_blocks < ids.size:
            raise ValueError(f"assign_blocks: {b.name} has {b.num_blocks} blocks, {ids.size} needed")
        for s in range(b.max_slots):
            b.set_block_table(s, ids[s * mb:(s + 1) * mb].tolist())
