"""Tiny synthetic models, written with the real `gguf` writer (and the real `safetensors` one),
for tests that need a model file without the cost of a real one.

    m = write_gguf(tmp_path / "m.gguf", arch="qwen2", qtype=Q.Q4_K, seed=1)
    m.path, m.source["blk.0.attn_q.weight"]   # the file and the float weights it was made from

Quantization goes through `gguf.quants.quantize` where the package implements it (F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); the package has no K-quant quantizer, so Q4_K / Q5_K / Q6_K are
packed here (plain min/max scales in ggml's exact block layout; decoded by `gguf.quants`).
K-quants need rows (in_features) that are multiples of 256, the legacy quants multiples of 32.
A type neither can write (Q2_K, Q3_K, the I-quants, MXFP4) gets valid random blocks scaled to the
source's spread (`random_quant`), and `source` then holds their decoded values: a model file of
those types for backend-against-backend tests, not a codec test.

`corrupt(src, dst, kind)` writes a copy of a valid file with one deliberate defect, for the
bad-file tests; `write_hf_dir` writes the same weights as a Hugging Face checkpoint directory;
`requantize(src, dst, qtypes)` a copy of any GGUF with its tensors stored in other types.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gq
from realizar_backend.model.tokenizer import bytes_to_unicode

QK_K = 256

# ------------------------------------------------------------------ K-quant packers


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes of ggml's get_scale_min_k4 layout."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _k_affine(x: np.ndarray, qmax: int):
    """Q4_K / Q5_K: x ~ d*sc[j]*q - dmin*m[j] over 8 sub-blocks of 32, q in 0..qmax."""
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)                 # the offset is subtracted, so >= 0
    hi = sub.max(axis=-1)
    scale = (hi - lo) / qmax
    minv = -lo
    d = _f16(scale.max(axis=-1) / 63)
    dmin = _f16(minv.max(axis=-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(scale / df), 0, 63), 0)
        mn = np.where(dminf > 0, np.clip(np.round(minv / dminf), 0, 63), 0)
        eff_d = (df * sc)[..., None]
        eff_m = (dminf * mn)[..., None]
        q = np.where(eff_d > 0, np.round((sub + eff_m) / eff_d), 0)
    q = np.clip(q, 0, qmax).astype(np.uint8)
    return d, dmin, _pack_k_scales(sc, mn), q


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_affine(x, 15)
    nb = x.shape[0]
    q = q.reshape(nb, 4, 2, 32)                            # byte chunk c: sub-blocks 2c (low), 2c+1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2),
                           scales, qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_affine(x, 31)
    nb = x.shape[0]
    lo4, hi1 = q & 0x0F, q >> 4                             # (nb, 8, 32)
    lo4 = lo4.reshape(nb, 4, 2, 32)
    qs = (lo4[:, :, 0] | (lo4[:, :, 1] << 4)).reshape(nb, 128)
    qh = np.zeros((nb, 32), np.uint8)
    for j in range(8):                                      # bit j of qh[i]: sub-block j, element i
        qh |= hi1[:, j, :] << j
    return np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2),
                           scales, qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """x ~ d*scale[s]*(q-32) over 16 sub-blocks of 16, q in 0..63, int8 scales."""
    nb = x.shape[0]
    sub = x.reshape(nb, 16, 16)
    s_f = np.abs(sub).max(axis=-1) / 31
    d = _f16(s_f.max(axis=-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(s_f / df), -128, 127), 0)
        eff = (df * sc)[..., None]
        q = np.where(eff > 0, np.round(sub / eff), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, QK_K)
    lo4, hi2 = q & 0x0F, q >> 4
    # element e = h*128 + k*64 + b keeps its low nibble in ql[h*64 + b] (nibble k) ...
    lo4 = lo4.reshape(nb, 2, 2, 64)
    ql = (lo4[:, :, 0] | (lo4[:, :, 1] << 4)).reshape(nb, 128)
    # ... and e = h*128 + k*32 + b its two high bits in qh[h*32 + b] (bits 2k, 2k+1)
    hi2 = hi2.reshape(nb, 2, 4, 32)
    qh = (hi2[:, :, 0] | (hi2[:, :, 1] << 2) | (hi2[:, :, 2] << 4) | (hi2[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(nb, 2)],
                          axis=1)


_K_PACKERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 (rows, cols) -> the stored form the GGUF writer takes: float32/float16 arrays for
    F32/F16, uint8 (rows, bytes_per_row) for BF16 and block quants."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.F32:
        return x
    if qtype in _K_PACKERS:
        if x.shape[-1] % QK_K:
            raise ValueError(f"{qtype.name} needs rows that are multiples of {QK_K}, got {x.shape}")
        blocks = _K_PACKERS[qtype](x.reshape(-1, QK_K))
        return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK_K * blocks.shape[-1])
    return gq.quantize(x, qtype)


def random_quant(qtype: Q, rows: int, cols: int, std: float, rng) -> np.ndarray:
    """rows x cols of valid random blocks of `qtype` as a file stores them, their scales set so that
    the decoded weights' standard deviation is about `std` (formats.quants.random_matrix's blocks,
    every fp16 scale field times one factor; MXFP4's exponents shifted by its log2)."""
    from realizar_backend.formats.quants import SCALE_FIELDS, dequantize, random_matrix
    raw = random_matrix(qtype, rows, cols, rng)
    f = std / float(dequantize(raw, qtype, (rows, cols)).std())
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.MXFP4:
        blocks[:, 0] = np.clip(blocks[:, 0].astype(np.int64) + int(np.round(np.log2(f))), 2, 254).astype(np.uint8)
    for o in SCALE_FIELDS.get(qtype, ()):
        d = blocks[:, o:o + 2].copy().view(np.float16).astype(np.float32) * f
        blocks[:, o:o + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


# Expected worst-case |dequantized - source| per unit of the source's max |value|, per type
# (a bound a correct codec meets with margin, and a wrong layout misses by far).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1,
             Q.Q5_0: 0.07, Q.Q5_1: 0.05, Q.Q4_K: 0.12, Q.Q5_K: 0.06, Q.Q6_K: 0.04}

