"""Sample rows for the pipelined-sampling tests (CPU and GPU): seeded draws with top-k / top-p,
penalties, a greedy masked row and a sampled masked row with a logit bias, whose masks depend on
the previous token as a grammar's do."""

from __future__ import annotations

import numpy as np

from realizar_backend.backends.base import LogitBias, SampleRow

STEPS = 8


def rows(step: int, masks: np.ndarray) -> list[SampleRow]:
    return [SampleRow(temperature=0.9, top_k=40, seed=11, step=step, logprobs=True),
            SampleRow(temperature=0.7, top_p=0.9, seed=2**63 + 5, step=step, repetition_penalty=1.3,
                      frequency_penalty=0.4, presence_penalty=0.2),
            SampleRow(temperature=0.0, step=step, mask=masks[0]),
            SampleRow(temperature=1.0, seed=7, step=step, mask=masks[1],
                      logit_bias=LogitBias(np.array([5, 9], np.int32), np.array([3.0, -2.0], np.float32)))]


def fill_masks(masks: np.ndarray, prev: list[int], V: int) -> None:
    """Masks that depend on the previous token (as a grammar's do): ids not congruent to it mod 3."""
    ids = np.arange(V)
    for k, row in enumerate((2, 3)):
        allowed = ids[ids % 3 != prev[row] % 3]
        bits = np.zeros(masks.shape[1] * 32, bool)
        bits[allowed] = True
        masks[k] = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
