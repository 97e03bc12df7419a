"""CUDABackend: the Backend protocol on one NVIDIA GPU (CuPy RawKernels, CUDA graphs).

Start-up order: kernels compile while the weights go up; the self-check; the workspace, the
forward pass (with the split16 prefill's kept weights), the sampler and a hybrid's recurrent state
(recurrent.py); then the paged KV pool takes what Settings.gpu_memory_utilization of the device
leaves (capped by kv_cache_tokens)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import cupy
import numpy as np

from ... import timeline
from ...errors import BackendError, UnsupportedModelError
from ...formats import ModelFile
from ...settings import Settings
from ..base import PrefillItem, SampleResult, SampleRow
from ..runner import StepHandle, StepRunner, all_plain, greedy_result
from . import ops, pdl
from .forward import Forward, rope_host_tables
from .graphs import DecodeGraphs, PrefillGraphs
from .kv_cache import KVCache, block_bytes
from .modules import get_kernels
from .recurrent import RecurrentState
from .sampling import GpuSampler
from .support import RECURRENT_STATE_SHARE, recurrent_slots, refusal
from .token_ring import TokenRing
from .weights import DeviceWeights
from .workspace import Workspace, next_pow2

log = logging.getLogger(__name__)

PREFILL_TOKENS = 512   # initial prefill capacity per step; the workspace grows past it on demand
# decode steps take the long-row attention (flash-decoding, split over the sequence) from this many
# rows, or when a row is this deep in its context; below both, attention.cu's one block per row and
# head is faster (its one pass over a short row needs no combine)
LONG_ATTENTION_ROWS = 16
LONG_ATTENTION_POS = 384


class CUDABackend(StepRunner):
    name = "cuda"

    def __init__(self, model: ModelFile, max_slots: int | None = None, max_context: int | None = None,
                 settings: Settings | None = None, programmatic_launch: bool = True):
        """max_slots / max_context: None takes them from settings (max_num_seqs; context_length,
        0 = the model's own, never more than the model's). programmatic_launch: decode graphs link
        their kernels by programmatic dependent launch on compute capability 9.0+ (each kernel
        starts, and prefetches its weights, while the one before finishes); False: plain launches,
        the reference the tests compare them with."""
        self.settings = settings or Settings()
        c = self.config = model.config
        why = refusal(model)
        if why is not None:
            raise UnsupportedModelError(model.path, f"{why} (REALIZAR_BACKEND=cpu runs this model)")
        self.max_slots = max_slots or self.settings.max_num_seqs
        want = max_context or self.settings.context_length or c.context_length
        self.max_context = min(want, c.context_length) if c.context_length else want
        self.device = cupy.cuda.Device(self.settings.device)
        self.device.use()
        log.debug("cuda device %d current (primary context created)", self.settings.device)
        timeline.mark("cuda: device current")
        qtypes = {t.qtype for t in self._matrix_types(model)}
        # the RoPE tables (host math, GIL released) are made while the weights go up
        rope_pool = ThreadPoolExecutor(1, thread_name_prefix="rope")
        rope_host = rope_pool.submit(rope_host_tables, c, self.max_context)
        rope_pool.shutdown(wait=False)
        # the weights go up while the kernels compile (the upload needs only repack.cu)
        self.kernels = get_kernels(self.settings.device, qtypes, c.head_dim, wait=False,
                                   prebuilt=self.settings.prebuilt_kernels)
        self.weights = DeviceWeights(model, self.kernels)
        timeline.mark("cuda: weights uploaded")
        if c.has_recurrent_state:
            self.max_slots = self._recurrent_slots()
        self.kernels.ready(max_batch=max_slots)     # GEMVs for wider batches than this: on first use
        timeline.mark("cuda: core kernels ready")
        if self.settings.self_check:
            from .selfcheck import run_self_check
            run_self_check(self.kernels, qtypes, c)
            timeline.mark("cuda: self-check passed")
        self.buckets = [1 << i for i in range(next_pow2(self.max_slots).bit_length())]
        self.ws = Workspace(c, self.buckets[-1], PREFILL_TOKENS, self.weights.max_matrix_elems)
        self.fwd = Forward(self.kernels, self.weights, self.ws, self.settings, self.max_context, rope_host)
        timeline.mark("cuda: workspace and forward pass built")
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # sampling kernels run eagerly after the step's graph replay, on the same stream
        self.sampler = GpuSampler(self.settings.device, c.vocab_size, self.buckets[-1], self.max_slots)
        self.block_size = self.settings.block_size
        # a hybrid's recurrent state (a fixed size per slot) before the KV pool takes what is left
        self.recurrent = self.fwd.recurrent = RecurrentState(c, self.max_slots) if c.has_recurrent_state else None
        self.num_blocks = self._pool_blocks()
        timeline.mark("cuda: sampler built, device idle, KV pool sized")
        self.kv = self.fwd.kv = KVCache(c, self.num_blocks, self.block_size, self.max_slots, self.max_context)
        timeline.mark("cuda: KV pool allocated")
        # programmatic dependent launches inside the decode graphs (sm_90+, pdl.py)
        use_pdl = (programmatic_launch and self.settings.cuda_graphs and int(self.device.compute_capability) >= 90
                   and pdl.launcher() is not None)
        self.graphs = DecodeGraphs(self.stream, self.fwd.decode_step, self.settings.cuda_graphs,
                                   lambda on: setattr(self.fwd, "pdl", on), use_pdl)
        self.ws.listeners.append(self.graphs.drop)
        # prompt steps: key (rows, head rows, splits, family), Forward.prefill_key; those on the
        # split16 GEMMs are captured once their key comes again
        self.prefill_graphs = PrefillGraphs(
            self.stream, lambda rows, n, splits, family: self.fwd.prefill_launches(rows, n, family),
            self.settings.cuda_graphs)
        self.ws.listeners.append(self.prefill_graphs.drop)
        self.fwd.scratch_listeners.append(self.prefill_graphs.drop)
        # pinned host buffers: the per-step copies in and out are true async copies
        self._io_mem = cupy.cuda.alloc_pinned_memory(self.ws.dec_io.nbytes)
        self._io_host = np.frombuffer(self._io_mem, np.int32, self.ws.dec_io.size).reshape(self.ws.dec_io.shape)
        self._io_copied = cupy.cuda.Event(disable_timing=True)   # the pinned inputs' last copy is done
        # a continuation over another batch: the new rows' inputs and the kept rows' sources, staged
        # for decode_io_merge (the same layout as dec_io; row 3: the previous row, or -1)
        self._stage = cupy.zeros(self.ws.dec_io.shape, cupy.int32)
        self._stage_mem = cupy.cuda.alloc_pinned_memory(self._stage.nbytes)
        self._stage_host = np.frombuffer(self._stage_mem, np.int32, self._stage.size).reshape(self._stage.shape)
        self._stage_copied = cupy.cuda.Event(disable_timing=True)
        # every decode step's argmax tokens, written by the step itself into mapped host memory
        self.token_ring = TokenRing(self.ws.dec_io.shape[1])
        self.fwd.token_ring = (self.token_ring.device_ptr, self.token_ring.length)
        self._last_step: tuple[int, list[int], list[int]] | None = None   # (bucket, slots, positions)
        if not self.settings.cuda_graphs:
            log.info("cuda graphs disabled by settings: decode runs eager")
        log.info("cuda backend ready: %s on %s, %d sequences x %d context, KV pool %d tokens, buckets %s%s",
                 c.arch, cupy.cuda.runtime.getDeviceProperties(self.settings.device)["name"].decode(),
                 self.max_slots, self.max_context, self.num_blocks * self.block_size, self.buckets,
                 f", recurrent state {self.recurrent_state_bytes / 1e6:.1f} MB" if self.recurrent is not None else "")

    def _budget(self) -> int:
        """Device bytes gpu_memory_utilization leaves now (CuPy's pool's unused bytes included)."""
        cupy.cuda.runtime.deviceSynchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        free += cupy.get_default_memory_pool().free_bytes()      # held by CuPy's pool but unused: ours
        return free - int(total * (1.0 - self.settings.gpu_memory_utilization))

    def _recurrent_slots(self) -> int:
        """A hybrid's slot count: max_num_seqs, or as many as support.recurrent_slots lets the
        recurrent state take of the memory left after the weights."""
        per, budget = self.config.recurrent_state_bytes, self._budget()
        n = recurrent_slots(per, self.max_slots, budget)
        if n < 1:
            raise BackendError(f"no device memory for one sequence's recurrent state ({per / 1e6:.0f} MB; "
                               f"{budget / 1e6:.0f} MB left after the weights under gpu_memory_utilization "
                               f"{self.settings.gpu_memory_utilization})")
        if n < self.max_slots:
            log.warning("%d sequences at once instead of max_num_seqs %d: each keeps %.0f MB of recurrent "
                        "state, which may take at most %.0f%% of the %.1f GB left after the weights",
                        n, self.max_slots, per / 1e6, 100 * RECURRENT_STATE_SHARE, budget / 1e9)
        return n

    def _pool_blocks(self) -> int:
        """KV blocks: what gpu_memory_utilization of the device leaves after everything allocated so
        far, capped by kv_cache_tokens and by what max_slots whole contexts could use."""
        s, c = self.settings, self.config
        budget = self._budget()
        per = block_bytes(c, s.block_size)
        n = budget // per
        if s.kv_cache_tokens:
            n = min(n, s.kv_cache_tokens // s.block_size)
        n = min(n, self.max_slots * -(-self.max_context // s.block_size))
        if n < 1:
            raise BackendError(f"no device memory left for the KV cache ({budget / 1e6:.0f} MB under "
                               f"gpu_memory_utilization {s.gpu_memory_utilization}; one block needs "
                               f"{per / 1e6:.2f} MB)")
        return int(n)

    @staticmethod
    def _matrix_types(model: ModelFile):
        """The matrices and stacks of experts' matrices, whose types the kernels are built for."""
        return [t for n, t in model.tensors.items() if len(t.shape) in (2, 3)]

    # ------------------------------------------------------------ graphs
    def _long(self, b: int, positions: Sequence[int]) -> bool:
        """Whether a decode step's attention takes the long-row kernels (flash-decoding): batches
        of many rows, or any row deep in its context."""
        return self.fwd.flash_decode and (b >= LONG_ATTENTION_ROWS or max(positions) >= LONG_ATTENTION_POS)

    # ------------------------------------------------------------ protocol
    def set_block_table(self, slot: int, blocks: Sequence[int]) -> None:
        with self.device:
            self.kv.set_table(slot, blocks, self.stream)

    def set_block_tables(self, tables: Mapping[int, Sequence[int]]) -> None:
        with self.device:
            self.kv.set_tables(tables, self.stream)

    def _check(self, slot: int, last_pos: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.max_slots - 1}")
        if last_pos >= self.max_context or last_pos < 0:
            raise ValueError(f"slot {slot}: position {last_pos} is past the context ({self.max_context})")
        if last_pos >= self.kv.covered[slot]:
            raise ValueError(f"slot {slot}: position {last_pos} has no KV block (its table covers "
                             f"{self.kv.covered[slot]} positions): set_block_table first")

    def prefill(self, items: Sequence[PrefillItem]) -> np.ndarray:
        if not items:
            return np.zeros((0, self.config.vocab_size), np.float32)
        if len(items) > self.ws.max_rows:
            out = [self.prefill(items[i:i + self.ws.max_rows]) for i in range(0, len(items), self.ws.max_rows)]
            return np.concatenate(out)
        with self.device, self.stream:
            self._prefill_forward(items)
            return self.ws.logits[:len(items)].get()

    def _prefill_forward(self, items: Sequence[PrefillItem]) -> None:
        """Enqueue a prompt step of at most ws.max_rows items (device and stream current): item i's
        logits in ws.logits[i], their argmax in ws.argmax[i]."""
        toks, pos, slots, last = [], [], [], []
        for it in items:
            t = np.asarray(it.tokens, dtype=np.int32).reshape(-1)
            if t.size == 0:
                raise ValueError(f"slot {it.slot}: empty prompt")
            self._check(it.slot, it.start_pos + t.size - 1)
            toks.append(t)
            pos.append(np.arange(it.start_pos, it.start_pos + t.size, dtype=np.int32))
            slots.append(np.full(t.size, it.slot, np.int32))
            last.append(sum(x.size for x in toks) - 1)
        T = sum(t.size for t in toks)
        max_pos = max(it.start_pos + t.size - 1 for it, t in zip(items, toks))
        key = self.fwd.prefill_key(T, len(items), max_pos)
        rows, n_head = key[0], key[1]
        # rows past T (a tensor-core step's bucket, < 16 of them; a GEMM step's, < 64): token 0 on
        # the scratch slot, as a decode bucket's padding, at consecutive positions within its one
        # block, so that the prompt attention takes them as runs of up to a block (flash_prefill.cu),
        # not one run each; no item's last row. Head rows past the items (n_head) repeat row 0.
        pad = rows - T
        last += [0] * (n_head - len(items))
        toks.append(np.zeros(pad, np.int32))
        pos.append(np.arange(pad, dtype=np.int32) % min(self.block_size, self.max_context))
        slots.append(np.full(pad, self.kv.scratch_slot, np.int32))
        self.ws.ensure(rows)
        self.ws.tokens[:rows].set(np.concatenate(toks))
        self.ws.positions[:rows].set(np.concatenate(pos))
        self.ws.slots[:rows].set(np.concatenate(slots))
        self.ws.last_idx[:n_head].set(np.asarray(last, np.int32))
        self.fwd.max_pos = max_pos          # the attention plan's splits: the key's
        self.prefill_graphs.run(*key)
        # a decode step executed but not sampled has lost its logits (it can no longer be sampled);
        # one sampled already is intact, and so are the decode inputs a continuation reads
        self._last = None

    def _decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> int:
        n = len(slots)
        if not (n == len(tokens) == len(positions)):
            raise ValueError("slots, tokens and positions must have the same length")
        if n > self.buckets[-1]:
            raise ValueError(f"decode batch {n} exceeds max_slots {self.max_slots}")
        for s, p in zip(slots, positions):
            self._check(int(s), int(p))
        b = next(x for x in self.buckets if x >= n)
        ring_row = self.token_ring.before_step()
        # tokens / positions / slots / ring row in one host->device copy; rows past n are padding
        # on the scratch slot so the captured launch sequence fits
        io = self._io_host
        self._io_copied.synchronize()      # the previous step's copy has read the pinned buffer
        io[0, :] = 0
        io[1, :] = 0
        io[2, :] = self.kv.scratch_slot
        io[3, :] = ring_row
        io[0, :n], io[1, :n], io[2, :n] = tokens, positions, slots
        self.ws.dec_io.set(io, stream=self.stream)
        self._io_copied.record(self.stream)
        self.graphs.run(b, self._long(b, positions))
        self._last_step = (b, [int(s) for s in slots], [int(p) for p in positions])
        self._last = self._last_decode = None    # the runner's step, when it is one, is set after this
        return n

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        with self.device, self.stream:
            n = self._decode(slots, tokens, positions)
            return self.ws.logits[:n].get()

    def _continue_step(self, slots: list[int], rows: list[int], toks: list[int], pos: list[int]) -> None:
        """Run a continuation of the previous decode step (rows, toks, pos: continued_inputs') on the
        tokens that step wrote into the decode inputs (its argmax, or sample_final's): the same rows
        again at their next positions as a plain graph replay, another batch after decode_io_merge
        has gathered the kept rows' inputs and put the host's new rows beside them."""
        b, sl, _ = self._last_step
        for s, p in zip(slots, pos):
            self._check(s, p)
        ring_row = self.token_ring.before_step()
        if rows != list(range(len(sl))):
            n = len(slots)
            if n > self.buckets[-1]:
                raise ValueError(f"decode batch {n} exceeds max_slots {self.max_slots}")
            b = next(x for x in self.buckets if x >= n)
            st = self._stage_host
            self._stage_copied.synchronize()      # the previous merge's copy has read the pinned buffer
            st[0, :n] = [max(t, 0) for t in toks]
            st[1, :n], st[2, :n], st[3, :n] = pos, slots, rows
            self._stage.set(st, stream=self.stream)     # 16 bytes a row: the whole buffer, one copy
            self._stage_copied.record(self.stream)
            ops.decode_io_merge(self.kernels, self.ws.dec_io.data.ptr, self.ws.dec_io.shape[1],
                                self._stage.data.ptr, n, b, self.kv.scratch_slot, ring_row)
        self.graphs.run(b, self._long(b, pos))
        self._last_step = (b, slots, pos)

    # ------------------------------------------------------------ the model runner (runner.py)
    def _run_prompts(self, h: StepHandle) -> None:
        """Enqueue a prompt step: item i's logits in ws.logits[i], their argmax in ws.argmax[i]."""
        n = len(h.prompts)
        if n > self.sampler.max_rows:
            raise ValueError(f"{n} prefill items; at most {self.sampler.max_rows} sample at once")
        with self.device, self.stream:
            self._prefill_forward(h.prompts)

    def _run_decode(self, h: StepHandle) -> None:
        """Enqueue a decode step and return at once. A continuation's kept rows feed the tokens the
        step it continues wrote into the decode inputs (its argmax, or sample_final's), so the host
        enqueues it before it has read that step's tokens."""
        if len(h.slots) > self.sampler.max_rows:
            raise ValueError(f"{len(h.slots)} rows; the sampler takes 1..{self.sampler.max_rows}")
        with self.device, self.stream:
            if h.prev is None:
                self._decode(h.slots, h.tokens, h.positions)
            else:
                self._continue_step(h.slots, h.prev_rows, h.tokens, h.positions)

    def _sample(self, h: StepHandle, rows: list[SampleRow]) -> Callable[[], SampleResult]:
        """Enqueue a step's sampling (kernels/sampling.cu) after its forward pass: 16 bytes a row
        come back, plus the logits of rows that want them (read now, before a next step's forward
        pass overwrites them). Every row plain: the forward pass's argmax is the token, 4 bytes a
        row (a decode step's through the token ring, which its graph writes). A decode step's
        tokens also become its continuation's inputs on the device (the argmax graph's own, or
        sample_final's). A prompt step's tokens are read here (the next step's forward pass
        overwrites the buffers they come from); its sampling writes no decode input (a new
        sequence joins a decode step with its token from the host)."""
        n = len(rows)
        plain = all_plain(rows)
        if h.prompts:
            with self.device, self.stream:
                if plain:
                    res = greedy_result(self.ws.argmax[:n].get())
                else:
                    self.sampler.launch(self.ws.logits.data.ptr, self.ws.logits.shape[1], self.ws.argmax.data.ptr,
                                        rows, h.slots, None, self.stream)
                    kept = {i: self.ws.logits[i].get() for i, r in enumerate(rows) if r.want_logits}
                    # the sampler's other result buffer: a decode step's results (at most one is
                    # unread, the protocol's order) stay intact
                    toks, top_ids, lps, top_lps = self.sampler.fetch(n, self.stream)
                    res = SampleResult(toks, lps, top_ids, top_lps, kept)
            return lambda: res
        if plain:
            with self.device, self.stream:
                ring = self.token_ring.after_step(self.stream, n)
            return lambda: greedy_result(self.token_ring.tokens(ring))
        tokens_in = self.fed_tokens(h)        # counted for the penalties: a kept row's, the previous step's
        with self.device, self.stream:
            self.sampler.launch(self.ws.logits.data.ptr, self.ws.logits.shape[1], self.ws.argmax.data.ptr,
                                rows, h.slots, tokens_in, self.stream, io=self.ws.dec_io.data.ptr)
            kept = {i: self.ws.logits[i].get() for i, r in enumerate(rows) if r.want_logits}
            fetch = self.sampler.fetch_start(n, self.stream)

        def finish() -> SampleResult:
            with self.device:
                toks, top_ids, lps, top_lps = self.sampler.fetch_finish(fetch)
            return SampleResult(toks, lps, top_ids, top_lps, kept)
        return finish

    def _wait(self, h: StepHandle) -> None:
        """A step never sampled (a continuation the engine dropped): its forward pass done, so that
        block tables may change."""
        self.stream.synchronize()

    def reset_counts(self, slot: int, prompt: np.ndarray, generated: np.ndarray | None = None) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.max_slots - 1}")
        with self.device, self.stream:
            self.sampler.reset_counts(slot, prompt, self.stream, generated)

    def graph_ab_check(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One decode step run eagerly and the same step replayed from its graph (the step rewrites
        the same KV-cache rows with the same values): returns (eager logits, replayed logits),
        which must be identical. Captures the bucket's graph first if needed."""
        with self.device, self.stream:
            n = self._decode(slots, tokens, positions)          # captures if pending
            inputs = cupy.asarray(self._io_host)                # each step advances dec_io: restore it
            b = next(x for x in self.buckets if x >= n)
            long = self._long(b, positions)
            self.ws.dec_io[...] = inputs
            self.fwd.decode_step(b, long)
            eager = self.ws.logits[:n].get()
            self.ws.logits.fill(float("nan"))
            self.ws.dec_io[...] = inputs
            self.graphs.replay(b, long)
            replay = self.ws.logits[:n].get()
        return eager, replay

    def release(self, slot: int) -> None:
        """Nothing to free here: the slot's blocks are the engine's, its table is replaced by the
        next sequence's."""

    def stats(self) -> dict[str, Any]:
        free, total = cupy.cuda.runtime.memGetInfo()
        # buckets not yet run report nothing; the rest: captured | eager-fallback | disabled
        return {"graph_status": self.graphs.report(),
                "graph_replays": self.graphs.replays, "graph_captures": self.graphs.captures,
                "programmatic_launch": self.graphs.pdl,
                "pool_bytes": int(self.ws.nbytes + self.kv.nbytes + self.fwd.nbytes + self.recurrent_state_bytes
                                  + (self.sampler.nbytes if self.sampler else 0)),
                "kv_pool_bytes": int(self.kv.nbytes),
                "recurrent_state_bytes": self.recurrent_state_bytes,
                "device_memory_bytes": int(total - free)}

    @property
    def recurrent_state_bytes(self) -> int:
        """Device bytes of a hybrid's recurrent state (every slot's), 0 for other models."""
        return int(self.recurrent.nbytes) if self.recurrent is not None else 0

    def close(self) -> None:
        with self.device:
            self.stream.synchronize()
            self.graphs.clear()
            self.prefill_graphs.clear()
            self.weights.close()
            self.kv.close()
            if self.recurrent is not None:
                self.recurrent.close()
            self.sampler = None
            cupy.get_default_memory_pool().free_all_blocks()