# ------------------------------------------------------------------ a tiny gpt2-style tokenizer

_CORPUS = ("the quick brown fox jumps over the lazy dog. hello world! this is a tiny test "
           "vocabulary for the synthetic model; it knows the, and, in, on, to, of.")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer(n_merges: int = 40, added: tuple[str, ...] = ()) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types): specials first (ids 0..2), then the 256 byte tokens, then
    one token per merge, learned greedily from a fixed sentence (deterministic), then `added`
    as user-defined tokens (matched whole in text and kept in decoded text, as Qwen's <think>)."""
    b2u = bytes_to_unicode()
    words = [[b2u[b] for b in w.encode()] for w in re.findall(r" ?\S+", _CORPUS)]
    tokens = SPECIALS + [b2u[b] for b in range(256)]
    merges: list[str] = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))   # 3 = control, 1 = normal
    return tokens + list(added), merges, types + [4] * len(added)          # 4 = user-defined


# ------------------------------------------------------------------ the model writer

ARCH_DEFAULTS = {"llama": dict(qkv_bias=False), "qwen2": dict(qkv_bias=True), "qwen3": dict(qkv_bias=False)}


@dataclass
class SynthModel:
    path: Path
    arch: str
    dims: dict[str, Any]
    source: dict[str, np.ndarray]        # float32 weights before quantization, canonical names
    qtypes: dict[str, Q]
    metadata: dict[str, Any] = field(default_factory=dict)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows -> llama.cpp's GGUF llama layout (adjacent RoPE pairs), as convert_hf_to_gguf."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_weights(arch: str = "llama", *, n_layers: int = 2, hidden: int = 256, n_heads: int = 4,
                 n_kv_heads: int = 2, head_dim: int | None = None, ffn: int = 512, vocab: int | None = None,
                 tied: bool = True, qkv_bias: bool | None = None, seed: int | None = None) -> tuple[dict, dict]:
    """Random float32 weights in canonical names and numpy (out, in) order; and the dims."""
    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // n_heads
    if vocab is None:
        vocab = len(tiny_tokenizer()[0])
    qkv_bias = ARCH_DEFAULTS[arch]["qkv_bias"] if qkv_bias is None else qkv_bias
    qd, kvd = n_heads * head_dim, n_kv_heads * head_dim

    def mat(o, i):                                     # scaled so activations stay O(1)
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
         "output_norm.weight": norm(hidden)}
    if not tied:
        w["output.weight"] = mat(vocab, hidden)
    for i in range(n_layers):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": norm(hidden), b + "attn_q.weight": mat(qd, hidden),
                  b + "attn_k.weight": mat(kvd, hidden), b + "attn_v.weight": mat(kvd, hidden),
                  b + "attn_output.weight": mat(hidden, qd), b + "ffn_norm.weight": norm(hidden),
                  b + "ffn_gate.weight": mat(ffn, hidden), b + "ffn_up.weight": mat(ffn, hidden),
                  b + "ffn_down.weight": mat(hidden, ffn)})
        if arch == "qwen3":                 # per-head RMS norms of q and k
            w.update({b + "attn_q_norm.weight": norm(head_dim), b + "attn_k_norm.weight": norm(head_dim)})
        if qkv_bias:
            w.update({b + "attn_q.bias": (0.1 * rng.standard_normal(qd)).astype(np.float32),
                      b + "attn_k.bias": (0.1 * rng.standard_normal(kvd)).astype(np.float32),
                      b + "attn_v.bias": (0.1 * rng.standard_normal(kvd)).astype(np.float32)})
    dims = dict(n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads,
                head_dim=head_dim, ffn=ffn, vocab=vocab, tied=tied, qkv_bias=qkv_bias)
    return w, dims


