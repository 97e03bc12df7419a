"""CUDA graphs of the decode step: capture, replay and status, per (batch bucket, attention kind);
and of prompt steps (PrefillGraphs), per (rows, head rows, attention key splits, projections).

A decode step is a fixed launch sequence per bucket, so it is captured once and replayed per
token: everything that changes per step (token ids, positions, slots, block tables) lives in
device buffers the graph reads. Each bucket has up to two graphs: the attention kernels suited
to short rows (attention.cu's one block per row and head) and to long ones (flash-decoding, split
over the sequence); the backend picks per step from the rows' positions, which the host knows.
The first step of a key runs eagerly (it also loads every kernel module the step launches), then
the key is captured; a capture that fails leaves that key eager for good, said once in the log.
Growing a workspace pool drops every graph (`drop`): they point into the old buffers.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import cupy

log = logging.getLogger(__name__)

STATUSES = ("captured", "eager-fallback", "disabled")


class DecodeGraphs:
    kind = "decode bucket"
    captured_level = logging.INFO

    def __init__(self, stream: cupy.cuda.Stream, step: Callable[[int, bool], None], enabled: bool,
                 pdl_setter: Callable[[bool], None], pdl: bool):
        """step(bucket, long): enqueue one decode step on the current stream; pdl_setter(on) makes
        the step's launches programmatic dependent launches (only while capturing)."""
        self.stream, self.step, self.enabled = stream, step, enabled
        self._set_pdl, self.pdl = pdl_setter, pdl
        self.graphs: dict[tuple, Any] = {}
        self.status: dict[tuple, str] = {}
        self.replays = 0
        self.captures = 0
        self._warned = False

    @staticmethod
    def label(key: tuple[int, bool]) -> str:
        """The bucket label of the metrics: "8", or "8-long" for the long-row attention graph."""
        return f"{key[0]}-long" if key[1] else str(key[0])

    def drop(self) -> None:
        """Forget every graph (a pool they read moved); they are captured again on next use."""
        self.stream.synchronize()        # a step started ahead may still be replaying one of them
        self.graphs.clear()
        for k, s in self.status.items():
            if s == "captured":
                self.status[k] = "pending"

    def _capture(self, key: tuple):
        """The step of key as a graph; with programmatic dependent launches where they are on, and
        without them (for good, said once) if such a capture fails."""
        while True:
            self._set_pdl(self.pdl)
            try:
                # relaxed (CuPy's default, said here on purpose): kernel modules of other families may
                # finish loading on the compile threads meanwhile (modules.py)
                self.stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    self.step(*key)
                finally:
                    graph = self.stream.end_capture()
                return graph
            except Exception as e:
                if not self.pdl:
                    raise
                log.warning("decode graph capture with programmatic dependent launches failed (%s): "
                            "capturing plain launches", e)
                self.pdl = False
            finally:
                self._set_pdl(False)

    def run(self, *key) -> None:
        """Enqueue the step of key on the stream (decode: bucket b, long: the long-row attention)."""
        status = self.status.get(key)
        if status is None:
            status = self.status[key] = "pending" if self.enabled else "disabled"
        if status == "captured":
            self.graphs[key].launch(self.stream)
            self.replays += 1
            return
        if status != "pending":
            self.step(*key)
            return
        # run once eagerly (its results are this step's), then capture for the next steps;
        # replaying the capture needs nothing from this step but the buffers it reads
        self.step(*key)
        try:
            self.graphs[key] = self._capture(key)
            self.status[key] = "captured"
            self.captures += 1
            log.log(self.captured_level, "cuda graph captured for %s %s%s", self.kind, self.label(key),
                    " (programmatic dependent launches)" if self.pdl else "")
        except Exception as e:  # capture unsupported here: eager from now on, said once
            self.status[key] = "eager-fallback"
            if not self._warned:
                log.warning("cuda graph capture failed (%s %s): %s; it runs eager", self.kind, self.label(key), e)
                self._warned = True

    def replay(self, b: int, long: bool) -> None:
        """Launch the captured graph of a key (graph_ab_check); RuntimeError when it has none."""
        key = (b, long)
        if self.status.get(key) != "captured":
            raise RuntimeError(f"bucket {self.label(key)} has no captured graph ({self.status.get(key)})")
        self.graphs[key].launch(self.stream)

    def report(self) -> dict[str, str]:
        """Status per bucket label, of the keys that have run (captured | eager-fallback | disabled)."""
        return {self.label(k): s for k, s in self.status.items() if s != "pending"}

    def clear(self) -> None:
        self.graphs.clear()


class PrefillGraphs(DecodeGraphs):
    """Graphs of prompt steps, keyed (rows, head rows, key splits of the attention plan, the
    dispatcher's family: "gemv" at the exact token count, "mmq" at a token bucket, "split16" at a
    multiple of dispatch.GEMM_ROW_STEP rows and a power of two of head rows): eager, their launches
    cost the host several times the GPU's work on short steps, and on long ones they hold the GIL
    the server's other threads want. A key of the `recur` families is captured when it comes again
    (its first step runs eagerly and is remembered): GEMM steps are long and their keys many, so one
    that never recurs costs no capture. At most `keep` graphs, the least recently used dropped first."""
    kind = "prompt step"
    captured_level = logging.DEBUG

    def __init__(self, stream: cupy.cuda.Stream, step: Callable[..., None], enabled: bool, keep: int = 48,
                 recur: tuple[str, ...] = ("split16",)):
        super().__init__(stream, step, enabled, lambda on: None, False)
        self.keep, self.recur = keep, recur
        self._seen: dict[tuple, None] = {}        # recur keys run once, oldest first

    @staticmethod
    def label(key: tuple) -> str:
        rows, items, splits, kind = key
        return f"{rows} rows, {items} sequence{'s' if items != 1 else ''}, {splits} splits, {kind.upper()}"

    def run(self, *key) -> None:
        if key in self.graphs:                      # most recently used last
            self.graphs[key] = self.graphs.pop(key)
        elif self.enabled and key[3] in self.recur and key not in self._seen and self.status.get(key) is None:
            self._seen[key] = None
            if len(self._seen) > 4 * self.keep:
                del self._seen[next(iter(self._seen))]
            self.step(*key)
            return
        elif self.enabled and len(self.graphs) >= self.keep and self.status.get(key) in (None, "pending"):
            old = next(iter(self.graphs))
            del self.graphs[old]
            self.status[old] = "pending"
        super().run(*key)
