"""A backend's model runner (execute / sample / result) driven as tests drive it: one plain greedy
decode step fed from the host, and greedy steps chained on the device as the engine pipelines them."""

from __future__ import annotations

import numpy as np

from realizar_backend.backends import GREEDY, Step, run_step


def greedy_step(be, slots, tokens, positions) -> np.ndarray:
    """One decode step fed from the host, every row plain greedy: its tokens (int32 [n])."""
    return run_step(be, Step(slots=list(slots), tokens=list(tokens), positions=list(positions)),
                    [GREEDY] * len(slots)).tokens


def chained_steps(be, slots, tokens, positions, n: int) -> list[list[int]]:
    """n plain greedy steps, the first fed from the host, each next one executed on the device's
    tokens before the host reads the step before's: each step's tokens."""
    rows = [GREEDY] * len(slots)
    h = be.execute(Step(slots=list(slots), tokens=list(tokens), positions=list(positions)))
    out = []
    for i in range(n):
        be.sample(h, rows)
        nxt = be.execute(Step(slots=list(slots))) if i + 1 < n else None
        out.append(be.result(h).tokens.tolist())
        h = nxt
    return out
