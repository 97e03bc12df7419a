"""NumPy reference backend: the oracle every GPU kernel is checked against.

Weights are dequantized once at load (through `gguf.quants`, the llama.cpp team's reference) to
float32, and the forward pass is the textbook transformer, written to be read top to bottom.
It also serves small models where no GPU exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..formats import ModelFile
from ..formats.quants import dequantize
from ..model.config import ModelConfig, RopeScaling
from ..progress import progress
from .base import PrefillItem, SampleResult, SampleRow, checked_tables, continued_inputs

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None


# ---------------------------------------------------------------- math shared with the GPU tests

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)).astype(np.float32) * w


def rope_frequencies(rope_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """(angle per position of each rotary pair, float64 [rope_dim / 2]; the factor on cos and sin),
    with the model's RoPE scaling applied as transformers' rope init functions and llama.cpp's
    ggml_rope_ext define it."""
    inv = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if scaling is None:
        return inv, 1.0
    sc = scaling
    if sc.freq_factors is not None:           # GGUF rope_freqs: llama.cpp divides each pair's angle
        inv = inv / np.asarray(sc.freq_factors, np.float64)
    if sc.kind == "linear":
        inv = inv / sc.factor
    elif sc.kind == "yarn":
        # pairs below `low` keep their frequency (extrapolation), pairs past `high` are divided by
        # the factor (interpolation), a linear ramp in between; the corners are the pairs that turn
        # beta_fast and beta_slow times over the original context
        def corner(rotations: float) -> float:
            return rope_dim * np.log(sc.original_context / (rotations * 2 * np.pi)) / (2 * np.log(theta))
        low, high = corner(sc.beta_fast), corner(sc.beta_slow)
        if sc.truncate:
            low, high = np.floor(low), np.ceil(high)
        low, high = max(low, 0.0), min(high, rope_dim - 1.0)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / max(high - low, 0.001), 0.0, 1.0)
        extra = (1.0 - ramp) * sc.ext_factor
        inv = inv / sc.factor * (1.0 - extra) + inv * extra
    elif sc.kind == "llama3":
        wavelen = 2 * np.pi / inv
        low_wl, high_wl = sc.original_context / sc.low_freq_factor, sc.original_context / sc.high_freq_factor
        smooth = (sc.original_context / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        scaled = np.where(wavelen > low_wl, inv / sc.factor, inv)
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, (1 - smooth) * scaled / sc.factor + smooth * scaled, scaled)
    return inv, sc.mscale


def rope_angles(positions: np.ndarray, rope_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angle per rotary pair, float32 [len(positions), rope_dim / 2]
    (YaRN: both times its mscale, which scales the scores by mscale squared)."""
    inv, mscale = rope_frequencies(rope_dim, theta, scaling)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return (np.cos(ang) * mscale).astype(np.float32), (np.sin(ang) * mscale).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x: [T, heads, head_dim]; cos/sin: [T, rope_dim/2]. "normal" rotates adjacent pairs
    (GGUF llama after llama.cpp's q/k permutation), "neox" rotates the two halves."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if style == "normal":
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = a * s + b * c
    return out


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):   # exp(-x) -> inf for very negative x gives the right 0
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float,
              window: int = 0) -> np.ndarray:
    """q: [T, H, D] at absolute positions q_pos; k, v: [S, KVH, D] for positions 0..S-1.
    Causal (and sliding-window when window > 0) softmax attention with grouped KV heads (the
    products as batched matrix products: BLAS, so long prompts stay affordable)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    group = H // kvh
    qg = q.reshape(T, kvh, group, D).transpose(1, 2, 0, 3)                 # [KVH, G, T, D]
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None]) * scale          # [KVH, G, T, S]
    kpos = np.arange(k.shape[0])
    mask = kpos[None, :] > q_pos[:, None]
    if window:
        mask |= kpos[None, :] <= q_pos[:, None] - window
    scores += np.where(mask, np.float32(-np.inf), np.float32(0.0))      # [T, S], broadcast
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v.transpose(1, 0, 2)[:, None])                  # [KVH, G, T, D]
    return out.transpose(2, 0, 1, 3).reshape(T, H * D).astype(np.float32)


def _as_slice(blocks: np.ndarray) -> np.ndarray | slice:
    """Consecutive block ids as a slice (the pool's rows are then read as a view, not a copy)."""
    if blocks.size and blocks[-1] - blocks[0] == blocks.size - 1 and np.all(np.diff(blocks) == 1):
        return slice(int(blocks[0]), int(blocks[-1]) + 1)
    return blocks


# ---------------------------------------------------------------- the backend

class CPUBackend:
    name = "cpu"

    def __init__(self, model: ModelFile, max_slots: int = 8, max_context: int = 2048,
                 kv_dtype: type = np.float32, block_size: int = 16, num_blocks: int | None = None):
        """A KV pool of num_blocks blocks of block_size positions (None: enough for every slot at
        full context). kv_dtype=np.float16 stores the KV cache as the CUDA backend does (half the
        memory); the GPU parity tests use it so that they compare kernels, not storage formats."""
        self.config: ModelConfig = model.config
        self.max_slots = max_slots
        self._last_greedy: tuple[list[int], list[int], list[int]] | None = None   # decode_argmax_start
        self._last_sampled: dict | None = None      # decode_sample_start's last handle
        self.max_context = min(max_context, self.config.context_length) if self.config.context_length else max_context
        c = self.config

        # GGUF bytes read and dequantized (a bar on a terminal: a 1.5B model takes a while)
        with progress("cpu: dequantizing weights", total=model.total_bytes, log=log) as advance:
            def w(name: str) -> np.ndarray:
                t = model.tensor(name)
                advance(t.nbytes)
                return np.ascontiguousarray(dequantize(t.data, t.qtype, t.shape))

            def opt(name: str) -> np.ndarray | None:
                return w(name) if model.get(name) is not None else None

            self.tok_embd = w("token_embd.weight")
            self.output = self.tok_embd if c.tie_embeddings else w("output.weight")
            self.output_norm = w("output_norm.weight")
            self.layers: list[LayerWeights] = []
            for i in range(c.n_layers):
                b = f"blk.{i}."
                self.layers.append(LayerWeights(
                    attn_norm=w(b + "attn_norm.weight"), wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"),
                    wv=w(b + "attn_v.weight"), wo=w(b + "attn_output.weight"), ffn_norm=w(b + "ffn_norm.weight"),
                    w_gate=w(b + "ffn_gate.weight"), w_up=w(b + "ffn_up.weight"), w_down=w(b + "ffn_down.weight"),
                    bq=opt(b + "attn_q.bias"), bk=opt(b + "attn_k.bias"), bv=opt(b + "attn_v.bias"),
                    q_norm=opt(b + "attn_q_norm.weight"), k_norm=opt(b + "attn_k_norm.weight"),
                    post_attn_norm=opt(b + "post_attention_norm.weight"),
                    post_ffn_norm=opt(b + "post_ffw_norm.weight"),
                ))
        self.act = gelu_tanh if c.activation == "gelu_tanh" else silu
        # KV pool: per layer [num_blocks, block_size, kv_heads, head_dim] for K and for V; a slot
        # reads and writes it through its block table. np.zeros pages in lazily.
        self.block_size = block_size
        self.max_blocks_per_seq = -(-self.max_context // block_size)
        self.num_blocks = num_blocks if num_blocks is not None else max_slots * self.max_blocks_per_seq
        shape = (self.num_blocks, block_size, c.n_kv_heads, c.head_dim)
        self.k_pool = [np.zeros(shape, kv_dtype) for _ in range(c.n_layers)]
        self.v_pool = [np.zeros(shape, kv_dtype) for _ in range(c.n_layers)]
        self.tables: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(max_slots)]
        self.counts: np.ndarray | None = None   # [slots, vocab] token counts, made on first use
        log.info("cpu backend: %s, %d layers, hidden %d, %.0f MB of float32 weights; KV pool %d blocks "
                 "x %d positions (%.0f MB, paged in as used)", c.arch, c.n_layers, c.hidden,
                 self.weight_bytes() / 1e6, self.num_blocks, block_size, self.kv_bytes() / 1e6)

    def kv_bytes(self) -> int:
        return sum(a.nbytes for a in self.k_pool) + sum(a.nbytes for a in self.v_pool)

    def set_block_table(self, slot: int, blocks: Sequence[int]) -> None:
        self.set_block_tables({slot: blocks})

    def set_block_tables(self, tables: Mapping[int, Sequence[int]]) -> None:
        for slot, t in checked_tables(tables, self.max_slots, self.max_blocks_per_seq, self.num_blocks, np.int64):
            self.tables[slot] = t

    def weight_bytes(self) -> int:
        total = self.tok_embd.nbytes + (0 if self.output is self.tok_embd else self.output.nbytes)
        for lw in self.layers:
            total += sum(a.nbytes for a in vars(lw).values() if isinstance(a, np.ndarray))
        return total

    # One forward over a batch of segments: segment j is `tokens[j]` for slot `slots[j]`
    # starting at `starts[j]`. Matmuls run over all tokens at once; attention per segment.
    def _forward(self, slots: Sequence[int], tokens: Sequence[np.ndarray], starts: Sequence[int]) -> np.ndarray:
        c = self.config
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
        x = self.tok_embd[ids] * np.float32(c.embed_scale)
        T = len(ids)
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw.attn_norm, c.rms_eps)
            q, k, v = h @ lw.wq.T, h @ lw.wk.T, h @ lw.wv.T
            if lw.bq is not None:
                q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
            q = q.reshape(T, c.n_heads, c.head_dim)
            k = k.reshape(T, c.n_kv_heads, c.head_dim)
            v = v.reshape(T, c.n_kv_heads, c.head_dim)
            if lw.q_norm is not None:
                q, k = rms_norm(q, lw.q_norm, c.rms_eps), rms_norm(k, lw.k_norm, c.rms_eps)
            cos, sin = rope_angles(pos, c.rope_dim, c.layer_rope_theta(li), c.layer_rope_scaling(li))
            q, k = apply_rope(q, cos, sin, c.rope_style), apply_rope(k, cos, sin, c.rope_style)
            window = c.sliding_window if c.is_sliding(li) else 0
            attn = np.empty((T, c.q_dim), np.float32)
            kp, vp = self.k_pool[li], self.v_pool[li]
            for j in range(len(slots)):
                a, b, L = bounds[j], bounds[j + 1], starts[j] + lens[j]
                blk, off = writes[j]
                kp[blk, off], vp[blk, off] = k[a:b], v[a:b]
                # the sequence's K/V in position order, gathered through its table
                kc = kp[reads[j]].reshape(-1, c.n_kv_heads, c.head_dim)[:L]
                vc = vp[reads[j]].reshape(-1, c.n_kv_heads, c.head_dim)[:L]
                attn[a:b] = attention(q[a:b], kc.astype(np.float32, copy=False),
                                      vc.astype(np.float32, copy=False), pos[a:b], c.scale, window)
            o = attn @ lw.wo.T
            if lw.post_attn_norm is not None:
                o = rms_norm(o, lw.post_attn_norm, c.rms_eps)
            x = x + o
            h = rms_norm(x, lw.ffn_norm, c.rms_eps)
            d = (self.act(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T
            if lw.post_ffn_norm is not None:
                d = rms_norm(d, lw.post_ffn_norm, c.rms_eps)
            x = x + d
        last = x[bounds[1:] - 1]
        return (rms_norm(last, self.output_norm, c.rms_eps) @ self.output.T).astype(np.float32)

    def prefill(self, items: Sequence[PrefillItem]) -> np.ndarray:
        return self._forward([it.slot for it in items], [it.tokens for it in items],
                             [it.start_pos for it in items])

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        return self._forward(list(slots), [np.array([t]) for t in tokens], list(positions))

    def decode_argmax(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        return np.argmax(self.decode(slots, tokens, positions), axis=-1).astype(np.int32)

    def decode_argmax_start(self, slots: Sequence[int], tokens: Sequence[int] | None = None,
                            positions: Sequence[int] | None = None,
                            prev_rows: Sequence[int] | None = None) -> np.ndarray:
        """The protocol's started greedy step, run at once (the handle is the ids)."""
        if tokens is None or prev_rows is not None:
            if self._last_greedy is None:
                raise ValueError("decode_argmax_start without tokens continues the previous greedy step")
            prev_slots, prev_ids, prev_pos = self._last_greedy
            rows, tokens, positions = continued_inputs(prev_slots, prev_pos, slots, tokens, positions, prev_rows)
            tokens = [prev_ids[r] if r >= 0 else t for r, t in zip(rows, tokens)]
        ids = self.decode_argmax(slots, tokens, positions)
        self._last_greedy = ([int(s) for s in slots], ids.tolist(), [int(p) for p in positions])
        return ids

    def decode_argmax_finish(self, handle: np.ndarray) -> np.ndarray:
        return handle

    def decode_sample(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                      rows: Sequence[SampleRow], prepare: Callable[[], None] | None = None) -> SampleResult:
        """The step's logits sampled by the NumPy twin of the GPU's sampling kernels."""
        h = self.decode_sample_start(slots, tokens, positions)
        self.decode_sample_launch(h, rows, prepare)
        return self.decode_sample_finish(h)

    def decode_sample_start(self, slots: Sequence[int], tokens: Sequence[int] | None = None,
                            positions: Sequence[int] | None = None,
                            prev_rows: Sequence[int] | None = None) -> dict:
        """The protocol's started sampled step; the forward pass runs at once (the handle keeps
        its logits). A continuation feeds the previous step's sampled tokens, known by then."""
        prev = self._last_sampled
        if tokens is None or prev_rows is not None:
            if prev is None or prev["result"] is None:
                raise ValueError("decode_sample_start without tokens continues the previous "
                                 "sampled step, once it is launched")
            rows, tokens, positions = continued_inputs(prev["slots"], prev["positions"], slots, tokens,
                                                       positions, prev_rows)
            drawn = prev["result"].tokens
            tokens = [int(drawn[r]) if r >= 0 else t for r, t in zip(rows, tokens)]
        h = {"slots": [int(s) for s in slots], "tokens": [int(t) for t in tokens],
             "positions": [int(p) for p in positions], "result": None,
             "logits": self.decode(slots, tokens, positions)[:, :self.config.vocab_size]}
        self._last_sampled = h
        return h

    def decode_sample_launch(self, h: dict, rows: Sequence[SampleRow],
                             prepare: Callable[[], None] | None = None) -> None:
        from .sampling import sample_rows
        if len(rows) != len(h["slots"]):
            raise ValueError("one SampleRow per sequence")
        if h["result"] is not None or h is not self._last_sampled:
            raise ValueError("decode_sample_launch: the step is launched already, or another step ran since")
        if prepare is not None:
            prepare()
        counts: list[np.ndarray | None] = []
        for s, t, r in zip(h["slots"], h["tokens"], rows):
            if r.penalties:
                self._counts()[s, t] += 2     # the newest token counts from this step on
                counts.append(self.counts[s])
            else:
                counts.append(None)
        h["result"] = sample_rows(h.pop("logits"), rows, counts)

    def decode_sample_finish(self, h: dict) -> SampleResult | None:
        return h["result"]

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
        return {"graph_status": {"all": "disabled"}, "pool_bytes": 0, "device_memory_bytes": 0}

    def close(self) -> None:
        self.k_pool.clear()
        self.v_pool.clear()
