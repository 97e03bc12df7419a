"""Constrained decoding: a request's grammar (a JSON schema, any JSON object, a Lark or GBNF
grammar, a regex, a list of choices) becomes, per sequence, the set of tokens allowed at each
step, as a bitmask the sampling step applies (backends/sampling.py: SampleRow.mask).

llguidance does the work (the grammar engine llama.cpp and vLLM use): its tokenizer is built once
per model from ours (`prewarm`, on a thread at start-up), a request's grammar is compiled and
checked once (cached by its text), and each constrained sequence gets a `Guide` (a matcher of its
own) that gives the mask for its next token and consumes the token drawn.

A request's grammar is measured first (grammar_limits.py: sizes, counts, chains of references)
and, where this object checks requests (`check_timeout_s`), compiled and tried in a worker process
(grammar_check.py) within a time limit, cancellable, before it is compiled here: a grammar that
would crash, stall or fail at its first token, or that allows no text, is a 400 at the request.

A guide's matcher is never a `deep_copy` of another: llguidance's copies share one lexer behind a
mutex that every mask computation holds, so the masks of a batch's rows would be computed one
after the other whatever the threads. Each guide has an independent matcher instead, taken from
its grammar's pool of finished ones (reset to the start, its lexer's cache still warm: cheaper than
a new one), and `release` returns it.

How the engine drives a Guide (engine/engine.py):
    compile(constraint)                          # in Engine.prepare, off the event loop: 400s here
    guide = guidance.guide(constraint)           # when the sequence is made (cached: a copy)
    token = run_step(backend, Step(prompts), rows with masks, prepare=fill_masks)   # the first token
    loop:
        if not guide.consume(token): fail the sequence (only a broken backend gets here)
        if guide.finished: finish with "stop"     # the grammar is complete: only EOS could follow
        backend.sample(step, rows with masks, prepare=fill_masks)
            # the step's forward pass is queued already (executed ahead on the device's own
            # tokens while the host consumed the previous ones; a prompt's, by its execute):
            # fill_masks computes every guide's next mask before the sampling reads the masks,
            # overlapping the forward
    guidance.release(guide)                      # the sequence ended: its matcher serves the next one
Stop tokens (the model's EOS set) are allowed exactly when the grammar accepts, so a sequence that
draws one ends as usual. `fill_masks` computes many guides' masks at once on llguidance's threads;
at small batches each row's own mask is also spread over threads, the vocabulary cut in parts
(mask_split.py, MASK_PARTS), so a slow mask (a bounded string near its
maxLength walks most of the vocabulary) does not hold up the step.
Sequences without a constraint have no Guide and cost nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import llguidance
import numpy as np

from ..backends.sampling import mask_words
from ..errors import CapacityError, RequestError
from . import grammar_limits
from .grammar_check import Cancelled, CheckFailed, GrammarChecker, Vocabulary, checker
from .mask_split import VocabSplit

log = logging.getLogger(__name__)

# JSON is generated compact, the way json.dumps writes it: free whitespace lets a small model
# spend its tokens on newlines and indentation (or never stop).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_object", "json_schema", "lark", "regex", "choice")
CACHE_SIZE = 256          # compiled grammars kept (by their text)
# llguidance's "slices": token classes whose bits are set wholesale when the lexer state accepts
# every string of the class (an exact subsumption check, so masks are the same with any slices),
# the rest of the vocabulary is walked through the token trie. Its default classes are JSON string
# chars of length 1-10, 11-30 and longer: inside a string with a maxLength, fewer than 10 chars
# before the bound no class fits and the walk covers the whole vocabulary, and even with 10-29
# left the 11-30 class is walked. A ladder of lengths lets the longest class
# that still fits be set at once; what is left is the walk of the tokens longer than the room.
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
_LADDER = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 30)
SLICES = [r"[\x20\x0A\x0D\x09]+"] + [f"{_STRING_CHAR}{{1,{k}}}" for k in _LADDER] + [f"{_STRING_CHAR}+"]
POOL_SIZE = 64            # finished matchers kept per grammar for the next sequences
# a row's mask computed in this many parts of the vocabulary on as many threads, while rows x parts
# fit the cores: at small batches a slow mask (a bounded string near its maxLength walks most of
# the vocabulary) would otherwise hold up the step
MASK_PARTS = 4


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its output to.
    kind: json_object (any JSON object), json_schema (spec: the schema, a dict), lark (spec: a
    Lark grammar in llguidance's dialect, or GBNF), regex (spec: the pattern), choice (spec: a
    list of strings). param: the request field it came from, named in errors."""
    kind: str
    spec: Any = None
    param: str = "response_format"
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {KINDS}")
        try:
            key = json.dumps([self.kind, self.spec], sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise RequestError(f"{self.param}: not JSON data: {e}", param=self.param) from None
        object.__setattr__(self, "key", key)


def grammar_source(c: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked). ValueError for malformed input."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_STYLE)
    if c.kind == "json_schema":
        if isinstance(c.spec, bool):     # JSON Schema allows true / false as whole schemas
            raise ValueError("the schema must be an object")
        if not isinstance(c.spec, (dict, str)):
            raise ValueError("the schema must be an object")
        # the request's own x-guidance options come after ours (defaults), so they win
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_STYLE)
    if c.kind == "lark":
        if not isinstance(c.spec, str) or not c.spec.strip():
            raise ValueError("the grammar must be a non-empty string")
        return llguidance.grammar_from("grammar", c.spec)   # Lark, or GBNF (converted)
    if c.kind == "regex":
        if not isinstance(c.spec, str):
            raise ValueError("the regex must be a string")
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if not (isinstance(c.spec, list) and c.spec and all(isinstance(s, str) for s in c.spec)):
        raise ValueError("choices must be a non-empty list of strings")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.spec))


