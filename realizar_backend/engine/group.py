"""Engine cores behind one front end: one engine process per GPU (or several on the CPU), and the
router that sends each request to one of them. The routes see one engine (this class has
EngineClient's API); the front end tokenizes, renders templates and checks grammars once, and an
engine core takes token ids.

NOTE on routing, the invariants:
- a request runs start to end on the engine it was sent to (its KV cache lives there); every choice
  of an n > 1 request is a request of its own, and goes where its prompt's prefix is (below);
- the router counts what is in flight on each engine itself (a request counts from its submit to
  the end of its stream): the counts need no report from the engines, so a burst of requests
  spreads at once, and a slow stats report cannot skew them. With several front ends (engine/shared.py) it adds
  what the other front ends have in flight there, as the engine's load board says;
- among the engines that can take work (alive, not stuck), a request goes to the first by
  (KV-full, requests in flight, prompt tokens in flight, index): KV-full engines last, then the
  fewest requests, then the fewest prompt tokens, then the lowest index. An engine is KV-full for
  a prompt when its latest report, if younger than KV_REPORT_TTL_S, leaves less than KV_ROOM of
  its pool free once the blocks its waiting requests want and this prompt's blocks are taken:
  there the request would queue, or soon make a sequence be preempted. So while one engine has
  room, a nearly full one gets nothing new; when all are full (or none is), the counts decide;
- the KV state is the engines' (a report per change of their batch, at most 50 ms apart while
  they step: engine.py), the counts are the router's own: a burst spreads over the engines with
  room at once by the counts, and a report that stops coming (an engine gone idle, whose blocks
  are then free, or in one long step) stops counting after KV_REPORT_TTL_S, so a stale report
  cannot keep work off an engine. With several front ends every one reads the KV state the
  engine writes on its load board (engine/shared.py);
- a request whose first PREFIX_TOKENS prompt tokens went to an engine recently goes back to that
  engine (its prefix cache holds their KV blocks) while it is no more KV-full than the chosen one
  and has at most PREFIX_SLACK more requests in flight than it; the prompt head then belongs to
  the engine it went to. The heads are remembered in a `PrefixTable` (engine/shared.py), which
  with several front ends is one file that all of them read and write: a known prefix goes to
  its engine through whichever front end it comes;
- an engine that dies or is stuck stands aside: nothing new goes to it; its requests in flight end
  with a retryable error (EngineClient). The group serves while one engine can.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from ..errors import CapacityError
from ..settings import Settings
from .prep import RequestPrep
from .shared import PrefixTable, prefix_path

log = logging.getLogger(__name__)

PREFIX_TOKENS = 64            # the prompt head whose KV blocks an engine's prefix cache may hold
PREFIX_SLACK = 4              # requests in flight an engine may be ahead of the least busy and keep its prefixes
KV_ROOM = 1 / 16              # the share of its KV pool an engine must keep free after a new prompt, or it is KV-full
KV_REPORT_TTL_S = 2.0         # an engine's KV report counts this long (it reports at most 50 ms apart while it steps)

# the engine reports whose numbers add up over the engines (the rest: the first engine's)
_KV_KEYS = ("kv_used_blocks", "kv_total_blocks")


def merge_stats(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for the group: numbers and dicts of numbers summed over the engines, the KV
    usage over their pools together, a graph bucket's status the worst of the engines'."""
    reports = [r for r in reports if r]
    if not reports:
        return {}
    out: dict[str, Any] = dict(reports[0])
    for key, value in reports[0].items():
        if isinstance(value, bool) or key == "graph_status":
            continue
        if isinstance(value, (int, float)):
            out[key] = sum(r.get(key, 0) for r in reports)
        elif isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            keys = {k for r in reports for k in (r.get(key) or {})}
            out[key] = {k: sum((r.get(key) or {}).get(k, 0) for r in reports) for k in keys}
    used, total = (sum(r.get(k, 0) for r in reports) for k in _KV_KEYS)
    out["kv_usage"] = used / total if total else 0.0
    rank = {"captured": 0, "disabled": 1, "eager-fallback": 2}
    graphs: dict[str, str] = {}
    for r in reports:
        for bucket, status in (r.get("graph_status") or {}).items():
            if rank.get(status, 3) >= rank.get(graphs.get(bucket, "captured"), 3):
                graphs[bucket] = status
    out["graph_status"] = graphs
    out["engines"] = len(reports)
    return out


