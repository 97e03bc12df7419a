"""The dense transformer: llama (Llama, Mistral, SmolLM2), qwen2 (QKV bias), qwen3 (q/k norms) and
gemma3 (q/k norms, post-norms, sliding-window layers, GELU, scaled embeddings), one definition
whose optional tensors are the differences between them.

    x = embed(tokens) * embed_scale
    per layer:  q, k, v = linear(RMSNorm(x))  ->  (q/k norm)  ->  attention (RoPE, KV cache)
                x = x + (post-norm) o-projection
                x = x + (post-norm) down(act(gate(RMSNorm(x))) * up(RMSNorm(x)))
    logits = RMSNorm(x) @ output.T

Weights are whatever the backend keeps (NumPy arrays, device pointers): `load` asks the backend's
loader for each tensor by its GGUF name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

from .config import ModelConfig
from .ops import AttentionSpec, Ops, Rope

# a layer's fields and the GGUF tensor (blk.N.<name>) each is loaded from
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight",
}
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass
class DenseLayer:
    attn: AttentionSpec
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None

    def matrices(self) -> list:
        return [getattr(self, f) for f in MATRICES]


class Loader(Protocol):
    """How a backend keeps tensors: matrix(name) and vector(name) load one (vector: norms, biases);
    has(name) says whether the file has it."""

    def matrix(self, name: str) -> Any: ...

    def vector(self, name: str) -> Any: ...

    def has(self, name: str) -> bool: ...


def attention_spec(c: ModelConfig, layer: int) -> AttentionSpec:
    return AttentionSpec(layer, c.sliding_window if c.is_sliding(layer) else 0,
                         Rope(c.rope_dim, c.layer_rope_theta(layer), c.layer_rope_scaling(layer), c.rope_style),
                         c.scale)


class DenseTransformer:
    def __init__(self, config: ModelConfig, tok_embd: Any, output_norm: Any, output: Any, layers: list[DenseLayer]):
        self.config = config
        self.tok_embd, self.output_norm, self.output = tok_embd, output_norm, output
        self.layers = layers

    @classmethod
    def load(cls, c: ModelConfig, loader: Loader) -> "DenseTransformer":
        tok_embd = loader.matrix("token_embd.weight")
        output = tok_embd if c.tie_embeddings else loader.matrix("output.weight")
        output_norm = loader.vector("output_norm.weight")
        layers = []
        for i in range(c.n_layers):
            parts: dict[str, Any] = {}
            for f in fields(DenseLayer):
                name = LAYER_TENSORS.get(f.name)
                if name is None:
                    continue
                full = f"blk.{i}.{name}"
                if f.name in MATRICES:
                    parts[f.name] = loader.matrix(full)
                elif f.default is None and not loader.has(full):
                    parts[f.name] = None          # optional, and this model has none
                else:
                    parts[f.name] = loader.vector(full)
            layers.append(DenseLayer(attn=attention_spec(c, i), **parts))
        return cls(c, tok_embd, output_norm, output, layers)

    def projections(self) -> list[tuple[str, tuple]]:
        """Every group of matrices one operation of `layer` multiplies, as ("linear", matrices that
        share an input) or ("gated", (gate, up)): what a backend sizes and prepares its kernels for."""
        return [group for lw in self.layers for group in (
            ("linear", (lw.wq, lw.wk, lw.wv)), ("linear", (lw.wo,)), ("gated", (lw.w_gate, lw.w_up)),
            ("linear", (lw.w_down,)))]

    def forward(self, ops: Ops) -> Any:
        """Logits at the last row of each sequence of the step that ops runs."""
        x = ops.embed(self.tok_embd, self.config.embed_scale)
        for lw in self.layers:
            x = self.layer(ops, lw, x)
        return ops.logits(x, self.output_norm, self.output)

    def layer(self, ops: Ops, lw: DenseLayer, x: Any) -> Any:
        q, k, v = ops.norm_linear(x, lw.attn_norm, (lw.wq, lw.wk, lw.wv), (lw.bq, lw.bk, lw.bv))
        if lw.q_norm is not None:
            q, k = ops.head_norm(q, lw.q_norm), ops.head_norm(k, lw.k_norm)
        o = ops.attention(q, k, v, lw.attn)
        x = ops.linear_residual(o, lw.wo, x, lw.post_attn_norm)
        a = ops.norm_gated_mlp(x, lw.ffn_norm, lw.w_gate, lw.w_up, self.config.activation)
        return ops.linear_residual(a, lw.w_down, x, lw.post_ffn_norm)
