"""The paged fp16 KV cache (kernels/paged_kv.cuh): per attention layer (a hybrid's recurrent layers
keep none) a K and a V pool of blocks of `block_size` positions, and the block tables that map each
slot's positions to blocks.

The pool has num_blocks + 1 blocks: the last is scratch, and so is the last table row (the scratch
slot, whose every entry names the scratch block): padded rows of a bucketed decode batch run on
the scratch slot at position 0, so they never touch a live block. The engine's KV manager decides
which blocks a sequence owns; `set_tables` copies the slots' tables to the device, only the entries
that changed (a growing sequence adds one entry per block_size tokens), in one asynchronous copy from
pinned memory on the backend's stream, so a step enqueued after it sees it and one enqueued before it
does not, and the host never waits for the step in flight."""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import cupy
import numpy as np

from ...model.config import ModelConfig
from ..base import checked_tables
from .ops import PagedKV

log = logging.getLogger(__name__)

STAGING_MAX = 16       # pinned copies of the block tables for uploads still queued, at most


def block_bytes(cfg: ModelConfig, block_size: int) -> int:
    """Device bytes of one block: K and V of every layer that keeps them (cfg.kv_layers), fp16."""
    return block_size * cfg.kv_bytes_per_token(2)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_slots: int, max_context: int):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {block_size}")
        self.block_size = block_size
        self.bs_log2 = block_size.bit_length() - 1
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.max_blocks = -(-max_context // block_size)
        self.max_slots = max_slots
        self.scratch_slot = max_slots
        layers = cfg.kv_layers
        shape = (len(layers), num_blocks + 1, block_size, cfg.n_kv_heads, cfg.head_dim)
        # Not zeroed (the server's pool is tens of GB): no kernel reads a row nobody wrote. A row
        # attends to positions [start, pos] of its own slot, each written before (its prompt by
        # rope_kv, each decoded token by the step's fused KV write; a shared prefix block by the
        # sequence that filled it); the flash kernels zero-fill key tiles past the range (cp.async
        # with src-size 0) instead of loading them, attention.cu's spare lanes re-read a key in
        # range, and flash decode's stale copy of the new key (pos itself, read before the write
        # lands) is replaced from shared memory before use. Padded rows of a bucket run on the
        # scratch slot at position 0, written by the same step. A block handed to a new sequence
        # holds the last one's values, which the same rule covers.
        self.k = cupy.empty(shape, cupy.float16)
        self.v = cupy.empty(shape, cupy.float16)
        self._host = np.full((max_slots + 1, self.max_blocks), self.scratch_block, np.int32)   # what the device holds
        # uploaded, not cupy.full: that runs one of CuPy's own kernels, which a start with an empty
        # kernel cache would first compile with NVRTC
        self.tables = cupy.asarray(self._host)
        self.covered = np.zeros(max_slots + 1, np.int64)    # positions each slot's table covers
        # pinned copies of the tables that uploads read from: an upload from pageable memory waits
        # for the work already on the stream (a decode step or a prefill in flight), one from pinned
        # memory does not. A copy is written again only once its last upload is done; the host may
        # run a prefill and a step ahead of the device, so there are as many copies as that takes
        self._staging: list[tuple[object, np.ndarray, cupy.cuda.Event]] = []
        self.covered[self.scratch_slot] = block_size
        layer_bytes = self.k.nbytes // len(layers)
        self._layers = {li: PagedKV(self.k.data.ptr + i * layer_bytes, self.v.data.ptr + i * layer_bytes,
                                    self.tables.data.ptr, self.max_blocks, self.bs_log2) for i, li in enumerate(layers)}
        log.info("cuda kv cache: %d blocks of %d positions (%d tokens), %.1f MB fp16; up to %d blocks per sequence",
                 num_blocks, block_size, num_blocks * block_size, self.nbytes / 1e6, self.max_blocks)

    def layer(self, li: int) -> PagedKV:
        return self._layers[li]

    def set_table(self, slot: int, blocks: Sequence[int], stream: cupy.cuda.Stream) -> None:
        self.set_tables({slot: blocks}, stream)

    def set_tables(self, tables: Mapping[int, Sequence[int]], stream: cupy.cuda.Stream) -> None:
        """slot -> blocks for several slots, in one host-to-device copy: the rectangle of table rows
        and entries that changed (rows in between that did not change are copied with the values
        the device already has). One copy, because a step where 64 sequences cross a block boundary
        together, or 16 prompts are admitted, would otherwise pay 64 or 16 copies."""
        checked = checked_tables(tables, self.max_slots, self.max_blocks, self.num_blocks)
        rows: list[tuple[int, int, int]] = []          # (slot, first changed entry, end)
        for slot, b in checked:
            self.covered[slot] = b.size * self.block_size
            diff = np.flatnonzero(self._host[slot, :b.size] != b)
            if diff.size:
                i = int(diff[0])
                self._host[slot, i:b.size] = b[i:]
                rows.append((slot, i, b.size))
        if not rows:
            return
        r0, r1 = min(r[0] for r in rows), max(r[0] for r in rows) + 1
        c0, c1 = min(r[1] for r in rows), max(r[2] for r in rows)
        item = self._host.itemsize
        pitch = self.max_blocks * item
        staged, done = self._free_staging()
        staged[r0:r1, c0:c1] = self._host[r0:r1, c0:c1]
        # in stream order: steps queued before see the old tables, steps queued after the new ones
        cupy.cuda.runtime.memcpy2DAsync(self.tables.data.ptr + (r0 * self.max_blocks + c0) * item, pitch,
                                        staged[r0:, c0:].ctypes.data, pitch, (c1 - c0) * item, r1 - r0,
                                        cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        done.record(stream)

    def _free_staging(self) -> tuple[np.ndarray, cupy.cuda.Event]:
        """A pinned copy of the tables that no queued upload still reads: a free one, else a new
        one, else (STAGING_MAX of them busy) the oldest once its upload is done."""
        for i, (_, staged, done) in enumerate(self._staging):
            if done.done:
                self._staging.append(self._staging.pop(i))      # most recently used last
                return staged, done
        if len(self._staging) < STAGING_MAX:
            mem = cupy.cuda.alloc_pinned_memory(self._host.nbytes)
            self._staging.append((mem, np.frombuffer(mem, np.int32, self._host.size).reshape(self._host.shape),
                                  cupy.cuda.Event(disable_timing=True)))
        else:
            self._staging.append(self._staging.pop(0))
            self._staging[-1][2].synchronize()
        return self._staging[-1][1], self._staging[-1][2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.tables.nbytes

    def close(self) -> None:
        self.k = self.v = self.tables = None
        self._staging.clear()
        self._layers.clear()
