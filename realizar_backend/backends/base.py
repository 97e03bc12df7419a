"""The Backend protocol: the seam between the engine and the hardware.

The engine owns scheduling and sampling; a backend owns weights, the KV cache and the forward
pass. KV memory is organised in `max_slots` slots of `max_context` positions each; the engine
hands out slot ids (0 .. max_slots-1) and tells the backend when a slot is free again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..model.config import ModelConfig


@dataclass
class PrefillItem:
    slot: int
    tokens: np.ndarray      # int32 [n] prompt tokens to run
    start_pos: int = 0      # position of tokens[0]; > 0 continues a sequence already in the slot


@runtime_checkable
class Backend(Protocol):
    name: str               # "cpu" | "cuda"
    config: ModelConfig
    max_slots: int
    max_context: int

    def prefill(self, items: Sequence[PrefillItem]) -> np.ndarray:
        """Run prompts into their slots' KV caches; float32 logits [len(items), vocab] at each
        item's last token."""

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One step for a batch: token i goes to slot i at position i. float32 logits [n, vocab]."""

    def decode_argmax(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Greedy step: like decode, but only the argmax ids (int32 [n]) come back."""

    def release(self, slot: int) -> None:
        """The slot's sequence is gone; its KV cache may be reused."""

    def stats(self) -> dict[str, Any]:
        """Numbers for the metrics: graph status per bucket, pool bytes, device memory."""

    def close(self) -> None:
        """Free device resources."""
