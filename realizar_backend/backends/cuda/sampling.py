"""Sampling on the GPU: launchers of kernels/sampling.cu and the device buffers they keep.

The algorithm is backends/sampling.py's (its NumPy twin gives the same tokens for the same logits
and seed). A step is up to three launches on the caller's stream after the forward pass, then one
small copy back: token, raw argmax and two logprobs per row (16 bytes), never the logits.
Everything the kernels keep between steps lives here at fixed addresses: per-slot token counts
for the penalties, and per-row scratch that sample_final leaves zeroed for the next step.
Constrained rows (an allowed-token bitmask, a logit bias) have theirs packed and uploaded with
the step's parameters, in one copy each; a step without them copies and reads nothing more.
"""

from __future__ import annotations

import logging
from typing import Sequence

import cupy
import numpy as np

from ..sampling import BIAS_ROW_WORDS, PARAM_WORDS, kernel_params, mask_words, pack_bias, pack_masks
from ..base import SampleRow
from .modules import load_module, smem_optin

log = logging.getLogger(__name__)

_U64, _I32 = np.uint64, np.int32
NB = 4096               # bins per row (SAMPLE_NB in sampling.cu)
PREP_THREADS = 512      # sample_prep / sample_hist blocks
FINAL_THREADS = 1024    # sample_final: one block per row
SLICE = 8192            # vocabulary entries per block of the per-row passes
MAX_CAP = 8192          # elements sample_final may gather and sort in shared memory
MIN_CAP = 256           # its dense-bin path uses the gather buffers as 256-bin histograms


