"""NumPy reference backend: the oracle every GPU kernel is checked against.

Weights are dequantized once at load (through `gguf.quants`, the llama.cpp team's reference) to
float32; the model is the one definition in model/ (model/families.py), and `CpuOps` runs its
operations as the plain math of model/math.py, which is written independently of the GPU kernels.
It also serves small models where no GPU exists.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..formats import ModelFile
from ..formats.quants import dequantize
from ..model.config import ModelConfig
from ..model.families import build_model
from ..model.math import apply_rope, attention, gelu_tanh, rms_norm, rope_angles, route, silu, swiglu_oai
from ..model.ops import AttentionSpec
from ..progress import progress
from .base import PrefillItem, SampleResult, SampleRow, checked_tables
from .runner import StepHandle, StepRunner
from .sampling import sample_rows

log = logging.getLogger(__name__)


def _as_slice(blocks: np.ndarray) -> np.ndarray | slice:
    """Consecutive block ids as a slice (the pool's rows are then read as a view, not a copy)."""
    if blocks.size and blocks[-1] - blocks[0] == blocks.size - 1 and np.all(np.diff(blocks) == 1):
        return slice(int(blocks[0]), int(blocks[-1]) + 1)
    return blocks


class _Dequantized:
    """The model's loader (model/transformer.py Loader): every tensor as float32, dequantized once."""

    def __init__(self, model: ModelFile, advance: Callable[[int], None]):
        self.file, self.advance = model, advance

    def matrix(self, name: str) -> np.ndarray:
        t = self.file.tensor(name)
        self.advance(t.nbytes)
        return np.ascontiguousarray(dequantize(t.data, t.qtype, t.shape))

    vector = matrix

    def has(self, name: str) -> bool:
        return self.file.get(name) is not None


# act(gate, up) of a gated MLP, by the model's activation
_GATED = {"silu": lambda g, u: silu(g) * u, "gelu_tanh": lambda g, u: gelu_tanh(g) * u, "swiglu_oai": swiglu_oai}


class CpuOps:
    """The model's operations (model/ops.py) for one forward over a batch of segments: segment j is
    the rows bounds[j]:bounds[j+1] of one slot, at positions pos; `writes[j]` are the pool rows its
    new K/V go to, `reads[j]` the blocks holding its positions 0..ends[j]-1. Matrix products run over
    every row at once; attention per segment."""

    def __init__(self, be: "CPUBackend", ids: np.ndarray, pos: np.ndarray, bounds: np.ndarray, writes, reads,
                 ends: list[int], slots: Sequence[int], starts: Sequence[int]):
        self.be, self.c = be, be.config
        self.ids, self.pos, self.bounds, self.writes, self.reads, self.ends = ids, pos, bounds, writes, reads, ends
        self.slots, self.starts = slots, starts

    def embed(self, table: np.ndarray, scale: float) -> np.ndarray:
        return table[self.ids] * np.float32(scale)

    def norm_linear(self, x, norm, mats, biases) -> tuple:
        h = rms_norm(x, norm, self.c.rms_eps)
        return tuple(h @ w.T if b is None else h @ w.T + b for w, b in zip(mats, biases))

    def attention(self, q, k, v, spec: AttentionSpec, sinks=None, head_norms=None) -> np.ndarray:
        c, T, D = self.c, q.shape[0], self.c.head_dim
        q, k, v = q.reshape(T, -1, D), k.reshape(T, -1, D), v.reshape(T, -1, D)
        if head_norms is not None:
            q, k = (rms_norm(y, w, c.rms_eps) for y, w in zip((q, k), head_norms))
        r = spec.rope
        cos, sin = rope_angles(self.pos, r.dim, r.theta, r.scaling)
        q, k = apply_rope(q, cos, sin, r.style), apply_rope(k, cos, sin, r.style)
        out = np.empty((T, q.shape[1] * D), np.float32)
        kv = self.be.kv_index[spec.layer]
        kp, vp = self.be.k_pool[kv], self.be.v_pool[kv]
        bounds = self.bounds
        for j, L in enumerate(self.ends):
            a, b = bounds[j], bounds[j + 1]
            blk, off = self.writes[j]
            kp[blk, off], vp[blk, off] = k[a:b], v[a:b]
            # the sequence's K/V in position order, gathered through its table
            kc = kp[self.reads[j]].reshape(-1, c.n_kv_heads, D)[:L]
            vc = vp[self.reads[j]].reshape(-1, c.n_kv_heads, D)[:L]
            out[a:b] = attention(q[a:b], kc.astype(np.float32, copy=False), vc.astype(np.float32, copy=False),
                                 self.pos[a:b], spec.scale, spec.window, sinks)
        return out

    def linear_residual(self, a, w, x, post_norm, bias=None) -> np.ndarray:
        o = a @ w.T if bias is None else a @ w.T + bias
        if post_norm is not None:
            o = rms_norm(o, post_norm, self.c.rms_eps)
        return x + o

    def norm_gated_mlp(self, x, norm, gate, up, act: str) -> np.ndarray:
        h = rms_norm(x, norm, self.c.rms_eps)
        return _GATED[act](h @ gate.T, h @ up.T)

    def norm_moe_residual(self, x, norm, e) -> np.ndarray:
        h = rms_norm(x, norm, self.c.rms_eps)
        top, w = route(h @ e.router.T if e.router_bias is None else h @ e.router.T + e.router_bias, e.top_k,
                       e.renormalize)
        out = np.zeros_like(x)
        gated = _GATED[e.act]

        def proj(m, bias, ex, rows):
            return rows @ m[ex].T if bias is None else rows @ m[ex].T + bias[ex]

        for ex in np.unique(top):                   # each chosen expert over the rows that chose it
            rows, k = np.nonzero(top == ex)
            hr = h[rows]
            a = gated(proj(e.gate, e.gate_bias, ex, hr), proj(e.up, e.up_bias, ex, hr))
            out[rows] += w[rows, k, None] * proj(e.down, e.down_bias, ex, a)
        if e.shared_gate is not None:
            shared = _GATED[e.act](h @ e.shared_gate.T, h @ e.shared_up.T) @ e.shared_down.T
            out += _sigmoid(h @ e.shared_router.T) * shared
        return x + out

    def split_heads(self, y, parts: int) -> tuple:
        T, D = y.shape[0], self.c.head_dim
        h = y.reshape(T, -1, parts, D)
        return tuple(np.ascontiguousarray(h[:, :, i]).reshape(T, -1) for i in range(parts))

    def sigmoid_gate(self, y, gate) -> np.ndarray:
        return y * _sigmoid(gate)

    def delta_rule(self, mixed, z, beta, alpha, net) -> np.ndarray:
        T = mixed.shape[0]
        nk, dk, nv, dv = net.k_heads, net.k_dim, net.v_heads, net.v_dim
        K = net.conv.shape[1]
        conv_state, states = self.be.recurrent_state(net.layer)
        g = np.exp(net.a_coef * _softplus(alpha + net.dt_bias))     # decay per row and value head
        b = _sigmoid(beta)
        out = np.empty((T, nv, dv), np.float32)
        for j, (slot, start) in enumerate(zip(self.slots, self.starts)):
            a0, a1 = self.bounds[j], self.bounds[j + 1]
            n = a1 - a0
            if start == 0:                        # a sequence's first step: no state before it
                conv_state[slot] = 0
                states[slot] = 0
            xs = np.concatenate([conv_state[slot], mixed[a0:a1]], axis=0)          # [K - 1 + n, C]
            conv_state[slot] = xs[n:]
            y = silu(sum(xs[i:i + n] * net.conv[:, i] for i in range(K)))
            q, k, v = np.split(y, [nk * dk, 2 * nk * dk], axis=1)
            # value head h reads key head h % nk: the key heads tiled nv // nk times
            q = np.tile(_l2norm(q.reshape(n, nk, dk)), (1, nv // nk, 1)) / np.sqrt(dk)
            k = np.tile(_l2norm(k.reshape(n, nk, dk)), (1, nv // nk, 1))
            v = v.reshape(n, nv, dv)
            S = states[slot].astype(np.float64)
            for t in range(n):
                S *= g[a0 + t][:, None, None]
                delta = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * b[a0 + t][:, None]
                S += k[t][:, :, None] * delta[:, None, :]
                out[a0 + t] = np.einsum("hkv,hk->hv", S, q[t])
            states[slot] = S
        return (rms_norm(out, net.out_norm, self.c.rms_eps) * silu(z.reshape(T, nv, dv))).reshape(T, nv * dv)

    def logits(self, x, norm, w) -> np.ndarray:
        return rms_norm(x[self.bounds[1:] - 1], norm, self.c.rms_eps) @ w.T


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum x^2 + eps) over the last axis (the DeltaNet's q and k per head)."""
    return x / np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)


# ---------------------------------------------------------------- the backend

class CPUBackend(StepRunner):
    name = "cpu"

    def __init__(self, model: ModelFile, max_slots: int = 8, max_context: int = 2048,
                 kv_dtype: type = np.float32, block_size: int = 16, num_blocks: int | None = None):
        """A KV pool of num_blocks blocks of block_size positions (None: enough for every slot at
        full context). kv_dtype=np.float16 stores the KV cache as the CUDA backend does (half the
        memory); the GPU parity tests use it so that they compare kernels, not storage formats."""
        self.config: ModelConfig = model.config
        self.max_slots = max_slots
        self.max_context = min(max_context, self.config.context_length) if self.config.context_length else max_context
        c = self.config

        # GGUF bytes read and dequantized (a bar on a terminal: a 1.5B model takes a while)
        with progress("cpu: dequantizing weights", total=model.total_bytes, log=log) as advance:
            self.model = build_model(c, _Dequantized(model, advance))
        # KV pool: per layer that keeps K and V (c.kv_layers; a hybrid's recurrent layers keep
        # none) [num_blocks, block_size, kv_heads, head_dim] for K and for V; layer li's are
        # k_pool[kv_index[li]] and v_pool[kv_index[li]]. A slot reads and writes them through its
        # block table. np.zeros pages in lazily.
        self.block_size = block_size
        self.max_blocks_per_seq = -(-self.max_context // block_size)
        self.num_blocks = num_blocks if num_blocks is not None else max_slots * self.max_blocks_per_seq
        self.kv_index = {li: i for i, li in enumerate(c.kv_layers)}
        shape = (self.num_blocks, block_size, c.n_kv_heads, c.head_dim)
        self.k_pool = [np.zeros(shape, kv_dtype) for _ in self.kv_index]
        self.v_pool = [np.zeros(shape, kv_dtype) for _ in self.kv_index]
        self.tables: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(max_slots)]
        # per recurrent layer (hybrids), by its index among them: each slot's conv inputs
        # [slots, conv_kernel - 1, channels] and DeltaNet state [slots, v_heads, k_dim, v_dim],
        # float32, c.recurrent_state_bytes per slot (paged in as used)
        channels = 2 * c.ssm_k_heads * c.ssm_k_dim + c.ssm_v_heads * c.ssm_v_dim
        self._recurrent = [(np.zeros((max_slots, c.ssm_conv_kernel - 1, channels), np.float32),
                            np.zeros((max_slots, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim), np.float32))
                           for _ in range(sum(c.recurrent))]
        self.counts: np.ndarray | None = None   # [slots, vocab] token counts, made on first use
        log.info("cpu backend: %s, %d layers, hidden %d, %.0f MB of float32 weights; KV pool %d blocks "
                 "x %d positions over %d layers (%.0f MB, paged in as used)%s", c.arch, c.n_layers, c.hidden,
                 self.weight_bytes() / 1e6, self.num_blocks, block_size, len(self.kv_index), self.kv_bytes() / 1e6,
                 f", recurrent state {self.recurrent_state_bytes / 1e6:.1f} MB" if self._recurrent else "")

    def recurrent_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Recurrent layer `layer`'s (its index among the recurrent layers) state of every slot:
        the conv inputs kept and the DeltaNet state."""
        return self._recurrent[layer]

    @property
    def recurrent_state_bytes(self) -> int:
        """Bytes of a hybrid's recurrent state (every slot's), 0 for other models."""
        return sum(a.nbytes + b.nbytes for a, b in self._recurrent)

    def kv_bytes(self) -> int:
        """Bytes of the KV pool: K and V of the layers that keep them."""
        return sum(a.nbytes for a in self.k_pool) + sum(a.nbytes for a in self.v_pool)

    def set_block_table(self, slot: int, blocks: Sequence[int]) -> None:
        self.set_block_tables({slot: blocks})

    def set_block_tables(self, tables: Mapping[int, Sequence[int]]) -> None:
        for slot, t in checked_tables(tables, self.max_slots, self.max_blocks_per_seq, self.num_blocks, np.int64):
            self.tables[slot] = t

    def weight_bytes(self) -> int:
        m = self.model
        blocks = [b for layer in m.layers for b in (layer.attention, layer.ffn)]
        arrays = {id(a): a for b in blocks for a in vars(b).values() if isinstance(a, np.ndarray)}
        arrays.update({id(a): a for a in (m.tok_embd, m.output, m.output_norm)})
        return sum(a.nbytes for a in arrays.values())

    # One forward over a batch of segments: segment j is `tokens[j]` for slot `slots[j]`
    # starting at `starts[j]`. Matmuls run over all tokens at once; attention per segment.
    def _forward(self, slots: Sequence[int], tokens: Sequence[np.ndarray], starts: Sequence[int]) -> np.ndarray:
        lens = [len(t) for t in tokens]
        bs = self.block_size
        for slot, n, s in zip(slots, lens, starts):
            if s + n > self.max_context:
                raise ValueError(f"slot {slot}: position {s + n - 1} is past the context ({self.max_context})")
            if s + n > self.tables[slot].size * bs:
                raise ValueError(f"slot {slot}: position {s + n - 1} has no KV block (its table covers "
                                 f"{self.tables[slot].size * bs} positions)")
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
        bounds = np.cumsum([0] + lens)
        # per segment: the pool rows its new tokens go to, and the blocks holding its positions
        writes = [(self.tables[sl][pos[a:b] // bs], pos[a:b] % bs) for sl, a, b in zip(slots, bounds, bounds[1:])]
        reads = [_as_slice(self.tables[sl][:-(-(st + n) // bs)]) for sl, st, n in zip(slots, starts, lens)]
        ops = CpuOps(self, ids, pos, bounds, writes, reads, [s + n for s, n in zip(starts, lens)], slots, starts)
        return self.model.forward(ops).astype(np.float32)

    def prefill(self, items: Sequence[PrefillItem]) -> np.ndarray:
        return self._forward([it.slot for it in items], [it.tokens for it in items],
                             [it.start_pos for it in items])

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        return self._forward(list(slots), [np.array([t]) for t in tokens], list(positions))

    # the model runner's calls (runner.py): a step's forward pass runs at once and its handle keeps
    # the logits; its sampling is the NumPy twin of the GPU's sampling kernels
    def _run_prompts(self, h: StepHandle) -> None:
        h.state = self.prefill(h.prompts)[:, :self.config.vocab_size]

    def _run_decode(self, h: StepHandle) -> None:
        h.state = self.decode(h.slots, self.fed_tokens(h), h.positions)[:, :self.config.vocab_size]

    def _sample(self, h: StepHandle, rows: list[SampleRow]) -> Callable[[], SampleResult]:
        counts: list[np.ndarray | None] = []
        for s, r, t in zip(h.slots, rows, h.tokens or [None] * len(rows)):
            if r.penalties:
                if t is not None:                 # a decode row: the token it feeds counts from now on
                    self._counts()[s, t] += 2
                counts.append(self._counts()[s])
            else:
                counts.append(None)
        res = sample_rows(h.state, rows, counts)
        h.state = None
        return lambda: res

    def reset_counts(self, slot: int, prompt: np.ndarray, generated: np.ndarray | None = None) -> None:
        c = self._counts()
        c[slot] = 0
        c[slot, np.asarray(prompt, np.int64)] = 1
        if generated is not None:
            np.add.at(c[slot], np.asarray(generated, np.int64), 2)

    def _counts(self) -> np.ndarray:
        if self.counts is None:
            self.counts = np.zeros((self.max_slots, self.config.vocab_size), np.int32)
        return self.counts

    def release(self, slot: int) -> None:
        self.tables[slot] = np.zeros(0, np.int64)

    def stats(self) -> dict[str, Any]:
        return {"graph_status": {"all": "disabled"}, "pool_bytes": 0, "device_memory_bytes": 0,
                "kv_pool_bytes": self.kv_bytes(), "recurrent_state_bytes": self.recurrent_state_bytes}

    def close(self) -> None:
        self.k_pool.clear()
        self.v_pool.clear()
        self._recurrent.clear()