class _Entry:
    """A checked grammar and its pool of matchers at the start (each with its own lexer)."""

    def __init__(self, grammar: str, matcher: "llguidance.LLMatcher"):
        self.grammar = grammar
        self.free = [matcher]
        self.free_parts: list[list["llguidance.LLMatcher"]] = []   # part matchers (mask_split), at the start


class Guide:
    """One sequence's grammar state (an llguidance matcher of its own) and its current mask."""

    def __init__(self, matcher: "llguidance.LLMatcher", words: int, entry: _Entry | None = None):
        self._m = matcher
        self._entry = entry                       # the pool the matcher goes back to
        self.mask = np.zeros(words, np.int32)     # the latest compute_mask(); reused in place
        self.tokens: list[int] = []               # consumed so far: what part matchers catch up on
        self._parts: list["llguidance.LLMatcher"] | None = None   # mask_split's, made on first use
        self._synced = 0                          # tokens the part matchers have consumed
        self._no_split = False                    # a part matcher refused a token: the main one only

    def compute_mask(self) -> np.ndarray:
        """The tokens allowed next (int32 words, SampleRow.mask's layout), into self.mask. A
        backend copies the mask when its step starts, so the next call may overwrite it."""
        self._m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return self.mask

    def consume(self, token: int) -> bool:
        """Advance past the drawn token; False if the grammar does not allow it (the matcher is
        then in its error state: `error` says why)."""
        ok = self._m.consume_token(int(token))
        if ok:
            self.tokens.append(int(token))
        return ok

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow: end the sequence here."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()

    @property
    def hit_limit(self) -> bool:
        """The matcher stopped on a limit of the grammar engine (the parser's items, the lexer's
        states), not on a token the grammar forbids: the grammar's fault, not the sampler's."""
        err = self._m.get_error()
        return bool(err) and "doesn't satisfy the grammar" not in err


