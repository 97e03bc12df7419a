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


def config_from_gguf(path, md: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelFormatError(path, "missing required metadata key 'general.architecture'")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(path, f"architecture {arch!r} is not supported; supported: {supported_list()}")
    spec = ARCHITECTURES[arch]

    def get(k, default=None, required=True):
        key = f"{arch}.{k}"
        if key in md:
            return md[key]
        if required and default is None:
            raise ModelFormatError(path, f"missing required metadata key {key!r}")
        return default

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", hidden // max(n_heads, 1)))
    n_layers = int(get("block_count"))
    if "tokenizer.ggml.tokens" in md:
        vocab = len(md["tokenizer.ggml.tokens"])
    else:
        vocab = int(get("vocab_size"))
    if min(hidden, n_heads, n_kv, head_dim, n_layers, vocab) <= 0 or n_heads % n_kv:
        raise ModelFormatError(path, f"inconsistent dimensions: hidden={hidden} heads={n_heads} "
                                     f"kv_heads={n_kv} head_dim={head_dim} layers={n_layers}")
    cfg = dict(
        arch=arch, n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, ffn_dim=int(get("feed_forward_length")), vocab_size=vocab,
        context_length=int(get("context_length", 2048, required=False)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
        rope_theta=float(get("rope.freq_base", 10000.0, required=False)),
        rope_style=spec.gguf_rope_style,
        rope_dim=int(get("rope.dimension_count", head_dim, required=False)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )
    if arch == "gemma3":
        cfg.update(activation="gelu_tanh", embed_scale=hidden ** 0.5, post_norms=True,
                   sliding_window=int(get("attention.sliding_window", 0, required=False)),
                   sliding_pattern=6, rope_theta_local=10000.0)
    return ModelConfig(**cfg)


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
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_style="neox",  # HF checkpoints keep q/k un-permuted: rotate halves
            rope_dim=head_dim,
            tie_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(path, f"config.json lacks or garbles a required field: {e}") from None
    if arch == "gemma3":
        cfg.update(activation="gelu_tanh", embed_scale=hidden ** 0.5, post_norms=True,
                   sliding_window=int(hf.get("sliding_window") or 0),
                   sliding_pattern=int(hf.get("sliding_window_pattern") or 6),
                   rope_theta_local=float(hf.get("rope_local_base_freq", 10000.0)),
                   attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5)
    return ModelConfig(**cfg)