class EngineGroup(RequestPrep):
    def __init__(self, settings: Settings, devices: list[str], on_exit: Callable | None = None):
        """devices: one label per engine (its GPU, or "cpu"); start() fills the members."""
        self.settings = settings
        self.devices = devices
        self.members: list[Any] = [None] * len(devices)      # EngineClient, or None where it failed
        self.failures: dict[int, BaseException] = {}
        self._on_exit = on_exit
        self._reports: list[dict[str, Any]] = [{} for _ in devices]
        self._lock = threading.Lock()
        self._inflight = [0] * len(devices)
        self._tokens = [0] * len(devices)
        self._owner: dict[str, int] = {}                      # request id -> engine
        self._prefixes = PrefixTable.private()                 # prompt head -> engine (start: shared)

    # ---------------------------------------------------------------- start
    @classmethod
    def start(cls, settings: Settings, devices: list[str | None], observer_of: Callable[[int], Any] | None = None,
              on_exit: Callable | None = None, shared: str | None = None, quiet: bool = False) -> "EngineGroup":
        """Start one engine process per entry of devices (a GPU's CUDA_VISIBLE_DEVICES entry, or
        None: the CPU) side by side; returns once every one is ready or has failed. An engine that
        fails stands aside; when every one fails, the first one's error is raised. observer_of(i):
        engine i's observer (from 1; engine.EngineObserver), which gets its first report at once.
        on_exit(error): called once the last engine has died. shared: the directory where engines
        that another process started listen (engine/shared.py): connect to them instead. quiet:
        leave the engines' load failures unsaid (another front end says them)."""
        from ..formats import open_model
        from ..model.chat_template import TemplateLimits
        from ..model.default import default_model_path
        from ..model.tokenizer import Tokenizer
        from .process import EngineClient

        group = cls(settings, [d if d is not None else "cpu" for d in devices], on_exit)
        observers = [observer_of(i + 1) if observer_of else None for i in range(len(devices))]
        # the front end's tokenizer, built once while the engines load
        with ThreadPoolExecutor(len(devices) + 1, thread_name_prefix="engine-start") as pool:
            def tokenizer():
                from pathlib import Path
                path = Path(settings.model) if settings.model else default_model_path(settings)
                return Tokenizer.from_model_file(open_model(path), TemplateLimits.from_settings(settings))
            tok = pool.submit(tokenizer)
            if shared is None:
                futures = [pool.submit(EngineClient.start, settings, observers[i],
                                       (lambda err, i=i: group._member_died(i, err)), gpu=d, index=i + 1,
                                       tokenizer=tok)
                           for i, d in enumerate(devices)]
            else:
                futures = [pool.submit(EngineClient.connect, settings, shared, i + 1, observers[i],
                                       (lambda err, i=i: group._member_died(i, err)), tokenizer=tok)
                           for i in range(len(devices))]
            for i, f in enumerate(futures):
                try:
                    group.members[i] = f.result()
                except Exception as e:           # this engine stands aside
                    group.failures[i] = e
        if shared is not None:
            try:
                group._prefixes = PrefixTable.open(prefix_path(shared))
            except OSError as e:        # affinity stays this front end's own
                log.warning("the front ends' shared prefix table cannot be opened (%s); this front end "
                            "remembers its own prompt heads", e)
        for i, e in group.failures.items():
            if quiet:
                break
            if any(group.members) or (i > 0 and str(e) != str(group.failures[0])):
                log.error("engine %d of %d (%s) failed to load the model: %s: %s", i + 1, len(devices),
                          group.devices[i], type(e).__name__, e)
        if not any(group.members):
            raise group.failures[0]          # the server says it, once
        for m, obs in zip(group.members, observers):
            if m is not None and obs is not None and m.reports:
                obs.on_step(m.stats())       # the gauges exist before the first step
        # one grammar compiler (and checker) on this side, whichever engine a request goes to
        for m in group.members:
            if m is not None:
                m.guidance = group._first.guidance
        return group

    def _live(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m is not None and m.alive and m.stall() is None]

    @property
    def _first(self):
        return next(m for m in self.members if m is not None)

    # what RequestPrep and the routes read: the first engine's (the engines run one model)
    @property
    def tokenizer(self):
        return self._first.tokenizer

    @property
    def guidance(self):
        return self._first.guidance

    @property
    def config(self):
        return self._first.config

    @property
    def model_name(self) -> str:
        return self._first.model_name

    @property
    def max_context(self) -> int:
        return min(m.max_context for m in self.members if m is not None)

    @property
    def kv_capacity(self) -> int:
        return min(m.kv_capacity for m in self.members if m is not None)

    # ---------------------------------------------------------------- routing
    def route(self, prompt_ids: list[int]) -> int:
        """The engine a request of this prompt goes to (the NOTE above)."""
        with self._lock:
            live = self._live()
            if not live:
                raise CapacityError("no engine can take work (every one is stuck or gone); retry later",
                                    retry_after_s=5)
            now = time.monotonic()
            load = {i: (self._kv_full(i, len(prompt_ids), now), *self._load(i)) for i in live}
            best = min(live, key=lambda i: (*load[i], i))
            head = tuple(prompt_ids[:PREFIX_TOKENS]) if len(prompt_ids) >= PREFIX_TOKENS else None
            if head is not None:
                owner = self._prefixes.get(head)
                if (owner in load and load[owner][0] <= load[best][0]
                        and load[owner][1] <= load[best][1] + PREFIX_SLACK):
                    best = owner
                if owner != best:
                    self._prefixes.put(head, best)
            self._inflight[best] += 1
            self._tokens[best] += len(prompt_ids)
            return best

    def _kv_full(self, i: int, prompt_tokens: int, now: float) -> bool:
        """Whether engine i's latest KV report (if younger than KV_REPORT_TTL_S) leaves less than
        KV_ROOM of its pool free after its waiting requests' blocks and this prompt's."""
        m = self.members[i]
        state = m.kv_state()
        if state is None or not state.total_blocks or now - state.reported_at > KV_REPORT_TTL_S:
            return False
        block = max(1, m.kv_capacity // state.total_blocks)
        free = state.total_blocks - state.used_blocks - state.waiting_blocks - -(-prompt_tokens // block)
        return free < KV_ROOM * state.total_blocks

    def _load(self, i: int) -> tuple[int, int]:
        """Requests and prompt tokens in flight on engine i: this side's, and (a shared engine)
        the other front ends' as its load board says."""
        m = self.members[i]
        board = getattr(m, "board", None)
        if board is None:
            return self._inflight[i], self._tokens[i]
        requests, tokens = board.others(m.slot)
        return self._inflight[i] + requests, self._tokens[i] + tokens

    def release(self, index: int, prompt_tokens: int) -> None:
        """A request routed to engine `index` has ended (or was never sent)."""
        with self._lock:
            self._inflight[index] -= 1
            self._tokens[index] -= prompt_tokens

    def inflight(self) -> list[int]:
        """Requests in flight on each engine (as routed)."""
        with self._lock:
            return list(self._inflight)

    def generate(self, prompt_ids: list[int], params, request_id: str | None = None) -> AsyncIterator:
        import uuid
        rid = request_id or uuid.uuid4().hex
        group = self

        async def run():
            i = group.route(prompt_ids)
            with group._lock:
                group._owner[rid] = i
            inner = group.members[i].generate(prompt_ids, params, rid)
            try:
                async for out in inner:
                    yield out
            finally:
                await inner.aclose()
                with group._lock:
                    group._owner.pop(rid, None)
                group.release(i, len(prompt_ids))

        return run()

    def abort(self, request_id: str) -> None:
        with self._lock:
            i = self._owner.get(request_id)
        if i is not None and self.members[i] is not None:
            self.members[i].abort(request_id)

    # ---------------------------------------------------------------- state
    def stats(self) -> dict[str, Any]:
        """The engines' reports added up (merge_stats); asks each engine for a fresh one, which
        reaches its observer when it comes."""
        reports = [m.stats() if m is not None else {} for m in self.members]
        with self._lock:
            self._reports = [r or old for r, old in zip(reports, self._reports)]
            return merge_stats(self._reports)

    def reports(self) -> list[bool]:
        """Whether this side writes each engine's series (always, unless another front end shares
        it and writes them: engine/shared.py; one that failed at load: False)."""
        return [m is not None and m.reports for m in self.members]

    def engine_statuses(self) -> list[tuple[str, str]]:
        """(device, status) of each engine: ready, stuck, dead or failed (at load)."""
        out = []
        for i, m in enumerate(self.members):
            if m is None:
                out.append((self.devices[i], "failed"))
            elif not m.alive:
                out.append((self.devices[i], "dead"))
            else:
                out.append((self.devices[i], "stuck" if m.stall() else "ready"))
        return out

    def stall(self) -> str | None:
        """Why no engine can take work, or None while one can."""
        if self._live():
            return None
        reasons = [m.stall() for m in self.members if m is not None and m.alive]
        return next((r for r in reasons if r), None)

    @property
    def alive(self) -> bool:
        return any(m is not None and m.alive for m in self.members)

    def _member_died(self, index: int, error: BaseException) -> None:
        log.error("engine %d of %d (%s) is gone: %s; %d engine(s) still serve", index + 1, len(self.members),
                  self.devices[index], error, sum(1 for m in self.members if m is not None and m.alive))
        if not self.alive and self._on_exit is not None:
            self._on_exit(error)

    def finish_all(self, reason: str = "shutdown") -> None:
        for m in self.members:
            if m is not None and m.alive:
                m.finish_all(reason)

    def prewarm_guidance(self, delay_s: float = 0.0) -> None:
        """Every engine's vocabulary, and this side's shared one once."""
        for m in self.members:
            if m is not None:
                m.prewarm_guidance(delay_s, here=m is self._first)

    def shutdown(self) -> None:
        for m in self.members:
            if m is not None:
                m.shutdown()
        self._prefixes.close()
