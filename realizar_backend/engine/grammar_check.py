"""A request's grammar is compiled and tried first in a worker process that may be abandoned.

llguidance compiles in native code: a compile cannot be interrupted, one that recurses too deep
ends the process with a signal, and some grammars fail only when their first tokens are computed
(a limit of the lexer or the parser), which used to surface as a server error at the first token.
So before the server compiles a grammar for its own use (engine/guidance.py), a worker process
with llguidance's view of the same vocabulary:
- validates and compiles it, computes the first token mask, and walks the bytes the grammar forces
  from its start (where those limits are met): a grammar that allows no text at all
  (`[^\\s\\S]`, a `$ref` cycle) or that fails there is answered at the request;
- within a time limit (Settings.grammar_timeout_s), and while the caller still wants the answer
  (a client that leaves cancels it): past either, the worker is killed and a fresh one starts;
- on a thread whose stack (WORKER_STACK_BYTES) is smaller than any thread of the server has, so
  that a grammar which passes here compiles there with room to spare; a worker that dies on a
  grammar costs only that request;
- with its address space capped (WORKER_MEMORY_BYTES).
The structural limits (engine/grammar_limits.py) come before: most bad grammars never get here.

Workers start on first use (or `prestart`, after the server is ready), in a ChildPool
(realizar_backend/childproc.py), and are shared by the Guidance objects of one vocabulary in the
process (`checker`). Messages are length-prefixed JSON
over the worker's stdin and stdout (realizar_backend/childproc.py); the worker imports llguidance and
nothing of the server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ..childproc import RESTART, ChildCancelled, ChildGone, ChildPool, ParentChannel

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0           # a fresh worker imports llguidance and builds the vocabulary's trie
WORKER_STACK_BYTES = 4 << 20       # server threads have 8 MiB (Linux's default)
WORKER_MEMORY_BYTES = 4 << 30
# the forced bytes walked from the grammar's start, in rounds of llguidance's fast-forward tokens
_PROBE_ROUNDS = 4


class CheckFailed(Exception):
    """A grammar the worker refused. kind: "invalid" (it does not compile: a syntax error, an
    unsupported feature), "empty" (it allows no text at all), "complex" (a limit of the compiler,
    the lexer or the parser, the time limit, or the worker died on it), "unavailable" (no worker
    could be started: the server's trouble, not the grammar's)."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        self.message = message
        super().__init__(message)


# the caller's cancel event was set while the check waited (its client left)
Cancelled = ChildCancelled


@dataclass(frozen=True)
class Vocabulary:
    """What a worker builds llguidance's tokenizer from (the arguments of llguidance.LLTokenizer)."""
    tokenizer_json: str
    n_vocab: int
    eos: tuple[int, ...]
    slices: tuple[str, ...]

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.tokenizer_json.encode())
        h.update(json.dumps([self.n_vocab, self.eos, self.slices]).encode())
        return h.hexdigest()


class GrammarChecker:
    """A pool of check workers for one vocabulary. `check` blocks (call it off the event loop);
    up to `workers` checks run at once, the others wait for a free worker."""

    def __init__(self, vocab: Vocabulary, timeout_s: float, workers: int):
        self.vocab = vocab
        self.timeout_s = timeout_s
        init = {"tokenizer": vocab.tokenizer_json, "n_vocab": vocab.n_vocab, "eos": list(vocab.eos),
                "slices": list(vocab.slices), "memory": WORKER_MEMORY_BYTES}
        self.pool = ChildPool(__name__, workers, init=init, start_timeout_s=_START_TIMEOUT_S,
                              unavailable=_unavailable, name="grammar-check")

    def check(self, grammar: str, cancel: threading.Event | None = None) -> None:
        """Return if the grammar compiles, allows some text and gets past its forced start within
        the time limit; else CheckFailed. Cancelled when `cancel` is set meanwhile."""
        try:
            reply = self.pool.call({"grammar": grammar}, self.timeout_s, cancel)
        except TimeoutError:
            raise CheckFailed("complex", f"compiling it took longer than {self.timeout_s:g} s "
                                         f"(REALIZAR_GRAMMAR_TIMEOUT_S)") from None
        except ChildGone as e:
            log.warning("a grammar check worker exited with status %s on a request's grammar", e.status)
            raise CheckFailed("complex", f"the grammar compiler failed on it (its process exited with "
                                         f"status {e.status})") from None
        if "error" in reply:
            raise CheckFailed(reply["error"], reply["message"])

    def prestart(self) -> None:
        """Start the workers now, on a thread (a request that comes first waits for one)."""
        self.pool.prestart()

    def close(self) -> None:
        self.pool.close()


