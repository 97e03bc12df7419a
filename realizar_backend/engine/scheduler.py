"""Continuous batching: which sequences wait, which run, and which KV slot each one holds.

A request waits until a KV slot is free, is prefilled, joins the running decode batch and
leaves on stop, length or cancel, freeing its slot at once. Everything here runs on the
engine's step thread; `submit` and `abort` are the only entry points from other threads.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CapacityError
from .sampling import Sampler, SamplingParams


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    sink: Callable[[Any], None]          # delivers RequestOutput / exceptions to the caller
    detok: Any                           # IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    emitted_text: str = ""               # text already handed to the caller
    pending_text: str = ""               # held back: may be the start of a stop string
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        """Tokens whose K/V are (or will be, after this step) in the cache."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, max_slots: int, max_context: int, max_waiting: int,
                 max_prefill_tokens: int | None = None):
        self.max_slots = max_slots
        self.max_context = max_context
        self.max_waiting = max_waiting
        # bounds one step's prefill so running sequences keep streaming while others arrive
        self.max_prefill_tokens = max_prefill_tokens or max(max_context, 2048)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.wakeup = threading.Condition(self._lock)

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) >= self.max_waiting:
                raise CapacityError(f"server is at capacity ({len(self.waiting)} requests waiting); "
                                    f"retry shortly", retry_after_s=1)
            self.waiting.append(seq)
            self.wakeup.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self.wakeup.notify()

    def take_aborts(self) -> set[str]:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        return ids

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, up to the step's prefill budget."""
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        with self._lock:
            while self.waiting and self.free_slots:
                n = len(self.waiting[0].prompt_ids)
                if admitted and n > budget:
                    break
                seq = self.waiting.popleft()
                seq.slot = self.free_slots.pop()
                budget -= n
                admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from wherever it is; returns its slot to the pool."""
        with self._lock:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def kv_usage(self) -> float:
        used = sum(s.length for s in self.running)
        return used / float(self.max_slots * self.max_context)

    def find(self, request_id: str) -> Sequence | None:
        for s in self.running:
            if s.request_id == request_id:
                return s
        with self._lock:
            for s in self.waiting:
                if s.request_id == request_id:
                    return s
        return None
