"""The recurrent state of a linear-attention hybrid on the GPU: per Gated DeltaNet layer and sequence
slot, the conv inputs kept (float32 [slots, conv_kernel - 1, channels]) and each value head's delta
state (float32 [slots, v_heads, k_dim, v_dim]), as the NumPy backend keeps them (backends/cpu.py
recurrent_state). Allocated once at load, before the KV pool is sized from what is left, at fixed
addresses (the decode graphs read and write them). The kernels (kernels/deltanet.cu) start a
sequence's first step (position 0) from zero, so a slot needs no clearing between sequences."""

from __future__ import annotations

import cupy

from ...model.config import ModelConfig


class RecurrentState:
    def __init__(self, c: ModelConfig, max_slots: int):
        channels = 2 * c.ssm_k_heads * c.ssm_k_dim + c.ssm_v_heads * c.ssm_v_dim
        self.layers = [(cupy.zeros((max_slots, c.ssm_conv_kernel - 1, channels), cupy.float32),
                        cupy.zeros((max_slots, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim), cupy.float32))
                       for _ in range(sum(c.recurrent))]

    def layer(self, i: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        """Recurrent layer i's (conv state, delta state)."""
        return self.layers[i]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers)

    def close(self) -> None:
        self.layers.clear()
