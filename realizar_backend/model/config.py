"""ModelConfig: the numbers a forward pass needs, read from GGUF metadata or config.json."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelFormatError, UnsupportedModelError
from .arch import ARCHITECTURES, HF_ARCHITECTURES, supported_list
from .metadata import Metadata


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched past the trained context, as GGUF metadata (llama.cpp) or
    config.json (transformers) describe it; backends/cpu.py rope_frequencies applies it.
    kind: "linear" (every frequency / factor), "yarn" (frequencies ramped between interpolated and
    original by wavelength, cos/sin scaled by mscale), "llama3" (wavelength bands, transformers'
    rope_type "llama3") or "none" (freq_factors only: a GGUF llama3 model carries its bands as the
    rope_freqs tensor, per-pair divisors)."""
    kind: str
    factor: float = 1.0
    original_context: int = 0        # yarn, llama3: the context the model was trained at
    ext_factor: float = 1.0          # yarn: weight of the extrapolation ramp (llama.cpp's ext_factor)
    beta_fast: float = 32.0          # yarn: ramp corners, in rotations over original_context
    beta_slow: float = 1.0
    truncate: bool = True            # yarn: round the ramp corners to whole dims (transformers' default)
    mscale: float = 1.0              # cos and sin multiplied by it (yarn's attention factor)
    low_freq_factor: float = 1.0     # llama3
    high_freq_factor: float = 4.0
    freq_factors: tuple[float, ...] | None = None

    def describe(self) -> str:
        if self.kind == "none":
            return "per-frequency factors (rope_freqs)"
        extra = f", trained context {self.original_context}" if self.original_context else ""
        return f"{self.kind} x{self.factor:g}{extra}"


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
    activation: str = "silu"     # silu | gelu_tanh | swiglu_oai (gpt-oss: clamped, math.swiglu_oai)
    embed_scale: float = 1.0     # gemma multiplies embeddings by sqrt(hidden)
    post_norms: bool = False     # gemma: norms after attention and FFN outputs
    sliding_window: int = 0      # 0 = full attention everywhere
    sliding_pattern: int = 0     # every Nth layer is global (gemma3: 6); 0 = none sliding
    rope_theta_local: float = 0.0
    attn_scale: float = 0.0      # 0 = 1/sqrt(head_dim)
    rope_scaling: RopeScaling | None = None
    # mixture of experts (qwen3moe): n_experts per layer, n_experts_used per token, each expert's
    # FFN width; the chosen experts' probabilities renormalised to sum to one
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    expert_renormalize: bool = True
    shared_expert_ffn_dim: int = 0   # qwen35moe: a shared expert beside the routed ones (0: none)
    # linear-attention hybrids (qwen35): which layers are Gated DeltaNet (the rest full attention),
    # and the DeltaNet's dims: conv kernel, key heads and their dim, value heads and their dim
    recurrent: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_k_heads: int = 0
    ssm_k_dim: int = 0
    ssm_v_heads: int = 0
    ssm_v_dim: int = 0
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

    def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
        """gemma3's sliding layers keep plain RoPE at their local base (transformers and llama.cpp
        scale the global layers only)."""
        return None if self.is_sliding(layer) and self.rope_theta_local else self.rope_scaling

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent) and self.recurrent[layer]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K and V, in order: every layer but a hybrid's recurrent ones. A
        backend's KV storage holds these alone; layer kv_layers[i] is its i-th."""
        return tuple(li for li in range(self.n_layers) if not self.is_recurrent(li))

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one position takes in a KV cache of `itemsize`-byte elements: K and V of every
        layer that keeps them."""
        return 2 * len(self.kv_layers) * self.n_kv_heads * self.head_dim * itemsize

    @property
    def has_recurrent_state(self) -> bool:
        """Some layer keeps a per-sequence recurrent state (a hybrid): a prefix's KV blocks alone
        cannot resume a sequence."""
        return any(self.recurrent)

    @property
    def recurrent_state_bytes(self) -> int:
        """A sequence's recurrent state (float32): per recurrent layer the conv inputs kept
        (kernel - 1 rows of the mixed q|k|v channels) and the DeltaNet state of every value head."""
        channels = 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim
        per_layer = (self.ssm_conv_kernel - 1) * channels + self.ssm_v_heads * self.ssm_k_dim * self.ssm_v_dim
        return 4 * per_layer * sum(self.recurrent)

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5


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


MAX_DIM = 1 << 20            # hidden, FFN and head sizes: far above any real model, far below 2**63
MAX_CONTEXT = (1 << 31) - 1  # positions are int32 on every backend
MAX_EXPERTS = 1 << 12        # experts per layer (real models: up to 512)
GEMMA3_27B_LAYERS = 62       # llama.cpp tells Gemma 3 27B by its layer count


def _gguf_rope_scaling(path, m: Metadata, a: str, context_length: int, rope_dim: int, rope_freqs) -> RopeScaling | None:
    """llama.cpp's keys: {arch}.rope.scaling.type (none | linear | yarn), .factor (or the older
    {arch}.rope.scale_linear), .original_context_length, .attn_factor, .yarn_ext_factor,
    .yarn_attn_factor, .yarn_beta_fast, .yarn_beta_slow; and the rope_freqs tensor (per-pair divisors)."""
    key = a + "rope.scaling.type"
    kind = m.string(key, None)
    factor = m.number(a + "rope.scaling.factor", 0.0) or m.number(a + "rope.scale_linear", 0.0)
    if kind is None:
        kind = "linear" if factor and factor != 1.0 else "none"
    freqs = None
    if rope_freqs is not None:
        arr = [float(x) for x in rope_freqs.reshape(-1)]
        if len(arr) != rope_dim // 2 or not all(x > 0 and math.isfinite(x) for x in arr):
            raise ModelFormatError(path, f"rope_freqs.weight should hold {rope_dim // 2} positive factors "
                                         f"(rope dimension {rope_dim}), got {len(arr)} values")
        freqs = tuple(arr)
    if kind == "none":
        return RopeScaling("none", freq_factors=freqs) if freqs else None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(path, f"RoPE scaling {kind!r} ({key}) is not supported; supported: linear, yarn")
    if not factor or factor <= 0:
        raise ModelFormatError(path, f"RoPE scaling {kind!r} needs a positive {a}rope.scaling.factor")
    if kind == "linear":
        return RopeScaling("linear", factor=factor, freq_factors=freqs)
    if m.number(a + "rope.scaling.yarn_log_multiplier", 0.0):
        raise UnsupportedModelError(path, "YaRN with a log multiplier (rope.scaling.yarn_log_multiplier) "
                                          "is not supported")
    ext = m.number(a + "rope.scaling.yarn_ext_factor", 1.0)
    # llama.cpp: cos/sin times yarn_attn_factor * attn_factor * (1 + 0.1 ln factor) when the ramp is on
    attn = m.number(a + "rope.scaling.yarn_attn_factor", 1.0) * m.number(a + "rope.scaling.attn_factor", 1.0)
    return RopeScaling("yarn", factor=factor,
                       original_context=m.integer(a + "rope.scaling.original_context_length", context_length,
                                                  lo=1, hi=MAX_CONTEXT),
                       ext_factor=ext, beta_fast=m.number(a + "rope.scaling.yarn_beta_fast", 32.0),
                       beta_slow=m.number(a + "rope.scaling.yarn_beta_slow", 1.0),
                       mscale=attn * (_yarn_mscale(factor) if ext else 1.0), freq_factors=freqs)


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def config_from_gguf(path, md: dict[str, Any], tensor_names: set[str], rope_freqs=None) -> ModelConfig:
    """rope_freqs: the data of the rope_freqs.weight tensor, when the file has one."""
    m = Metadata(path, md)
    arch = m.string("general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(path, f"architecture {arch!r} is not supported; supported: {supported_list()}")
    spec = ARCHITECTURES[arch]
    a = arch + "."

    hidden = m.integer(a + "embedding_length", required=True, lo=1, hi=MAX_DIM)
    n_heads = m.integer(a + "attention.head_count", required=True, lo=1, hi=hidden)
    n_kv = m.integer(a + "attention.head_count_kv", n_heads, lo=1, hi=n_heads)
    head_dim = m.integer(a + "attention.key_length", hidden // n_heads, lo=1, hi=MAX_DIM)
    n_layers = m.integer(a + "block_count", required=True, lo=1)
    if "tokenizer.ggml.tokens" in m:
        vocab = len(m.strings("tokenizer.ggml.tokens", nonempty=True))
    else:
        vocab = m.integer(a + "vocab_size", required=True, lo=1, hi=MAX_DIM * 16)
    # A mixture of experts whose every layer is routed (Qwen3.5/3.6-MoE) may have no dense
    # feed_forward_length: its FFN width is then its widest expert's (routed or shared), which is
    # what the buffers sized by ffn_dim hold.
    ffn_default = None
    if spec.experts and a + "feed_forward_length" not in m:
        ffn_default = max(m.integer(a + "expert_feed_forward_length", required=True, lo=1, hi=MAX_DIM * 4),
                          m.integer(a + "expert_shared_feed_forward_length", 0, lo=0, hi=MAX_DIM * 4))
    cfg = dict(
        arch=arch, n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, ffn_dim=m.integer(a + "feed_forward_length", ffn_default, required=ffn_default is None,
                                             lo=1, hi=MAX_DIM * 4),
        vocab_size=vocab,
        context_length=m.integer(a + "context_length", 2048, lo=1, hi=MAX_CONTEXT),
        rms_eps=m.number(a + "attention.layer_norm_rms_epsilon", 1e-6, positive=True),
        rope_theta=m.number(a + "rope.freq_base", 10000.0, positive=True),
        rope_style=spec.gguf_rope_style,
        rope_dim=m.integer(a + "rope.dimension_count", head_dim, lo=1, hi=head_dim),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )
    _check_dims(path, cfg)
    cfg["rope_scaling"] = _gguf_rope_scaling(path, m, a, cfg["context_length"], cfg["rope_dim"], rope_freqs)
    if arch == "gemma3":
        # As llama.cpp reads a Gemma 3 file: the sliding layers' RoPE base from rope.freq_base_swa
        # (10000 when absent), every 6th layer global, and the attention scale from the shape (GGUF
        # has no query_pre_attn_scalar): 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B
        # model, whose scalar (168) is not its head_dim (128).
        cfg.update(activation="gelu_tanh", embed_scale=hidden ** 0.5, post_norms=True,
                   sliding_window=m.integer(a + "attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT),
                   sliding_pattern=6,
                   rope_theta_local=m.number(a + "rope.freq_base_swa", 10000.0, positive=True),
                   attn_scale=(hidden / n_heads) ** -0.5 if n_layers == GEMMA3_27B_LAYERS else 0.0)
    if arch == "gpt-oss":
        # layers alternate sliding (even) and full attention; YaRN on every layer with its ramp
        # corners unrounded (the model's config, transformers' truncate=False); a feed-forward of
        # experts with the clamped SwiGLU. None of these is in the GGUF metadata.
        rs = cfg["rope_scaling"]
        cfg.update(activation="swiglu_oai", sliding_pattern=2,
                   sliding_window=m.integer(a + "attention.sliding_window", required=True, lo=1, hi=MAX_CONTEXT),
                   rope_scaling=dataclasses.replace(rs, truncate=False) if rs and rs.kind == "yarn" else rs)
    if spec.recurrent:
        flags = m.booleans(a + "attention.recurrent_layers", length=n_layers)
        if flags is not None:
            recurrent = tuple(flags)
        else:
            every = m.integer(a + "full_attention_interval", required=True, lo=1, hi=n_layers)
            recurrent = tuple((i + 1) % every != 0 for i in range(n_layers))
        v_heads = m.integer(a + "ssm.time_step_rank", required=True, lo=1, hi=MAX_DIM)
        k_heads = m.integer(a + "ssm.group_count", required=True, lo=1, hi=v_heads)
        inner = m.integer(a + "ssm.inner_size", required=True, lo=v_heads, hi=MAX_DIM)
        if v_heads % k_heads or inner % v_heads:
            raise ModelFormatError(path, f"{a}ssm: {v_heads} value heads over {k_heads} key heads, inner size {inner}")
        cfg.update(recurrent=recurrent, ssm_conv_kernel=m.integer(a + "ssm.conv_kernel", required=True, lo=1, hi=64),
                   ssm_k_heads=k_heads, ssm_k_dim=m.integer(a + "ssm.state_size", required=True, lo=1, hi=MAX_DIM),
                   ssm_v_heads=v_heads, ssm_v_dim=inner // v_heads)
    if spec.experts:
        n = m.integer(a + "expert_count", required=True, lo=1, hi=MAX_EXPERTS)
        # the routers of qwen3moe and gpt-oss renormalise their top k (llama.cpp's norm_w; gpt-oss's
        # softmax over the top k logits is the same thing)
        cfg.update(n_experts=n, n_experts_used=m.integer(a + "expert_used_count", required=True, lo=1, hi=n),
                   expert_ffn_dim=m.integer(a + "expert_feed_forward_length", required=True, lo=1, hi=MAX_DIM * 4),
                   expert_renormalize=m.boolean(a + "expert_weights_norm", True),
                   shared_expert_ffn_dim=m.integer(a + "expert_shared_feed_forward_length", 0, lo=0, hi=MAX_DIM * 4))
    return ModelConfig(**cfg)


def _hf_rope(path, hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from config.json: transformers < 5 writes rope_theta and rope_scaling, 5.x
    rope_parameters; the scaling fields are those of transformers' rope init functions."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ModelFormatError(path, f"config.json: rope parameters should be an object, got {rp!r:.60}")
    theta = hf.get("rope_theta") or rp.get("rope_theta") or 10000.0
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "yarn", "llama3"):
        raise UnsupportedModelError(path, f"RoPE scaling {kind!r} is not supported; supported: linear, yarn, llama3")
    try:
        factor = float(rp["factor"])
        if not factor > 0:
            raise ValueError
        if kind == "linear":
            return theta, RopeScaling("linear", factor=factor)
        orig = int(rp.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 0)
        if orig <= 0:
            raise ValueError
        if kind == "llama3":
            return theta, RopeScaling("llama3", factor=factor, original_context=orig,
                                      low_freq_factor=float(rp["low_freq_factor"]),
                                      high_freq_factor=float(rp["high_freq_factor"]))
        att = rp.get("attention_factor")
        if att is None:
            m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
            att = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
        return theta, RopeScaling("yarn", factor=factor, original_context=orig, mscale=float(att),
                                  beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
                                  truncate=bool(rp.get("truncate", True)))
    except (KeyError, TypeError, ValueError):
        raise ModelFormatError(path, f"config.json: RoPE scaling {kind!r} with missing or bad fields: {rp!r:.200}") \
            from None


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
        theta, scaling = _hf_rope(path, hf)
        cfg = dict(
            arch=arch, n_layers=int(hf["num_hidden_layers"]), hidden=hidden, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            context_length=int(hf.get("max_position_embeddings", 2048)),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
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