class GpuSampler:
    """Device buffers and launches for `vocab`-wide rows, up to `max_rows` per step, with token
    counts for `max_slots` KV slots."""

    def __init__(self, device_id: int, vocab: int, max_rows: int, max_slots: int):
        self.device_id = device_id
        self._fns: dict | None = None        # loaded on first use (greedy decoding never waits for them)
        dev = cupy.cuda.Device(device_id)
        optin = smem_optin(device_id)
        cap = MAX_CAP
        # static shared memory of sample_final is < 1 KB
        while cap > MIN_CAP and NB * 12 + 16 * cap + 1024 > optin:
            cap //= 2
        self.cap = cap
        self.smem_hist = NB * 12
        self.smem_final = NB * 12 + 16 * cap
        with dev:
            self.V = vocab
            self.max_rows = max_rows
            self.G = max(1, -(-vocab // SLICE))
            self.slice = -(-vocab // self.G)
            self.params = cupy.zeros((max_rows, PARAM_WORDS), cupy.int32)
            self.out = cupy.zeros((max_rows, 4), cupy.int32)
            self.hcnt = cupy.zeros((max_rows, NB), cupy.uint32)
            self.hw = cupy.zeros((max_rows, NB), cupy.uint64)
            self.rowmax = cupy.zeros(max_rows, cupy.uint64)
            self.zmass = cupy.zeros(max_rows, cupy.uint64)
            self.lsep = cupy.zeros((max_rows, self.G, 2), cupy.float32)
            self.zbuf = cupy.empty((max_rows, vocab), cupy.float32)
            self.counts = cupy.zeros((max_slots, vocab), cupy.int32)
            self.mwords = mask_words(vocab)
            self.masks = cupy.zeros((max_rows, self.mwords), cupy.int32)
            self.bias = cupy.zeros(max_rows * BIAS_ROW_WORDS, cupy.int32)
        # pinned host buffers: the per-step copies are true async copies
        self._p_mem = cupy.cuda.alloc_pinned_memory(self.params.nbytes)
        self._p_host = np.frombuffer(self._p_mem, np.int32, self.params.size).reshape(self.params.shape)
        self._o_mem = cupy.cuda.alloc_pinned_memory(self.out.nbytes)
        self._o_host = np.frombuffer(self._o_mem, np.int32, self.out.size).reshape(self.out.shape)
        self._m_mem = cupy.cuda.alloc_pinned_memory(self.masks.nbytes)
        self._m_host = np.frombuffer(self._m_mem, np.int32, self.masks.size).reshape(self.masks.shape)
        self._b_mem = cupy.cuda.alloc_pinned_memory(self.bias.nbytes)
        self._b_host = np.frombuffer(self._b_mem, np.int32, self.bias.size)
        # results come back double-buffered: a launch's copy into one pinned buffer and an event,
        # read by fetch_finish while the next step's forward pass already runs
        self._o_mem2 = cupy.cuda.alloc_pinned_memory(self.out.nbytes)
        self._o_bufs = [self._o_host,
                        np.frombuffer(self._o_mem2, np.int32, self.out.size).reshape(self.out.shape)]
        self._o_events = [cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)]
        self._o_busy = [False, False]
        self._o_gen = [0, 0]
        self._o_next = 0
        self._in_copied = cupy.cuda.Event(disable_timing=True)   # the pinned inputs' last copy is done
        self._asked = np.zeros(max_rows, bool)      # rows of the last launch that want logprobs
        log.info("gpu sampler: vocab %d, %d blocks per row, gathers up to %d tokens per row in shared memory",
                 vocab, self.G, cap)

    def _fn(self, name: str):
        """A sampling.cu kernel. The module compiles on the compile threads from start-up on and is
        loaded at the first sampled step (sampling runs eagerly after a decode graph, never
        inside a capture)."""
        if self._fns is None:
            mod = load_module(self.device_id, "sampling.cu")
            fns = {n: mod.get_function(n) for n in ("sample_prep", "sample_hist", "sample_final", "counts_reset")}
            with cupy.cuda.Device(self.device_id):
                fns["sample_hist"].max_dynamic_shared_size_bytes = self.smem_hist
                fns["sample_final"].max_dynamic_shared_size_bytes = self.smem_final
                for fn in fns.values():
                    _ = fn.attributes
            self._fns = fns
        return self._fns[name]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.params, self.out, self.hcnt, self.hw, self.rowmax, self.zmass,
                                      self.lsep, self.zbuf, self.counts, self.masks, self.bias))

    def reset_counts(self, slot: int, prompt: np.ndarray, stream: cupy.cuda.Stream,
                     generated: np.ndarray | None = None) -> None:
        """Zero the slot's counts, mark the prompt's tokens and count each generated token (a
        sequence resumed after a preemption); eager, never inside a capture."""
        p = np.asarray(prompt, np.int32).reshape(-1)
        g = np.asarray(generated if generated is not None else (), np.int64).reshape(-1)
        row = self.counts[slot]
        with stream:   # launches go to the current stream
            if g.size:   # rare: the whole row is made on the host (prompt bit | 2 x times generated)
                host = np.zeros(self.V, np.int32)
                host[p] = 1
                host += 2 * np.bincount(g, minlength=self.V)[:self.V].astype(np.int32)
                row.set(host, stream=stream)
                return
            dp = cupy.zeros(max(p.size, 1), cupy.int32)
            if p.size:
                dp[:p.size].set(p, stream=stream)
            self._fn("counts_reset")((1,), (1024,), (_U64(row.data.ptr), _I32(self.V), _U64(dp.data.ptr), _I32(p.size)))

    def launch(self, logits: int, ld: int, argmax: int, rows: Sequence[SampleRow], slots: Sequence[int],
               tokens_in: Sequence[int] | None, stream: cupy.cuda.Stream, io: int = 0) -> None:
        """Sample rows[i] from logits row i (device pointer, row stride ld floats); argmax: the raw
        argmax per row (int32 device pointer, the forward pass's). tokens_in[i] is counted for rows
        with penalties before they apply. The rows' masks and biases are copied out before this
        returns (the caller may reuse them). Results stay on the device until `fetch` (or
        fetch_start). io: int32 device pointer that also receives each row's token (the next decode
        step's input row), 0: none."""
        n = len(rows)
        if not 0 < n <= self.max_rows:
            raise ValueError(f"{n} rows; this sampler takes 1..{self.max_rows}")
        self._in_copied.synchronize()     # the previous launch's copies have read the pinned inputs
        self._p_host[:n] = kernel_params(rows, self.V, slots, tokens_in)
        constrained = any(r.constrained for r in rows)
        n_masks = pack_masks(rows, self._m_host) if constrained else 0
        n_bias = pack_bias(rows, self._b_host) if constrained else 0
        self._asked[:n] = [r.logprobs for r in rows]
        P, z, rm = _U64(self.params.data.ptr), _U64(self.zbuf.data.ptr), _U64(self.rowmax.data.ptr)
        x, V, ldi, sl = _U64(logits), _I32(self.V), _I32(ld), _I32(self.slice)
        hc, hw, zm, ls = (_U64(a.data.ptr) for a in (self.hcnt, self.hw, self.zmass, self.lsep))
        grid = (self.G, n)
        with stream:   # launches go to the current stream
            self.params[:n].set(self._p_host[:n], stream=stream)
            if n_masks:
                self.masks[:n_masks].set(self._m_host[:n_masks], stream=stream)
            if n_bias:
                self.bias[:n_bias].set(self._b_host[:n_bias], stream=stream)
            self._in_copied.record(stream)
            if constrained or any(r.penalties or not r.greedy for r in rows):
                self._fn("sample_prep")(grid, (PREP_THREADS,), (x, ldi, V, P, _U64(self.counts.data.ptr),
                                                                _U64(self.masks.data.ptr), _I32(self.mwords),
                                                                _U64(self.bias.data.ptr), z, rm, sl))
            if any(r.logprobs or not r.greedy for r in rows):
                self._fn("sample_hist")(grid, (PREP_THREADS,), (x, ldi, V, P, z, rm, hc, hw, zm, ls, sl),
                           shared_mem=self.smem_hist)
            self._fn("sample_final")((n,), (FINAL_THREADS,), (x, ldi, V, P, _U64(argmax), z, rm, hc, hw, zm, ls, _I32(self.G),
                                                 _U64(self.out.data.ptr), _I32(self.cap), _U64(io)),
                        shared_mem=self.smem_final)

    def fetch(self, n: int, stream: cupy.cuda.Stream) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32, raw argmax int32, logprob of the token, logprob of the argmax) for the
        rows of the last launch; waits for the stream. Logprobs are NaN for rows that did not
        ask for them."""
        return self.fetch_finish(self.fetch_start(n, stream))

    def fetch_start(self, n: int, stream: cupy.cuda.Stream) -> tuple[int, int, int, np.ndarray]:
        """Queue the last launch's results for the host (a copy into a pinned buffer, then an
        event) without waiting; fetch_finish(handle) reads them. Two may be outstanding; a third
        takes the buffer of the oldest, whose results are then lost."""
        k = self._o_next
        self._o_next = 1 - k
        if self._o_busy[k]:
            self._o_events[k].synchronize()
        self._o_gen[k] += 1
        self._o_busy[k] = True
        self.out[:n].get(stream=stream, out=self._o_bufs[k][:n], blocking=False)   # async: the event says when
        self._o_events[k].record(stream)
        return k, self._o_gen[k], n, self._asked[:n].copy()

    def fetch_finish(self, handle: tuple[int, int, int, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The results queued by fetch_start (waits for their event)."""
        k, gen, n, asked = handle
        if gen != self._o_gen[k]:
            raise RuntimeError("sampler: these results were overwritten by later launches")
        self._o_events[k].synchronize()
        o = self._o_bufs[k][:n].copy()
        self._o_busy[k] = False
        lp = o[:, 2:].view(np.float32).copy()
        lp[~asked] = np.nan
        return o[:, 0].copy(), o[:, 1].copy(), lp[:, 0].copy(), lp[:, 1].copy()
