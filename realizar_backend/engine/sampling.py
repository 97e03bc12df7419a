"""Sampling parameters (validated, OpenAI field names) and each sequence's Sampler: its seed and
the SampleRow of each of its draws, which the backend samples (every token, the first included).
The algorithm itself (the order of penalties, temperature and filters, the seeded draw) and its
NumPy twin are the backends' contract: backends/sampling.py says it in full."""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import LogitBias, SampleRow
from ..backends.sampling import MAX_LOGIT_BIAS, log_softmax
from ..errors import RequestError

MAX_LOGPROBS = 20
MAX_STOP = 16
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16     # None: up to the end of the context (chat default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # None: off; k: chosen token plus the top k
    logit_bias: dict | None = None  # token id (int, or its decimal string as in JSON) -> bias in [-100, 100]
    constraint: Any = None          # engine.guidance.Constraint the output follows (a grammar), or None
    min_tokens: int = 0             # stop tokens (and stop strings) have no effect before this many tokens
    thinking: Any = None            # engine.token_rules.Thinking: a reasoning model's thought and its budget

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(param, msg):
            raise RequestError(f"{param}: {msg}", param=param)

        def num(param, v, lo, hi, integer=False):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
                bad(param, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
            if not math.isfinite(v) or not (lo <= v <= hi):
                bad(param, f"must be between {lo} and {hi}, got {v!r}")

        if self.max_tokens is not None:
            num("max_tokens", self.max_tokens, 1, 1 << 30, integer=True)
        num("temperature", self.temperature, 0.0, 2.0)
        num("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            bad("top_p", "must be greater than 0")
        num("top_k", self.top_k, -1, 1 << 30, integer=True)
        num("min_p", self.min_p, 0.0, 1.0)
        num("repetition_penalty", self.repetition_penalty, 0.01, 10.0)
        num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            num("seed", self.seed, -(1 << 63), (1 << 64) - 1, integer=True)
        num("min_tokens", self.min_tokens, 0, 1 << 30, integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            num("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)
        if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be up to {MAX_STOP} non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
                bad("stop_token_ids", f"not a token id of this model: {t!r}")
        if self.logit_bias is not None:
            self.logit_bias_table(vocab_size)
        return self

    def logit_bias_table(self, vocab_size: int | None = None) -> LogitBias | None:
        """logit_bias as the backends take it (ids ascending); RequestError for a bad entry."""
        lb = self.logit_bias
        if lb is None:
            return None
        if not isinstance(lb, dict):
            raise RequestError("logit_bias: expected an object mapping token ids to biases", param="logit_bias")
        if len(lb) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(lb)}", param="logit_bias")
        table: dict[int, float] = {}
        for k, v in lb.items():
            tid = k
            # JSON keys are strings: a token id is written in ASCII digits (int() would also take
            # other scripts' digits, spaces and underscores)
            if isinstance(k, str) and _TOKEN_ID.fullmatch(k):
                tid = int(k)
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0 or (vocab_size and tid >= vocab_size):
                raise RequestError(f"logit_bias: {k!r} is not a token id of this model", param="logit_bias")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
                raise RequestError(f"logit_bias: the bias of token {k} must be a number in [-100, 100], got {v!r}",
                                   param="logit_bias")
            table[tid] = float(v)
        ids = np.array(sorted(table), np.int32)
        return LogitBias(ids, np.array([table[int(i)] for i in ids], np.float32))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One sequence's sampling as the backend takes it: its seed (drawn when the request has none),
    its logit bias, whether it has penalties (its token counts live on the backend:
    Backend.reset_counts), and the SampleRow of each draw."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.p = params
        self.seed = secrets.randbits(64) if params.seed is None else params.seed % (1 << 64)
        self.needs_counts = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                             or params.frequency_penalty != 0.0)
        bias = params.logit_bias_table(vocab_size)
        self.logit_bias = bias if bias is not None and len(bias) else None

    def row(self, step: int, logprobs: bool = False, want_logits: bool = False,
            mask: np.ndarray | None = None) -> SampleRow:
        """The draw of output token `step` (its index in the sequence: a draw is keyed by seed and
        step). mask: the sequence's allowed-token bitmask for it (engine/guidance.py), if any."""
        p = self.p
        return SampleRow(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                         repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                         frequency_penalty=p.frequency_penalty, seed=self.seed, step=step,
                         logprobs=logprobs, want_logits=want_logits, mask=mask, logit_bias=self.logit_bias)


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if k:
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top