def _unavailable(why: str) -> CheckFailed:
    if why == "closed":
        return CheckFailed("unavailable", "the grammar checker is closed")
    return CheckFailed("unavailable", f"the grammar checker process {why}")


_checkers: dict[tuple, GrammarChecker] = {}
_checkers_lock = threading.Lock()


def checker(vocab: Vocabulary, timeout_s: float, workers: int) -> GrammarChecker:
    """The process's checker for this vocabulary and these limits (engines of one model share it)."""
    key = (vocab.fingerprint, timeout_s, workers)
    with _checkers_lock:
        c = _checkers.get(key)
        if c is None:
            c = _checkers[key] = GrammarChecker(vocab, timeout_s, workers)
        return c


# ------------------------------------------------------------------------------ the worker's side
def probe(matcher_cls, tokenizer, grammar: str) -> dict[str, Any]:
    """Compile `grammar`, compute its first mask and walk its forced start. {"ok": True} or
    {"error": kind, "message": ...} (CheckFailed's kinds)."""
    failed, msgs = matcher_cls.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        return {"error": "invalid", "message": _first_line(msgs)}
    m = matcher_cls(tokenizer, grammar, log_level=0)
    stops = set(tokenizer.eos_tokens)
    for _ in range(_PROBE_ROUNDS):
        if m.is_error():
            return _failure(m)
        mask = int.from_bytes(m.compute_bitmask(), "little")
        if m.is_error():
            return _failure(m)
        for t in stops:
            mask &= ~(1 << t)
        if not mask:
            if m.is_accepting():
                return {"ok": True}       # complete here: nothing but a stop token may follow
            return {"error": "empty", "message": "allows no text at all, so no output could follow it"}
        forced = m.compute_ff_tokens()
        if not forced:
            return {"ok": True}
        if not m.consume_tokens(forced):
            return _failure(m)
    return {"ok": True} if not m.is_error() else _failure(m)


def _failure(m) -> dict[str, Any]:
    err = _first_line([m.get_error()])
    if "NoExtension" in err:         # the parser cannot go on from the start: nothing matches
        return {"error": "empty", "message": "allows no text at all, so no output could follow it"}
    return {"error": "complex", "message": f"it reaches a limit of the grammar engine where generation "
                                           f"would start ({err})"}


def _first_line(msgs: list[str]) -> str:
    msg = (msgs[0] if msgs else "unknown error").strip().split("\n<state>")[0]
    return " ".join(msg[:400].split()) + (" ..." if len(msg) > 400 else "")


def worker_main(argv: list[str]) -> None:
    """A check worker: the vocabulary first, then grammars until the end of input."""
    import resource

    parent = ParentChannel()
    init = parent.read()
    if init is None:
        return
    resource.setrlimit(resource.RLIMIT_AS, (init["memory"], init["memory"]))
    import llguidance

    tokenizer = llguidance.LLTokenizer(init.pop("tokenizer"), n_vocab=init["n_vocab"], eos_token=init["eos"],
                                       slices=init["slices"])
    threading.stack_size(WORKER_STACK_BYTES)
    parent.reply({"ready": True})
    for req in parent.requests():
        result: list[dict] = []

        def run() -> None:
            try:
                result.append(probe(llguidance.LLMatcher, tokenizer, req["grammar"]))
            except MemoryError:
                result.append({"error": "complex", "message": "it needs more memory than a grammar may take",
                               RESTART: True})
            except Exception as e:   # a refusal of llguidance's API on this grammar is this grammar's failure
                result.append({"error": "invalid", "message": f"{type(e).__name__}: {e}"})

        t = threading.Thread(target=run)
        t.start()
        t.join()
        parent.reply(result[0])
        if result[0].get(RESTART):
            return                       # after a MemoryError nothing here is trusted: a fresh worker
