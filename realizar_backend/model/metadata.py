"""Typed reads of model metadata (GGUF key/value pairs, or what the safetensors loader puts in
their place). Every value a loader uses goes through one of these: a wrong type, shape or range
is a ModelFormatError naming the file and the key, never a TypeError from deep inside a builder."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..errors import ModelFormatError

_MISSING = object()


def _show(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    return f"{type(value).__name__} {str(value)[:40]!r}"


class Metadata:
    """A read-only view of one model's metadata with checked accessors. `default` is returned
    when the key is absent; `required=True` makes absence an error."""

    def __init__(self, path, md: Mapping[str, Any]):
        self.path = path
        self.md = md

    def __contains__(self, key: str) -> bool:
        return key in self.md

    def fail(self, key: str, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, f"metadata key {key!r} {problem}")

    def _get(self, key: str, required: bool):
        v = self.md.get(key, _MISSING)
        if v is _MISSING and required:
            raise ModelFormatError(self.path, f"missing required metadata key {key!r}")
        return v

    # ------------------------------------------------------------------ scalars
    def integer(self, key: str, default: Any = None, *, required: bool = False,
                lo: int | None = None, hi: int | None = None) -> Any:
        v = self._get(key, required)
        if v is _MISSING:
            return default
        # a float holding an integer is accepted (some writers store counts as FLOAT32)
        ok = isinstance(v, int) and not isinstance(v, bool) or \
            isinstance(v, float) and math.isfinite(v) and v.is_integer()
        if not ok:
            raise self.fail(key, f"should be an integer, got {_show(v)}")
        v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.fail(key, f"is {v}; it must be in [{lo if lo is not None else '-inf'}, "
                                 f"{hi if hi is not None else 'inf'}]")
        return v

    def number(self, key: str, default: Any = None, *, required: bool = False, positive: bool = False) -> Any:
        v = self._get(key, required)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(key, f"should be a finite number, got {_show(v)}")
        if positive and not v > 0:
            raise self.fail(key, f"is {v}; it must be positive")
        return float(v)

    def boolean(self, key: str, default: Any = None) -> Any:
        v = self._get(key, False)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, f"should be a boolean, got {_show(v)}")
        return v

    def string(self, key: str, default: Any = None, *, required: bool = False, max_len: int | None = None) -> Any:
        v = self._get(key, required)
        if v is _MISSING:
            return default
        if not isinstance(v, str):
            raise self.fail(key, f"should be a string, got {_show(v)}")
        if max_len is not None and len(v) > max_len:
            raise self.fail(key, f"is {len(v)} characters long; at most {max_len} are accepted")
        return v

    def token_id(self, key: str, vocab_size: int) -> int | None:
        """A token id: an integer within the vocabulary, or absent (None)."""
        v = self.integer(key)
        if v is not None and not 0 <= v < vocab_size:
            raise self.fail(key, f"is {v}, outside the vocabulary of {vocab_size} tokens")
        return v

    # ------------------------------------------------------------------ arrays
    def array(self, key: str, default: Any = None, *, required: bool = False, length: int | None = None,
              nonempty: bool = False) -> Any:
        v = self._get(key, required)
        if v is _MISSING:
            return default
        if not isinstance(v, list):
            raise self.fail(key, f"should be an array, got {_show(v)}")
        if length is not None and len(v) != length:
            raise self.fail(key, f"has {len(v)} entries; {length} are expected")
        if nonempty and not v:
            raise self.fail(key, "is an empty array")
        return v

    def _items(self, key: str, default: Any, ok, what: str, kw: dict, fast=None) -> Any:
        v = self.array(key, _MISSING, **kw)
        if v is _MISSING:
            return default
        # fast: a check of the whole array in C-level passes (a vocabulary is 150k+ entries, read
        # while the device starts); when it does not pass, the loop finds the entry to name
        if fast is not None and fast(v):
            return v
        for i, x in enumerate(v):
            if not ok(x):
                raise self.fail(key, f"should be an array of {what}; entry {i} is {_show(x)}")
        return v

    def strings(self, key: str, default: Any = None, **kw) -> Any:
        return self._items(key, default, lambda x: isinstance(x, str), "strings", kw,
                           fast=lambda v: set(map(type, v)) <= {str})

    def booleans(self, key: str, default: Any = None, **kw) -> Any:
        return self._items(key, default, lambda x: isinstance(x, bool), "booleans", kw,
                           fast=lambda v: set(map(type, v)) <= {bool})

    def integers(self, key: str, default: Any = None, *, lo: int, hi: int, **kw) -> Any:
        return self._items(key, default, lambda x: isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi,
                           f"integers in [{lo}, {hi}]", kw,
                           fast=lambda v: set(map(type, v)) <= {int} and (not v or lo <= min(v) and max(v) <= hi))

    def numbers(self, key: str, default: Any = None, **kw) -> Any:
        return self._items(key, default, lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x), "finite numbers", kw,
                           fast=lambda v: set(map(type, v)) <= {int, float} and all(map(math.isfinite, v)))
