"""ModelConfig: the numbers a forward pass needs, read from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelFormatError, UnsupportedModelError
from .arch import ARCHITECTURES, HF_ARCHITECTURES, supported_list


@dataclass(frozen=True)
class ModelConfig:
    arch: str                    # canonical: llama | qwen2 | qwen3 | gemma3
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int          # what the model was trained for
    rms_eps: float
    rope_theta: float
    rope_style: str              # "normal" (adjacent pairs, GGUF llama) | "neox" (halves)
    rope_dim: int                # dims rotated per head (== head_dim for every supported model)
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # gemma3 only
    activation: str = "silu"     # silu | gelu_tanh
    embed_scale: float = 1.0     # gemma multiplies embeddings by sqrt(hidden)
    post_norms: bool = False     # gemma: norms after attention and FFN outputs
    sliding_window: int = 0      # 0 = full attention everywhere
    sliding_pattern: int = 0     # every Nth layer is global (gemma3: 6); 0 = none sliding
    rope_theta_local: float = 0.0
    attn_scale: float = 0.0      # 0 = 1/sqrt(head_dim)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window and self.sliding_pattern
                    and (layer + 1) % self.sliding_pattern != 0)

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta_local if self.is_sliding(layer) and self.rope_theta_local else self.rope_theta

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5


def _req(path, md: dict, key: str):
    if key not in md:
        raise ModelFormatError(path, f"missing required metadata key {key!r}")
    return md[key]


def _number(path, key: str, value, kind):
    """A metadata value that must be a number; bools and strings are format errors."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ModelFormatError(path, f"metadata key {key!r} should be {'an integer' if kind is int else 'a number'}, "
                                     f"got {type(value).__name__} {str(value)[:40]!r}")
    return kind(value)


def _check_dims(path, c: dict[str, Any]) -> None:
    """Self-consistency of the numbers (the tensor shapes are checked by the format loaders)."""
    dims = {k: c[k] for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size")}
    bad = [k for k, v in dims.items() if v <= 0]
    if bad or c["n_heads"] % c["n_kv_heads"]:
        raise ModelFormatError(path, "inconsistent dimensions: " + " ".join(f"{k}={v}" for k, v in dims.items()))
    if c["rope_dim"] <= 0 or c["rope_dim"] % 2 or c["rope_dim"] > c["head_dim"]:
        raise ModelFormatError(path, f"rope dimension {c['rope_dim']} must be even and at most head_dim {c['head_dim']}")
    if not (c["rms_eps"] > 0 and c["rope_theta"] > 0 and c["context_length"] > 0):
        raise ModelFormatError(path, f"rms_eps={c['rms_eps']}, rope_theta={c['rope_theta']} and "
                                     f"context_length={c['context_length']} must all be positive")


def config_from_gguf(path, md: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelFormatError(path, "missing required metadata key 'general.architecture'")
    if not isinstance(arch, str):
        raise ModelFormatError(path, f"general.architecture should be a string, got {arch!r:.40}")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(path, f"architecture {arch!r} is not supported; supported: {supported_list()}")
    spec = ARCHITECTURES[arch]

    def get(k, default=None, required=True, kind=int):
        key = f"{arch}.{k}"
        if key in md:
            return _number(path, key, md[key], kind)
        if required and default is None:
            raise ModelFormatError(path, f"missing required metadata key {key!r}")
        return default

    hidden = get("embedding_length")
    n_heads = get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    head_dim = get("attention.key_length", hidden // max(n_heads, 1))
    n_layers = get("block_count")
    if "tokenizer.ggml.tokens" in md:
        tokens = md["tokenizer.ggml.tokens"]
        if not isinstance(tokens, list):
            raise ModelFormatError(path, "tokenizer.ggml.tokens should be an array of strings")
        vocab = len(tokens)
    else:
        vocab = get("vocab_size")
    cfg = dict(
        arch=arch, n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, ffn_dim=get("feed_forward_length"), vocab_size=vocab,
        context_length=get("context_length", 2048, required=False),
        rms_eps=get("attention.layer_norm_rms_epsilon", 1e-6, required=False, kind=float),
        rope_theta=get("rope.freq_base", 10000.0, required=False, kind=float),
        rope_style=spec.gguf_rope_style,
        rope_dim=get("rope.dimension_count", head_dim, required=False),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )
    _check_dims(path, cfg)
    if arch == "gemma3":
        cfg.update(activation="gelu_tanh", embed_scale=hidden ** 0.5, post_norms=True,
                   sliding_window=get("attention.sliding_window", 0, required=False),
                   sliding_pattern=6, rope_theta_local=10000.0)
    return ModelConfig(**cfg)


def _hf_rope_theta(path, hf: dict[str, Any]) -> float:
    # transformers < 5 writes rope_theta (+ rope_scaling); 5.x writes rope_parameters
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ModelFormatError(path, f"config.json: rope parameters should be an object, got {rp!r:.60}")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in (None, "default"):
        raise UnsupportedModelError(path, f"RoPE scaling {kind!r} is not supported")
    return hf.get("rope_theta") or rp.get("rope_theta") or 10000.0


def config_from_hf(path, hf: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        mt = hf.get("model_type")
        arch = mt if mt in ARCHITECTURES else None
    if arch is None:
        raise UnsupportedModelError(path, f"architecture {archs or hf.get('model_type')!r} is not supported; "
                                          f"supported: {supported_list()}")
    try:
        hidden = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        n_kv = int(hf.get("num_key_value_heads") or n_heads)
        head_dim = int(hf.get("head_dim") or hidden // n_heads)
        cfg = dict(
            arch=arch, n_layers=int(hf["num_hidden_layers"]), hidden=hidden, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            context_length=int(hf.get("max_position_embeddings", 2048)),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_hf_rope_theta(path, hf)),
            rope_style="neox",  # HF checkpoints keep q/k un-permuted: rotate halves
            rope_dim=head_dim,
            tie_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFormatError(path, f"config.json lacks or garbles a required field: {e}") from None
    _check_dims(path, cfg)
    if arch == "gemma3":
        cfg.update(activation="gelu_tanh", embed_scale=hidden ** 0.5, post_norms=True,
                   sliding_window=int(hf.get("sliding_window") or 0),
                   sliding_pattern=int(hf.get("sliding_window_pattern") or 6),
                   rope_theta_local=float(hf.get("rope_local_base_freq", 10000.0)),
                   attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5)
    return ModelConfig(**cfg)