class Guidance:
    """A model's constrained decoding: llguidance's tokenizer for its vocabulary (built on first
    use, or ahead with `prewarm`) and a cache of checked grammars. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE, pool_size: int = POOL_SIZE,
                 slices: Sequence[str] | None = None, split_parts: int | None = None, threads: int | None = None,
                 check_timeout_s: float | None = None, check_workers: int = 1):
        """split_parts: cut the vocabulary in that many parts (mask_split) so that a batch's masks
        run on split_parts threads a row while rows * split_parts <= threads (None: MASK_PARTS; 0, 1
        or more than threads: never).
        threads: llguidance's executor (default: every core this process may use).
        check_timeout_s: `compile` tries each new grammar in a worker process first
        (grammar_check.py; check_workers of them) with this time limit; None: compiled here only
        (an engine whose requests were checked by the process that sent them)."""
        self.tokenizer = tokenizer
        self.check_timeout_s = check_timeout_s
        self.check_workers = check_workers
        self._checker: GrammarChecker | None = None
        self._json: str | None = None
        # None: our ladder (SLICES); benchmarks/mask_bench.py passes llguidance's own to compare
        self.slices = list(SLICES if slices is None else slices)
        self.vocab_size = int(vocab_size)       # the width of the logits (may exceed the tokenizer's)
        self.words = mask_words(self.vocab_size)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # constraint key -> the checked grammar and its pool of matchers
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        # constraint key -> the lock its first compile holds: a burst of requests with one new
        # schema compiles (and checks) it once, the others wait for the cache
        self._compiling: dict[str, threading.Lock] = {}
        self._cache_size = cache_size
        self._pool_size = pool_size
        self._executor: llguidance.LLExecutor | None = None
        # every core the process may use (llguidance's default takes 80%): the caller waits on
        # these calls, and on a GPU the step's forward pass is already queued
        self.threads = int(threads) if threads else min(32, len(os.sched_getaffinity(0)))
        # parts only where one row's fit the threads (never on a 2-core machine with 4 parts: no
        # part tokenizers to build there)
        split_parts = MASK_PARTS if split_parts is None else split_parts
        self.split_parts = int(split_parts) if split_parts and 1 < split_parts <= self.threads else 0
        self._split: VocabSplit | None = None
        self._split_lock = threading.Lock()
        self._split_thread: threading.Thread | None = None

    @property
    def ll_tokenizer(self) -> "llguidance.LLTokenizer":
        if self._ll is None:
            with self._lock:
                if self._ll is None:
                    # llguidance reads the same HF tokenizer definition we tokenize with, so its
                    # idea of every token's bytes is ours; the stop tokens act as its EOS
                    self._ll = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                      eos_token=sorted(self.tokenizer.stop_ids),
                                                      slices=self.slices)
                    log.info("guidance: tokenizer of %d tokens ready", self.vocab_size)
        return self._ll

    @property
    def split(self) -> VocabSplit | None:
        """The vocabulary's parts (mask_split), once built. The first batch that could use them
        starts their build on a thread and is served by its rows' main matchers meanwhile: for a
        large vocabulary the build takes seconds, in pieces that hold the GIL, which
        would otherwise stall every stream at once (at start-up in prewarm, or on the step thread)."""
        if self.split_parts and self._split is None and self._split_thread is None:
            with self._lock:
                if self._split_thread is None:
                    self._split_thread = threading.Thread(target=self.build_split, name="realizar-guidance-split",
                                                          daemon=True)
                    self._split_thread.start()
        return self._split

    def build_split(self) -> VocabSplit | None:
        """Build the vocabulary's parts now, if split_parts asks for them (e.g. a benchmark, or a
        test that compares split masks from the first step)."""
        if self.split_parts and self._split is None:
            ll = self.ll_tokenizer
            with self._split_lock:
                if self._split is None:
                    self._split = VocabSplit(ll, self.vocab_size, self.words, self.split_parts, self.slices)
                    log.info("guidance: vocabulary in %d parts for split masks", self.split_parts)
        return self._split

    def _tokenizer_json(self) -> str:
        if self._json is None:
            self._json = self.tokenizer.to_json()
        return self._json

    @property
    def checker(self) -> GrammarChecker:
        """The worker processes that try grammars first (shared by the process's Guidance objects
        of this vocabulary); they start on first use, or in prewarm."""
        if self._checker is None:
            vocab = Vocabulary(self._tokenizer_json(), self.vocab_size, tuple(sorted(self.tokenizer.stop_ids)),
                               tuple(self.slices))
            self._checker = checker(vocab, self.check_timeout_s, self.check_workers)
        return self._checker

    def prewarm(self, checks: bool = True) -> None:
        """Build llguidance's tokenizer now (0.2-3 s for 50k-260k tokens), e.g. on a thread at
        start-up, and (checks) start the check workers, which build their own. The split's parts
        are left to the first batch that can use them."""
        _ = self.ll_tokenizer
        if checks and self.check_timeout_s is not None:
            self.checker.prestart()

    def is_special(self, text: str) -> bool:
        """Whether `text` is one token that grammars must name as a special token (<text>)
        rather than spell as a string: llguidance treats every added token that way."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0])

    def compile(self, c: Constraint, cancel: threading.Event | None = None) -> str:
        """The checked grammar of a constraint; RequestError (400, naming c.param and the
        problem) for a malformed, unsupported, oversized or unsatisfiable one, or one that passes
        the check's time limit. Cached by the constraint's text. cancel: set when the caller no
        longer wants the answer (its client left): the check stops, and a 499 RequestError
        follows. Blocking: call it off the event loop."""
        return self._entry(c, cancel, check=True).grammar

    def _entry(self, c: Constraint, cancel: threading.Event | None = None, check: bool = False) -> _Entry:
        with self._lock:
            hit = self._cache.get(c.key)
            if hit is not None:
                self._cache.move_to_end(c.key)
                return hit
            first = self._compiling.setdefault(c.key, threading.Lock())
        while not first.acquire(timeout=0.05):        # another request compiles this one now
            if cancel is not None and cancel.is_set():
                raise RequestError("the client closed the request", status=499, code="client_closed_request")
        try:
            with self._lock:
                hit = self._cache.get(c.key)
            return hit if hit is not None else self._compile(c, cancel, check)
        finally:
            first.release()
            with self._lock:     # done (cached, or refused: a waiter then tries it itself)
                if self._compiling.get(c.key) is first:
                    del self._compiling[c.key]

    def _compile(self, c: Constraint, cancel: threading.Event | None, check: bool) -> _Entry:
        what = grammar_limits.WHAT[c.kind]
        grammar_limits.check(c.kind, c.spec, c.param, len(c.key))
        try:
            g = grammar_source(c)
        except ValueError as e:
            raise RequestError(f"{c.param}: invalid {what}: {e}", param=c.param, code="invalid_grammar") from None
        if check and self.check_timeout_s is not None:
            try:
                self.checker.check(g, cancel)
            except CheckFailed as e:
                if e.kind == "unavailable":
                    raise CapacityError(f"grammars cannot be checked now: {e.message}", retry_after_s=5) from None
                if e.kind == "empty":
                    raise RequestError(f"{c.param}: this {what} {e.message}", param=c.param,
                                       code="grammar_unsatisfiable") from None
                raise RequestError(f"{c.param}: this {what} cannot be used: {e.message}", param=c.param,
                                   code="invalid_grammar" if e.kind == "invalid" else "grammar_too_complex") from None
            except Cancelled:
                raise RequestError("the client closed the request", status=499,
                                   code="client_closed_request") from None
        else:
            failed, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g, self.ll_tokenizer)
            if failed:
                raise RequestError(f"{c.param}: this {what} cannot be used: {_first_line(msgs)}",
                                   param=c.param, code="invalid_grammar")
            for w in msgs:
                log.debug("guidance: %s warning: %s", what, w)
        m = llguidance.LLMatcher(self.ll_tokenizer, g, log_level=0)
        if m.is_error():   # validated above: only a resource limit gets here
            raise RequestError(f"{c.param}: this {what} cannot be used: {_first_line([m.get_error()])}",
                               param=c.param, code="grammar_too_complex")
        with self._lock:
            entry = self._cache.setdefault(c.key, _Entry(g, m))
            self._cache.move_to_end(c.key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return entry

    def guide(self, c: Constraint) -> Guide:
        """A new sequence's Guide, with a matcher no other guide shares (compiles on a miss)."""
        entry = self._entry(c)
        with self._lock:
            m = entry.free.pop() if entry.free else None
        if m is None:
            m = llguidance.LLMatcher(self.ll_tokenizer, entry.grammar, log_level=0)
        return Guide(m, self.words, entry)

    def release(self, guide: Guide) -> None:
        """The guide's sequence is over: its matcher, back at the start, waits in its grammar's
        pool for the next sequence (one in an error state is dropped). The guide is unusable after."""
        m, entry, parts = guide._m, guide._entry, guide._parts
        guide._m = guide._entry = guide._parts = None
        if entry is None:
            return
        with self._lock:
            if m is not None and m.reset() and len(entry.free) < self._pool_size:
                entry.free.append(m)
            if parts is not None and all(p.reset() for p in parts) and len(entry.free_parts) < self._pool_size:
                entry.free_parts.append(parts)

    def fill_masks(self, guides: Sequence[Guide], out: np.ndarray) -> np.ndarray:
        """Every guide's next mask at once, on llguidance's threads: guides[i]'s into out[i]
        (int32 [>= len(guides), words], C-contiguous)."""
        if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != self.words or not out.flags.c_contiguous \
                or out.shape[0] < len(guides):
            raise ValueError(f"out must be C-contiguous int32 [>= {len(guides)}, {self.words}]")
        split = self.split if len(guides) * self.split_parts <= self.threads else None
        if split is not None:
            return self._fill_split(split, guides, out)
        if len(guides) == 1:
            guides[0]._m.unsafe_compute_mask_ptr(out[0].ctypes.data, out[0].nbytes)
            return out
        self._pool_executor().unsafe_compute_mask_ptr([(g._m, i) for i, g in enumerate(guides)], out.ctypes.data,
                                               self.words * 4, out.shape[0])
        return out

    def _fill_split(self, split: VocabSplit, guides: Sequence[Guide], out: np.ndarray) -> np.ndarray:
        """fill_masks with each row's mask the OR of its part matchers' (mask_split), on
        rows * parts threads; a row where the grammar forces bytes takes its main matcher's."""
        jobs: list = []
        plan: list[tuple[int, int, int]] = []     # (row, first job, parts; 0: the main matcher)
        for i, g in enumerate(guides):
            parts = None if g._m.compute_ff_bytes() or g._m.is_stopped() else self._synced_parts(split, g)
            plan.append((i, len(jobs), len(parts) if parts else 0))
            jobs.extend(parts if parts else [g._m])
        scratch = np.empty((len(jobs), self.words), np.int32)
        self._pool_executor().unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(jobs)], scratch.ctypes.data,
                                                      self.words * 4, len(jobs))
        for i, j, n in plan:
            if n:
                np.bitwise_and(scratch[j:j + n], split.own, out=scratch[j:j + n])
                np.bitwise_or.reduce(scratch[j:j + n], axis=0, out=out[i])
            else:
                out[i] = scratch[j]
        return out

    def _synced_parts(self, split: VocabSplit, g: Guide) -> list | None:
        """The guide's part matchers (from its grammar's pool, or new), past every token it has
        consumed; None if a part refused one (never seen: then the main matcher serves it)."""
        if g._no_split or g._entry is None:
            return None
        if g._parts is None:
            with self._lock:
                g._parts = g._entry.free_parts.pop() if g._entry.free_parts else None
            if g._parts is None:
                g._parts = split.matchers(g._entry.grammar)
            g._synced = 0
        for t in g.tokens[g._synced:]:
            for k, p in enumerate(g._parts):
                if not p.consume_tokens(split.spell(k, t)):
                    log.warning("guidance: a vocabulary part refused token %d: %s", t, p.get_error())
                    g._no_split = True
                    return None
        g._synced = len(g.tokens)
        return g._parts


    def consume_all(self, guides: Sequence[Guide], tokens: Sequence[int]) -> list[bool]:
        """guides[i].consume(tokens[i]) for all, at once on llguidance's threads (a step's
        constrained rows: their consumes sit between the step's tokens and the next step)."""
        if len(guides) != len(tokens):
            raise ValueError("one token per guide")
        if len(guides) < 2:
            return [g.consume(t) for g, t in zip(guides, tokens)]
        ok = self._pool_executor().consume_token_par([(g._m, int(t)) for g, t in zip(guides, tokens)])
        for g, t, good in zip(guides, tokens, ok):
            if good:
                g.tokens.append(int(t))
        return ok

    def _pool_executor(self) -> "llguidance.LLExecutor":
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
        return self._executor


def _first_line(msgs: list[str]) -> str:
    msg = (msgs[0] if msgs else "unknown error").strip()
    return " ".join(msg.split()) if len(msg) < 400 else " ".join(msg[:400].split()) + " ..."
