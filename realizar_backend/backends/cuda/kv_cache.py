"""fp16 KV cache: per layer [slots + 1, context, kv_heads, head_dim] for K and for V. The extra
slot is scratch: padded rows of a bucketed decode batch write and read there, never a live slot."""

from __future__ import annotations

import logging

import cupy

from ...model.config import ModelConfig

log = logging.getLogger(__name__)


class KVCache:
    def __init__(self, cfg: ModelConfig, max_slots: int, max_context: int):
        self.slots = max_slots + 1
        self.scratch_slot = max_slots
        self.context = max_context
        shape = (cfg.n_layers, self.slots, max_context, cfg.n_kv_heads, cfg.head_dim)
        # zeroed once so a read of a never-written row is finite
        self.k = cupy.zeros(shape, cupy.float16)
        self.v = cupy.zeros(shape, cupy.float16)
        layer_bytes = self.k.nbytes // cfg.n_layers
        self.k_ptrs = [self.k.data.ptr + i * layer_bytes for i in range(cfg.n_layers)]
        self.v_ptrs = [self.v.data.ptr + i * layer_bytes for i in range(cfg.n_layers)]
        log.info("cuda kv cache: %d slots x %d positions, %.1f MB fp16", max_slots, max_context, self.nbytes / 1e6)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def close(self) -> None:
        self.k = self.v = None
        self.k_ptrs.clear()
        self.v_ptrs.clear()
