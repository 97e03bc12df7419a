"""Sampling parameters (validated, OpenAI field names) and the NumPy sampler.

Order of operations, the same as vLLM's: penalties on the raw logits, then temperature, then
top-k, top-p and min-p filters, then a draw from the sequence's own generator. Temperature 0
is greedy. Logprobs are reported from the raw (unpenalised, unscaled) distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError

MAX_LOGPROBS = 20
MAX_STOP = 16


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
        if self.logprobs is not None:
            num("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)
        if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be up to {MAX_STOP} non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
                bad("stop_token_ids", f"not a token id of this model: {t!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - np.max(logits)
    return z - np.log(np.sum(np.exp(z)))


class Sampler:
    """Per-sequence sampling state: its generator and the counts of tokens seen."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.p = params
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % (1 << 64))
        self.vocab = vocab_size
        self.needs_counts = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                             or params.frequency_penalty != 0.0)
        if self.needs_counts:
            self.seen = np.zeros(vocab_size, bool)          # prompt + output (repetition penalty)
            self.seen[np.asarray(prompt_ids, dtype=np.int64)] = True
            self.out_counts = np.zeros(vocab_size, np.int32)  # output only (presence / frequency)

    def observe(self, token: int) -> None:
        if self.needs_counts:
            self.seen[token] = True
            self.out_counts[token] += 1

    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        p = self.p
        if not self.needs_counts:
            return logits
        x = logits.astype(np.float32, copy=True)
        if p.repetition_penalty != 1.0:
            s = self.seen
            x[s] = np.where(x[s] > 0, x[s] / p.repetition_penalty, x[s] * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            x -= p.frequency_penalty * self.out_counts + p.presence_penalty * (self.out_counts > 0)
        return x

    def sample(self, logits: np.ndarray) -> int:
        p = self.p
        x = self.apply_penalties(logits[: self.vocab])
        if p.greedy:
            return int(np.argmax(x))
        x = x.astype(np.float64) / p.temperature
        if 0 < p.top_k < len(x):
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        probs = np.exp(x - np.max(x))
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            csum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            cut = int(np.searchsorted(csum, p.top_p)) + 1
            keep = np.zeros_like(probs, dtype=bool)
            keep[order[:cut]] = True
            probs = np.where(keep, probs, 0.0)
        if p.min_p > 0.0:
            probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
        return int(self.rng.choice(len(probs), p=probs))


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if k:
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top
