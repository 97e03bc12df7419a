"""Continuous batching over a paged KV cache: which sequences wait, which run, what each step does.

Every step (`schedule`) plans, in this order:
1. decode: every running sequence whose prompt is in the cache feeds its newest token at its next
   position. A sequence whose next position crosses a block boundary takes a block; when none is
   free, the running sequence that arrived last is preempted (vLLM's recompute policy: its blocks
   are freed and it waits again at the front of the queue; readmitted, it prefills its prompt and
   all its generated tokens but the last, then decodes on, and its client sees only a delay).
2. prefill and admission: within a budget of `prefill_chunk_tokens` prompt tokens per step, the
   sequences whose prompt is not yet (all) in the cache get its next chunk, and waiting sequences
   are admitted (while a slot is free and the pool has blocks for the whole prompt, after the
   prefix cache's hits, keeping a small reserve for the running sequences' growth) and get their
   first chunk. So a long prompt runs over several steps and every step still decodes the others.
   Nothing is admitted in a step that preempted.
   Both go to the least served request first: its sequences' tokens in the cache so far, summed
   (a request's choices are one request: see `Sequence.group`), ties in arrival order. A request
   that has had nothing yet goes before one whose many long prompts have been prefilling for a
   while, so a short request is not queued behind another's minutes of prefill; within a request,
   and among requests not served yet, first come first served (no request starves). A sequence
   that cannot be admitted (no slot or blocks) stops admission for the step: nothing overtakes it.

A slot is a row of the backend's block tables (0 .. max_slots-1). Everything here runs on the
engine's step thread; `submit` and `abort` are the only entry points from other threads.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CapacityError, ContextOverflowError, RealizarError
from .kv_manager import KVManager
from .sampling import Sampler, SamplingParams

_ids = itertools.count()


@dataclass(eq=False)      # a sequence is itself: list membership and removal go by identity
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    sink: Callable[[Any], None]          # delivers RequestOutput / exceptions to the caller
    detok: Any                           # IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    seq_id: int = field(default_factory=lambda: next(_ids))   # arrival order; the KV manager's key
    slot: int = -1
    num_computed: int = 0                # leading tokens whose K/V are in the cache
    output_ids: list[int] = field(default_factory=list)
    emitted_text: str = ""               # text already handed to the caller
    pending_text: str = ""               # held back: may be the start of a stop string
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    stop_string: str | None = None       # the stop string that ended it (outputs.add_text)
    preemptions: int = 0
    synced_blocks: int = 0               # entries of its block table the backend has been given
    # constrained decoding (engine/guidance.py): the grammar's state after the tokens generated
    # so far. A preempted sequence keeps it: its output (all consumed) is kept too.
    guide: Any = None
    # the host's rules on its next tokens (engine/token_rules.py: min_tokens, a thinking budget)
    rules: Any = None
    cached_tokens: int | None = None     # prompt tokens the prefix cache held at its first admission

    @property
    def constrained(self) -> bool:
        """A grammar, a logit bias or a rule of the host changes this sequence's logits before a draw."""
        return (self.guide is not None or self.sampler.logit_bias is not None
                or (self.rules is not None and self.rules.constrains(len(self.output_ids))))

    @property
    def kv_target(self) -> int:
        """Tokens that must be in the cache before the sequence decodes: its prompt, plus (after a
        preemption) what it had generated except the newest token, which the next decode feeds."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.kv_target

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0):end - n]

    @property
    def order(self) -> tuple[float, int]:
        return (self.arrival, self.seq_id)

    @property
    def group(self) -> str:
        """The request this sequence is a choice of: its request id up to a final `-<choice>`
        (the server names a request's n choices `<request>-0` ... `<request>-<n-1>`)."""
        head, sep, tail = self.request_id.rpartition("-")
        return head if sep and tail.isdigit() else self.request_id


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)       # in arrival order
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)   # (seq, start, n tokens)
    tables: dict[int, list[int]] = field(default_factory=dict)  # slot -> block table to set
    released: list[int] = field(default_factory=list)           # slots whose sequence was preempted
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, RealizarError]] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVManager, max_slots: int, max_waiting: int, prefill_chunk_tokens: int):
        self.kv = kv
        self.max_slots = max_slots
        self.max_waiting = max_waiting
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # blocks left free at admission while others run, so that they can grow for a while
        # before a newcomer forces a preemption (vLLM's watermark)
        self.reserve_blocks = max(1, kv.num_blocks // 100)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []          # arrival order
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.preemptions = 0                       # cumulative
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.wakeup = threading.Condition(self._lock)

    # ------------------------------------------------------------ other threads
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

    # ------------------------------------------------------------ the step thread
    def take_aborts(self) -> set[str]:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        return ids

    def waiting_blocks(self) -> int:
        """KV blocks the waiting sequences' prompts want (before prefix-cache hits): what must
        free up before a newcomer is admitted (nothing overtakes them)."""
        with self._lock:
            return sum(self.kv.blocks_for(s.kv_target) for s in self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # 1. decode: a block for each decoding sequence's next position, preempting if need be
        for seq in list(self.running):
            if seq not in self.running or seq.prefilling:
                continue
            while not self.kv.append(seq.seq_id, seq.num_computed + 1):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    plan.failed.append((seq, self._too_big(seq)))
                    self._drop(seq, plan)
                    break
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)
        # 2. prefill and admission, least served request first
        served: dict[str, int] = collections.Counter()
        for seq in self.running:
            served[seq.group] += seq.num_computed

        def rank(seq: Sequence) -> tuple:
            return (served.get(seq.group, 0), seq.arrival, seq.seq_id)

        budget = self.prefill_chunk_tokens
        prefilling = sorted((s for s in self.running if s.prefilling), key=rank)
        admitting = not plan.preempted
        i = j = 0
        with self._lock:
            # ranks do not change within the step (served counts the running sequences as the step
            # found them), so the waiting ones are sorted once: one sort a step, not a scan per admission
            queue = sorted(self.waiting, key=rank) if admitting and self.free_slots else []
            while budget > 0:
                nxt = prefilling[i] if i < len(prefilling) else None
                new = queue[j] if admitting and j < len(queue) and self.free_slots else None
                if new is not None and (nxt is None or rank(new) < rank(nxt)):
                    j += 1
                    admitted = self._admit(new, plan)
                    if admitted is None:          # no room: nothing overtakes it this step
                        admitting = False
                    if not admitted:
                        continue
                    seq = new
                elif nxt is not None:
                    seq, i = nxt, i + 1
                else:
                    break
                n = min(seq.kv_target - seq.num_computed, budget)
                plan.prefill.append((seq, seq.num_computed, n))
                budget -= n
        plan.tables = self.unsynced_tables(self.running)
        return plan

    def _admit(self, seq: Sequence, plan: StepPlan) -> bool | None:
        """Move a waiting sequence to the running ones, with a slot and the blocks of its whole
        prompt (True); None when the pool has not the blocks now (it waits on); False when it
        could never fit (it fails). The caller holds the lock."""
        target = seq.kv_target
        if self.kv.blocks_for(target) > self.kv.num_blocks:
            self.waiting.remove(seq)
            plan.failed.append((seq, self._too_big(seq)))
            return False
        hit = self.kv.try_allocate(seq.seq_id, seq.tokens, target, self.reserve_blocks if self.running else 0)
        if hit is None:
            return None
        self.waiting.remove(seq)
        seq.num_computed = hit
        if seq.cached_tokens is None:       # a readmission after a preemption is not the request's
            seq.cached_tokens = min(hit, len(seq.prompt_ids))
        seq.slot = self.free_slots.pop()
        seq.synced_blocks = 0
        self.running.insert(bisect.bisect([s.order for s in self.running], seq.order), seq)
        return True

    def unsynced_tables(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """slot -> block table of each sequence whose table grew (or that is new in its slot) since
        the backend last had it; the caller gives them to the backend before the next step."""
        out = {}
        for seq in seqs:
            table = self.kv.table(seq.seq_id)
            if len(table) != seq.synced_blocks:
                out[seq.slot] = list(table)
                seq.synced_blocks = len(table)
        return out

    def grow_for_next_step(self, batch: list[Sequence], positions: list[int]) -> dict[int, list[int]] | None:
        """Blocks for the position each sequence of `batch` writes in a step started ahead; the
        tables to give the backend, or None when the pool is out of blocks (then no step goes
        ahead; the next `schedule` preempts if it must)."""
        for seq, pos in zip(batch, positions):
            if not self.kv.append(seq.seq_id, pos + 1):
                return None
        return self.unsynced_tables(batch)

    def computed(self, seq: Sequence, n: int) -> None:
        """n more of the sequence's tokens are in the cache (a prefill chunk or a decode step)."""
        seq.num_computed += n
        self.kv.commit(seq.seq_id, seq.tokens, seq.num_computed)

    def remove(self, seq: Sequence, hold: bool = False) -> None:
        """Drop a sequence from wherever it is; its KV blocks and slot are free at once, or with
        hold when the caller calls `free` (a step in flight still writes them)."""
        with self._lock:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if seq in self.running:
            self.running.remove(seq)
        if not hold:
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        """The KV blocks and slot of a sequence that was removed."""
        self.kv.free(seq.seq_id)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def find(self, request_id: str) -> Sequence | None:
        for s in self.running:
            if s.request_id == request_id:
                return s
        with self._lock:
            for s in self.waiting:
                if s.request_id == request_id:
                    return s
        return None

    # ------------------------------------------------------------ internals
    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        plan.released.append(seq.slot)
        self.remove(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        plan.preempted.append(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        with self._lock:            # back in the queue, in arrival order (ahead of later arrivals)
            keys = [s.order for s in self.waiting]
            self.waiting.insert(bisect.bisect(keys, seq.order), seq)

    def _drop(self, seq: Sequence, plan: StepPlan) -> None:
        plan.released.append(seq.slot)
        self.remove(seq)

    def _too_big(self, seq: Sequence) -> RealizarError:
        pool = self.kv.num_blocks * self.kv.block_size
        return ContextOverflowError(f"the sequence needs more than this server's whole KV cache "
                                    f"({pool} tokens)", param=None)
