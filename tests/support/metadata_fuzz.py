"""A fuzzer for the loader's metadata checks: mutants of a real GGUF header's key/value section
(values retyped, replaced by edge values, arrays cut, shuffled or retyped, keys dropped,
duplicated or misspelt, raw bytes flipped), each loaded as the server loads a model (open the
file, build the tokenizer with its chat template, encode and decode a little text) in a worker
process under a time limit. The only acceptable outcomes are success and a typed error
(RealizarError); anything else, a hang or a crash, is a finding.

Used by tests/formats/test_metadata_fuzz.py (fixed seed, a few hundred mutants) and by
tools/fuzz_metadata.py (as many as you like, with counts of outcomes).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
import struct
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gguf import GGUFValueType as V

from support import gguf_kv
from support.gguf_kv import KV

ACCEPTABLE = ("ok", "typed")
_INT_TYPES = {V.UINT8: (0, 2 ** 8 - 1), V.INT8: (-2 ** 7, 2 ** 7 - 1), V.UINT16: (0, 2 ** 16 - 1),
              V.INT16: (-2 ** 15, 2 ** 15 - 1), V.UINT32: (0, 2 ** 32 - 1), V.INT32: (-2 ** 31, 2 ** 31 - 1),
              V.UINT64: (0, 2 ** 64 - 1), V.INT64: (-2 ** 63, 2 ** 63 - 1)}
_FLOAT_TYPES = (V.FLOAT32, V.FLOAT64)
_SCALARS = list(_INT_TYPES) + list(_FLOAT_TYPES) + [V.BOOL, V.STRING]
_FLOATS = [0.0, -0.0, -1.0, 0.5, 1e-30, 1e30, 3.4e38, math.nan, math.inf, -math.inf]
_STRINGS = ["", " ", "abc", "llama", "gpt2", "qwen2", "gemma3", "smollm", "{{", "{% for %}", "\u2581", "é",
            "x" * 5000, "<|im_end|>", "Ġ t", "Ġ", "\x00", "{{ messages }}"]


@dataclass
class Result:
    index: int
    mutation: str
    outcome: str          # ok | typed | untyped | hang | crash
    detail: str           # the error type and message (a traceback for untyped)


# ------------------------------------------------------------------ mutation
class Mutator:
    """Mutants of one file's header; `mutant(i)` is a function of (seed, i) only."""

    def __init__(self, path: str | Path, seed: int):
        self.parts = gguf_kv.read(path)
        self.seed = seed
        self._encoded = [gguf_kv.encode_kvs([kv]) for kv in self.parts.kvs]
        n = next(len(kv.value) for kv in self.parts.kvs if kv.key == "tokenizer.ggml.tokens")
        self.ints = [0, 1, -1, 2, 3, 255, 256, 65535, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 63 - 1, -2 ** 63,
                     n - 1, n, n + 1, 10 ** 12]
        # keys the loader reads are chosen more often than the others
        self.read_keys = [i for i, kv in enumerate(self.parts.kvs)
                          if kv.key.startswith(("tokenizer.", "llama.", "general.architecture", "general.alignment"))]

    def mutant(self, index: int) -> tuple[str, bytes, int]:
        """(description, key/value bytes, kv count the header claims)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        if rng.random() < 0.12:
            return self._raw(rng)
        kvs = list(self.parts.kvs)
        changed: dict[int, KV] = {}
        notes = []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            i = rng.choice(self.read_keys) if rng.random() < 0.8 else rng.randrange(len(kvs))
            kv = changed.get(i)
            if not isinstance(kv, KV):        # not changed yet, or dropped / duplicated already
                kv = kvs[i]
            new, note = self._mutate(rng, kv)
            notes.append(f"{kv.key}: {note}")
            changed[i] = new
        chunks = []
        count = 0
        for i, kv in enumerate(kvs):
            if i in changed:
                new = changed[i]
                if new is None:
                    continue
                if isinstance(new, list):          # duplicated
                    chunks.append(gguf_kv.encode_kvs(new))
                    count += len(new)
                    continue
                chunks.append(gguf_kv.encode_kvs([new]))
            else:
                chunks.append(self._encoded[i])
            count += 1
        return "; ".join(notes), b"".join(chunks), count

    def _raw(self, rng: random.Random) -> tuple[str, bytes, int]:
        body = bytearray(b"".join(self._encoded))
        kind = rng.choice(("flip", "u64", "cut"))
        if kind == "flip":
            at = [rng.randrange(len(body)) for _ in range(rng.randint(1, 8))]
            for a in at:
                body[a] ^= 1 << rng.randrange(8)
            return f"raw: flipped bits at {at}", bytes(body), len(self._encoded)
        if kind == "u64":
            at = rng.randrange(len(body) - 8)
            v = rng.choice([0, 1, 2 ** 63, 2 ** 64 - 1, len(body), 2 ** 32])
            struct.pack_into("<Q", body, at, v)
            return f"raw: u64 {v} at {at}", bytes(body), len(self._encoded)
        at = rng.randrange(len(body))
        return f"raw: key/values cut at {at}", bytes(body[:at]), len(self._encoded)

    def _mutate(self, rng: random.Random, kv: KV):
        ops = ["retype", "revalue", "drop", "duplicate", "rename"]
        if kv.vtype == V.ARRAY:
            ops += ["truncate", "empty", "swap", "set_item", "dup_item", "retype_items", "edit_item"] * 2
        if kv.vtype == V.STRING:
            ops += ["edit_string"] * 2
        op = rng.choice(ops)
        if op == "retype":
            vtype = rng.choice(_SCALARS + [V.ARRAY, V.ARRAY])
            value, itype = self._value(rng, vtype)
            return KV(kv.key, vtype, value, itype), f"retyped to {V(vtype).name}"
        if op == "revalue":
            value, itype = self._value(rng, kv.vtype, kv.itype)
            return KV(kv.key, kv.vtype, value, itype), f"new {V(kv.vtype).name} value"
        if op == "drop":
            return None, "dropped"
        if op == "duplicate":
            return [kv, kv], "duplicated"
        if op == "rename":
            k = list(kv.key)
            k[rng.randrange(len(k))] = rng.choice("._xyz")
            return KV("".join(k), kv.vtype, kv.value, kv.itype), f"renamed to {''.join(k)!r}"
        if op == "edit_string":
            return KV(kv.key, kv.vtype, self._edit(rng, kv.value), None), "string edited"
        items = list(kv.value)
        if op == "truncate" and items:
            n = rng.randrange(len(items))
            return KV(kv.key, kv.vtype, items[:n], kv.itype), f"cut to {n} items"
        if op == "empty" or not items:
            return KV(kv.key, kv.vtype, [], kv.itype), "emptied"
        if op == "swap":
            a, b = rng.randrange(len(items)), rng.randrange(len(items))
            items[a], items[b] = items[b], items[a]
            return KV(kv.key, kv.vtype, items, kv.itype), f"items {a} and {b} swapped"
        if op == "set_item":
            a = rng.randrange(len(items))
            items[a] = self._value(rng, kv.itype)[0]
            return KV(kv.key, kv.vtype, items, kv.itype), f"item {a} replaced"
        if op == "dup_item":
            a = rng.randrange(len(items))
            items.insert(a, items[a])
            return KV(kv.key, kv.vtype, items, kv.itype), f"item {a} duplicated"
        if op == "edit_item" and kv.itype == V.STRING:
            a = rng.randrange(len(items))
            items[a] = self._edit(rng, items[a])
            return KV(kv.key, kv.vtype, items, kv.itype), f"item {a} edited"
        itype = rng.choice(_SCALARS)
        values = [self._value(rng, itype)[0] for _ in range(min(len(items), rng.choice((1, 3, len(items)))))]
        if len(values) == 1 and len(items) > 1:
            values = values * len(items)
        return KV(kv.key, kv.vtype, values, itype), f"items retyped to {V(itype).name} x{len(values)}"

    def _value(self, rng: random.Random, vtype, itype=None) -> tuple[Any, Any]:
        if vtype in _INT_TYPES:
            lo, hi = _INT_TYPES[vtype]
            v = rng.choice(self.ints + [rng.randint(lo, hi)])
            return min(max(v, lo), hi), None
        if vtype in _FLOAT_TYPES:
            return rng.choice(_FLOATS + [rng.uniform(-1e6, 1e6)]), None
        if vtype == V.BOOL:
            return rng.random() < 0.5, None
        if vtype == V.STRING:
            return rng.choice(_STRINGS), None
        itype = itype if itype is not None and rng.random() < 0.5 else rng.choice(_SCALARS)
        n = rng.choice((0, 1, 2, 5, 100))
        return [self._value(rng, itype)[0] for _ in range(n)], itype

    @staticmethod
    def _edit(rng: random.Random, s: str) -> str:
        if not s:
            return rng.choice(_STRINGS)
        a = rng.randrange(len(s))
        return rng.choice((s[:a] + s[a + 1:], s[:a] + rng.choice("xĠ \u2581{%") + s[a + 1:], s + " ", "", s * 2))

    def write(self, index: int, dst: Path) -> str:
        note, body, count = self.mutant(index)
        gguf_kv.write(self.parts, body, dst, data="sparse", n_kv=count)
        return note


# ------------------------------------------------------------------ running, isolated
def load_like_the_server(path: str) -> None:
    from realizar_backend.formats import open_model
    from realizar_backend.model.tokenizer import Tokenizer

    mf = open_model(path)
    tok = Tokenizer.from_model_file(mf)
    ids = tok.encode("Hello, world! 123 <|im_end|> Ünïcödé", add_special_tokens=True)
    tok.decode(ids)
    d = tok.detokenizer(ids[:2])
    for i in ids[2:]:
        d.add(i)
    d.flush()
    if tok.has_chat_template:
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def _worker(conn) -> None:
    import logging

    from realizar_backend.errors import RealizarError

    logging.disable(logging.WARNING)      # mutants warn a lot (unknown pre-tokenizers); outcomes say enough

    while True:
        try:
            path = conn.recv()
        except EOFError:
            return
        try:
            load_like_the_server(path)
            conn.send(("ok", ""))
        except RealizarError as e:
            conn.send(("typed", f"{type(e).__name__}: {e}"[:300]))
        except BaseException:      # a finding: report it with where it came from
            conn.send(("untyped", traceback.format_exc(limit=8)))


class _Runner:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.ctx = mp.get_context("spawn")
        self.proc = None

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def run(self, path: str) -> tuple[str, str]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(path)
        if not self.conn.poll(self.timeout_s):
            self.stop()
            return "hang", f"no answer within {self.timeout_s:g} s"
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            code = self.proc.exitcode
            self.proc = None
            return "crash", f"the worker exited with {code}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
            self.proc = None


def fuzz(path: str | Path, seed: int, count: int, workdir: Path, timeout_s: float = 30.0,
         start: int = 0) -> Iterator[Result]:
    """Mutants start .. start + count - 1 of `path`, each loaded in a worker under `timeout_s`."""
    mutator = Mutator(path, seed)
    runner = _Runner(timeout_s)
    dst = Path(workdir) / "mutant.gguf"
    try:
        for i in range(start, start + count):
            note = mutator.write(i, dst)
            outcome, detail = runner.run(str(dst))
            yield Result(i, note, outcome, detail)
    finally:
        runner.stop()


def summary(results: list[Result], seconds: float) -> str:
    outcomes = Counter(r.outcome for r in results)
    errors = Counter(r.detail.split(":", 1)[0] for r in results if r.outcome == "typed")
    lines = [f"{len(results)} mutants in {seconds:.0f} s: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()),
             "typed errors: " + ", ".join(f"{k} {v}" for k, v in errors.most_common())]
    for r in results:
        if r.outcome not in ACCEPTABLE:
            lines.append(f"FINDING #{r.index} ({r.mutation}): {r.outcome}: {r.detail}")
    return "\n".join(lines)