def write_gguf(path: str | Path, arch: str = "llama", *, qtype: Q = Q.F32,
               qtypes: dict[str, Q] | Callable[[str], Q | None] | None = None,
               version: int = 3, context_length: int = 256, rope_theta: float = 10000.0,
               rms_eps: float = 1e-5, weights: dict[str, np.ndarray] | None = None,
               extra_metadata: dict[str, Any] | None = None, skip_metadata: tuple[str, ...] = (),
               drop_tensors: tuple[str, ...] = (), tokenizer: bool = True, name: str = "synth",
               added_tokens: tuple[str, ...] = (), **dims) -> SynthModel:
    """Write a tiny model. `qtype` applies to every 2-D weight; `qtypes` overrides it per tensor
    (a dict, or a function returning a type or None); 1-D tensors (norms, biases) stay F32 unless
    named in `qtypes`. `weights`/`dims` come from `make_weights` (pass `seed` for repeatability).
    `extra_metadata` adds or replaces keys (a (value, GGUFValueType) pair forces a type);
    `skip_metadata` leaves keys out; `drop_tensors` leaves tensors out; `added_tokens` extends the
    tiny tokenizer with user-defined tokens (and the vocabulary with rows for them)."""
    path = Path(path)
    if weights is None:
        if added_tokens and "vocab" not in dims:
            dims["vocab"] = len(tiny_tokenizer(added=added_tokens)[0])
        weights, dims = make_weights(arch, **dims)
    else:
        weights, dims = dict(weights), dict(dims)
    d = dims
    # GGUFWriter writes general.architecture itself; a test may ask for another value
    w = GGUFWriter(str(path), (extra_metadata or {}).get("general.architecture", arch))
    # every other key goes through `kv`, so tests can replace or remove any of them
    kv: dict[str, Any] = {
        "general.name": name,
        f"{arch}.block_count": (d["n_layers"], GGUFValueType.UINT32),
        f"{arch}.context_length": (context_length, GGUFValueType.UINT32),
        f"{arch}.embedding_length": (d["hidden"], GGUFValueType.UINT32),
        f"{arch}.feed_forward_length": (d["ffn"], GGUFValueType.UINT32),
        f"{arch}.attention.head_count": (d["n_heads"], GGUFValueType.UINT32),
        f"{arch}.attention.head_count_kv": (d["n_kv_heads"], GGUFValueType.UINT32),
        f"{arch}.attention.key_length": (d["head_dim"], GGUFValueType.UINT32),
        f"{arch}.rope.dimension_count": (d["head_dim"], GGUFValueType.UINT32),
        f"{arch}.rope.freq_base": (rope_theta, GGUFValueType.FLOAT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (rms_eps, GGUFValueType.FLOAT32),
        "general.file_type": (1, GGUFValueType.UINT32),
    }
    if tokenizer:
        tokens, merges, types = tiny_tokenizer(added=added_tokens)
        if len(tokens) != d["vocab"]:
            raise ValueError(f"the tiny tokenizer has {len(tokens)} tokens but vocab is {d['vocab']}")
        kv.update({
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": (types, GGUFValueType.INT32),
            "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32),
            "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32),
            "tokenizer.ggml.padding_token_id": (0, GGUFValueType.UINT32),
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": CHAT_TEMPLATE,
        })
    else:
        kv[f"{arch}.vocab_size"] = (d["vocab"], GGUFValueType.UINT32)
    kv.update({k: v for k, v in (extra_metadata or {}).items() if k != "general.architecture"})
    for k in skip_metadata:
        kv.pop(k, None)
    for key, val in kv.items():
        val, vtype = val if isinstance(val, tuple) else (val, None)
        if vtype is None:
            w.add_key_value(key, val, _infer_type(val), _infer_sub(val))
        elif vtype == GGUFValueType.ARRAY or isinstance(val, list):
            w.add_key_value(key, val, GGUFValueType.ARRAY, vtype if isinstance(val, list) else None)
        else:
            w.add_key_value(key, val, vtype)

    chosen: dict[str, Q] = {}
    for tname, arr in weights.items():
        if tname in drop_tensors:
            continue
        t = None
        if callable(qtypes):
            t = qtypes(tname)
        elif qtypes:
            t = qtypes.get(tname)
        if t is None:
            t = qtype if arr.ndim == 2 else Q.F32
        chosen[tname] = t
        if t in TOLERANCE:
            stored = quantize(arr, t)
        else:                             # no quantizer: random blocks, and the source they decode to
            rows = int(np.prod(arr.shape[:-1]))        # stacked experts [n, rows, cols]: n * rows rows
            stored = random_quant(t, rows, arr.shape[-1], float(arr.std()),
                                  np.random.default_rng(zlib.crc32(tname.encode())))
            stored = stored.reshape(*arr.shape[:-1], -1)
            weights[tname] = gq.dequantize(stored, t).reshape(arr.shape).astype(np.float32)
        w.add_tensor(tname, stored, raw_dtype=None if t in (Q.F32, Q.F16) else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version != 3:                     # v2 differs from v3 only in its version number
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(struct.pack("<I", version))
    return SynthModel(path, arch, dims, weights, chosen, kv)


def requantize(src: str | Path, dst: str | Path, qtypes: Callable[[str, tuple[int, ...]], Q | None]) -> Path:
    """Copy the GGUF `src` (every metadata key as it is) to `dst` with each tensor stored as the type
    qtypes(name, shape) gives (shape in NumPy order; None: as it is): the float weights of a model
    written elsewhere (tests/support/hf_oracle.py), quantized as `quantize` does."""
    from realizar_backend.formats.quants import dequantize
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        want = qtypes(t.name, shape)
        if want is None or want == t.tensor_type:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=shape if t.tensor_type not in (Q.F32, Q.F16) else None,
                         raw_dtype=None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type)
            continue
        x = dequantize(np.asarray(t.data), t.tensor_type, shape).astype(np.float32)
        w.add_tensor(t.name, quantize(x, want), raw_dtype=None if want in (Q.F32, Q.F16) else want)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def _infer_type(val) -> GGUFValueType:
    if isinstance(val, list):
        return GGUFValueType.ARRAY
    if isinstance(val, bool):
        return GGUFValueType.BOOL
    if isinstance(val, int):
        return GGUFValueType.UINT32
    if isinstance(val, float):
        return GGUFValueType.FLOAT32
    return GGUFValueType.STRING


def _infer_sub(val) -> GGUFValueType | None:
    return _infer_type(val[0]) if isinstance(val, list) and val else None


# ------------------------------------------------------------------ deliberate corruption


def _layout(path: Path) -> dict[str, Any]:
    """Byte offsets of header fields, found with the reference reader on the valid file."""
    r = GGUFReader(path)
    out: dict[str, Any] = {"data_start": r.data_offset, "kv": {}, "tensors": {}}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        # key: u64 len + bytes, then u32 value type, then the value
        val_at = f.offset + 8 + len(name.encode()) + 4
        out["kv"][name] = val_at
    for t in r.tensors:
        f = t.field
        n_dims_at = f.offset + 8 + len(t.name.encode())
        out["tensors"][t.name] = dict(n_dims=n_dims_at, dims=n_dims_at + 4,
                                      type=n_dims_at + 4 + 8 * len(t.shape),
                                      offset=n_dims_at + 4 + 8 * len(t.shape) + 4,
                                      data=t.data_offset, nbytes=t.n_bytes)
    return out


CORRUPTIONS = (
    "empty", "magic", "version1", "version99", "big_endian", "truncate_header", "truncate_data",
    "tensor_offset_past_end", "tensor_offset_misaligned", "tensor_type_unknown", "tensor_type_unsupported",
    "kv_count_huge", "tensor_count_huge", "array_len_huge", "string_len_huge", "n_dims_huge",
    "value_type_unknown", "overlapping_tensors",
)


def corrupt(src: str | Path, dst: str | Path, kind: str) -> Path:
    """Copy the valid GGUF `src` to `dst` with one defect (see CORRUPTIONS), or with one tensor's
    type changed to one only the NumPy backend runs ("tensor_type_cpu_only": a valid file)."""
    src, dst = Path(src), Path(dst)
    data = bytearray(src.read_bytes())
    lay = _layout(src)
    first = next(iter(lay["tensors"].values()))
    last = max(lay["tensors"].values(), key=lambda t: t["data"])

    def put(fmt: str, at: int, v: int) -> None:
        struct.pack_into(fmt, data, at, v)

    if kind == "empty":
        data = bytearray()
    elif kind == "magic":
        data[0:4] = b"GGUX"
    elif kind == "version1":
        put("<I", 4, 1)
    elif kind == "version99":
        put("<I", 4, 99)
    elif kind == "big_endian":
        put(">I", 4, 3)
    elif kind == "truncate_header":                  # cut inside the metadata
        data = data[:lay["kv"]["tokenizer.ggml.tokens"] + 100]
    elif kind == "truncate_data":                    # cut inside the last tensor's bytes
        data = data[:last["data"] + last["nbytes"] // 2]
    elif kind == "tensor_offset_past_end":
        put("<Q", first["offset"], len(data))
    elif kind == "tensor_offset_misaligned":
        put("<Q", first["offset"], struct.unpack_from("<Q", data, first["offset"])[0] + 1)
    elif kind == "tensor_type_unknown":
        put("<I", first["type"], 250)
    elif kind == "tensor_type_unsupported":          # a real type whose blocks fit in Q4_K's bytes
        t = lay["tensors"]["blk.0.ffn_up.weight"]
        put("<I", t["type"], int(Q.TQ2_0))
    elif kind == "tensor_type_cpu_only":             # a type the NumPy backend decodes and the GPU does not
        t = lay["tensors"]["blk.0.ffn_up.weight"]
        put("<I", t["type"], int(Q.IQ1_S))
    elif kind == "kv_count_huge":
        put("<Q", 16, 2 ** 60)
    elif kind == "tensor_count_huge":
        put("<Q", 8, 2 ** 60)
    elif kind == "array_len_huge":                   # token_type: an INT32 array
        put("<Q", lay["kv"]["tokenizer.ggml.token_type"] + 4, 2 ** 60)
    elif kind == "string_len_huge":
        put("<Q", lay["kv"]["general.name"], 2 ** 60)
    elif kind == "n_dims_huge":
        put("<I", first["n_dims"], 9)
    elif kind == "value_type_unknown":
        put("<I", lay["kv"]["general.name"] - 4, 77)
    elif kind == "overlapping_tensors":              # two tensors share their first bytes
        second = sorted(lay["tensors"].values(), key=lambda t: t["data"])[1]
        put("<Q", second["offset"], first["data"] - lay["data_start"])
    else:
        raise ValueError(f"unknown corruption {kind!r}; known: {CORRUPTIONS}")
    dst.write_bytes(bytes(data))
    return dst


# ------------------------------------------------------------------ Hugging Face directories

CANONICAL_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def hf_name(canonical: str) -> str:
    m = re.match(r"blk\.(\d+)\.(.+)", canonical)
    if m:
        return f"model.layers.{m.group(1)}.{CANONICAL_TO_HF[m.group(2)]}"
    return CANONICAL_TO_HF[canonical]


def hf_weights(m: SynthModel) -> dict[str, np.ndarray]:
    """The synthetic weights as an HF checkpoint holds them: HF names, llama q/k un-permuted
    (GGUF llama stores them permuted for adjacent-pair RoPE; HF rotates halves)."""
    d, out = m.dims, {}
    for name, arr in m.source.items():
        if m.arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = unpermute_qk(arr, d["n_heads"])
        elif m.arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = unpermute_qk(arr, d["n_kv_heads"])
        out[hf_name(name)] = arr
    return out


def hf_config(m: SynthModel, rope_theta: float = 10000.0, rms_eps: float = 1e-5,
              context_length: int = 256) -> dict[str, Any]:
    d = m.dims
    arch, model_type = HF_ARCH[m.arch]
    return {"architectures": [arch], "model_type": model_type, "hidden_size": d["hidden"],
            "num_attention_heads": d["n_heads"], "num_key_value_heads": d["n_kv_heads"],
            "head_dim": d["head_dim"], "num_hidden_layers": d["n_layers"], "intermediate_size": d["ffn"],
            "vocab_size": d["vocab"], "max_position_embeddings": context_length, "rms_norm_eps": rms_eps,
            "rope_theta": rope_theta, "tie_word_embeddings": d["tied"], "bos_token_id": 1,
            "eos_token_id": 2, "_name_or_path": "synth-hf", "torch_dtype": "float32"}


def write_safetensors_raw(path: str | Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                          metadata: dict[str, str] | None = None) -> Path:
    """The safetensors layout written directly (8-byte header length, JSON header, data), for
    dtypes numpy cannot express (BF16) and for deliberately odd files."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    blobs, off = [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path = Path(path)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return path


def _bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, round to nearest even (as torch does)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).tobytes()


def write_hf_dir(directory: str | Path, m: SynthModel, *, dtype: str = "F32", shards: int = 1,
                 tokenizer: bool = True, config_overrides: dict[str, Any] | None = None) -> Path:
    """Write `m` as a transformers `save_pretrained` directory: config.json, model.safetensors or
    `shards` shards + model.safetensors.index.json, tokenizer.json + tokenizer_config.json."""
    from safetensors.numpy import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(m)
    cfg.update(config_overrides or {})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = hf_weights(m)
    names = list(weights)
    groups = [names[i::shards] for i in range(shards)]
    files = ["model.safetensors"] if shards == 1 else \
        [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for fname, group in zip(files, groups):
        if dtype == "BF16":
            write_safetensors_raw(directory / fname,
                                  {n: ("BF16", weights[n].shape, _bf16_bytes(weights[n])) for n in group})
        else:
            np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
            save_file({n: weights[n].astype(np_dtype) for n in group}, str(directory / fname),
                      metadata={"format": "pt"})
    if shards > 1:
        index = {"metadata": {"total_size": sum(a.nbytes for a in weights.values())},
                 "weight_map": {n: f for f, g in zip(files, groups) for n in g}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer:
        write_hf_tokenizer(directory)
    return directory


def write_hf_tokenizer(directory: Path) -> None:
    tokens, merges, _ = tiny_tokenizer()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "tokenizer_class": "GPT2Tokenizer",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 256}))
