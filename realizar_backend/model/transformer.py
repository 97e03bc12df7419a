"""The models, written once: the blocks a layer is made of and the layer of every family.

    x = embed(tokens) * embed_scale
    dense (llama, qwen2, qwen3, gemma3):        x = attention(x);  x = mlp(x)
    mixture of experts (qwen3moe, gpt-oss):    x = attention(x);  x = experts(x)
    logits = RMSNorm(x) @ output.T

attention: RMSNorm -> q, k, v (biases: qwen2, gpt-oss) -> per-head q/k norms (qwen3, gemma3) -> RoPE
and the KV cache -> attention (a sliding window on gemma3's local and gpt-oss's even layers; a sink
logit per head: gpt-oss) -> output projection (bias: gpt-oss) into the residual (through a post-norm:
gemma3). mlp: RMSNorm -> act(gate) * up -> down into the residual (post-norm: gemma3). experts:
RMSNorm -> the router's softmax (bias: gpt-oss) picks each token's top k experts -> their gated MLPs
(biases and the clamped SwiGLU: gpt-oss), weighted by the routing probabilities renormalised over
the k, into the residual. The optional tensors are the differences between the architectures.

Weights are whatever the backend keeps (NumPy arrays, device pointers): `load` asks the backend's
loader for each tensor by its GGUF name. The operations are model/ops.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .arch import ARCHITECTURES
from .config import ModelConfig
from .ops import AttentionSpec, Ops, Rope


class Loader(Protocol):
    """How a backend keeps tensors: matrix(name) and vector(name) load one (matrix: 2-D, or 3-D
    experts [n, rows, cols]; vector: norms, biases); has(name) says whether the file has it."""

    def matrix(self, name: str) -> Any: ...

    def vector(self, name: str) -> Any: ...

    def has(self, name: str) -> bool: ...


def attention_spec(c: ModelConfig, layer: int) -> AttentionSpec:
    return AttentionSpec(layer, c.sliding_window if c.is_sliding(layer) else 0,
                         Rope(c.rope_dim, c.layer_rope_theta(layer), c.layer_rope_scaling(layer), c.rope_style),
                         c.scale)


# ---------------------------------------------------------------- blocks
@dataclass
class Attention:
    spec: AttentionSpec
    norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    bo: Any = None
    q_norm: Any = None
    k_norm: Any = None
    sinks: Any = None
    post_norm: Any = None

    @classmethod
    def load(cls, c: ModelConfig, i: int, ld: Loader) -> "Attention":
        b = f"blk.{i}."
        opt = _optional(ld, b)
        return cls(attention_spec(c, i), ld.vector(b + "attn_norm.weight"), ld.matrix(b + "attn_q.weight"),
                   ld.matrix(b + "attn_k.weight"), ld.matrix(b + "attn_v.weight"), ld.matrix(b + "attn_output.weight"),
                   opt("attn_q.bias"), opt("attn_k.bias"), opt("attn_v.bias"), opt("attn_output.bias"),
                   opt("attn_q_norm.weight"), opt("attn_k_norm.weight"), opt("attn_sinks.weight"),
                   opt("post_attention_norm.weight") if c.post_norms else None)

    def __call__(self, ops: Ops, x: Any) -> Any:
        q, k, v = ops.norm_linear(x, self.norm, (self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))
        if self.q_norm is not None:
            q, k = ops.head_norm(q, self.q_norm), ops.head_norm(k, self.k_norm)
        o = ops.attention(q, k, v, self.spec, self.sinks)
        return ops.linear_residual(o, self.wo, x, self.post_norm, self.bo)

    def projections(self) -> list[tuple[str, tuple]]:
        return [("linear", (self.wq, self.wk, self.wv)), ("linear", (self.wo,))]


@dataclass
class MLP:
    norm: Any
    gate: Any
    up: Any
    down: Any
    act: str
    post_norm: Any = None

    @classmethod
    def load(cls, c: ModelConfig, i: int, ld: Loader) -> "MLP":
        b = f"blk.{i}."
        return cls(ld.vector(b + "ffn_norm.weight"), ld.matrix(b + "ffn_gate.weight"), ld.matrix(b + "ffn_up.weight"),
                   ld.matrix(b + "ffn_down.weight"), c.activation,
                   _optional(ld, b)("post_ffw_norm.weight") if c.post_norms else None)

    def __call__(self, ops: Ops, x: Any) -> Any:
        a = ops.norm_gated_mlp(x, self.norm, self.gate, self.up, self.act)
        return ops.linear_residual(a, self.down, x, self.post_norm)

    def projections(self) -> list[tuple[str, tuple]]:
        return [("gated", (self.gate, self.up)), ("linear", (self.down,))]


@dataclass
class Experts:
    """n experts' gated MLPs stacked: gate and up [n, ffn, hidden], down [n, hidden, ffn] (biases
    [n, ffn] and [n, hidden] where the model has them); the router [n, hidden] (+ bias [n]); each
    token takes the top_k (renormalize: their probabilities rescaled to sum to one)."""
    norm: Any
    router: Any
    gate: Any
    up: Any
    down: Any
    top_k: int
    renormalize: bool
    act: str
    router_bias: Any = None
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None

    @classmethod
    def load(cls, c: ModelConfig, i: int, ld: Loader) -> "Experts":
        b = f"blk.{i}."
        opt = _optional(ld, b)
        return cls(ld.vector(b + ARCHITECTURES[c.arch].ffn_norm), ld.matrix(b + "ffn_gate_inp.weight"),
                   ld.matrix(b + "ffn_gate_exps.weight"), ld.matrix(b + "ffn_up_exps.weight"),
                   ld.matrix(b + "ffn_down_exps.weight"), c.n_experts_used, c.expert_renormalize, c.activation,
                   opt("ffn_gate_inp.bias"), opt("ffn_gate_exps.bias"), opt("ffn_up_exps.bias"),
                   opt("ffn_down_exps.bias"))

    def __call__(self, ops: Ops, x: Any) -> Any:
        return ops.norm_moe_residual(x, self.norm, self)

    def projections(self) -> list[tuple[str, tuple]]:
        return [("router", (self.router,)), ("experts", (self.gate, self.up, self.down))]


def _optional(ld: Loader, prefix: str):
    def get(name: str) -> Any:
        return ld.vector(prefix + name) if ld.has(prefix + name) else None
    return get


# ---------------------------------------------------------------- families
@dataclass
class Layer:
    attention: Attention
    ffn: MLP | Experts


class Transformer:
    """A stack of layers, each attention then its feed-forward block (an MLP, or experts)."""
    FFN: type = MLP

    def __init__(self, config: ModelConfig, tok_embd: Any, output_norm: Any, output: Any, layers: list[Layer]):
        self.config = config
        self.tok_embd, self.output_norm, self.output = tok_embd, output_norm, output
        self.layers = layers

    @classmethod
    def load(cls, c: ModelConfig, ld: Loader) -> "Transformer":
        tok_embd = ld.matrix("token_embd.weight")
        output = tok_embd if c.tie_embeddings else ld.matrix("output.weight")
        output_norm = ld.vector("output_norm.weight")
        layers = [Layer(Attention.load(c, i, ld), cls.FFN.load(c, i, ld)) for i in range(c.n_layers)]
        return cls(c, tok_embd, output_norm, output, layers)

    def forward(self, ops: Ops) -> Any:
        """Logits at the last row of each sequence of the step that ops runs."""
        x = ops.embed(self.tok_embd, self.config.embed_scale)
        for layer in self.layers:
            x = layer.attention(ops, x)
            x = layer.ffn(ops, x)
        return ops.logits(x, self.output_norm, self.output)

    def projections(self) -> list[tuple[str, tuple]]:
        """Every group of matrices one operation multiplies, as ("linear", matrices that share an
        input), ("gated", (gate, up)), ("router", (router,)) or ("experts", (gate, up, down)): what a
        backend sizes and prepares its kernels for."""
        return [g for layer in self.layers for g in layer.attention.projections() + layer.ffn.projections()]


class DenseTransformer(Transformer):
    FFN = MLP


class MoeTransformer(Transformer):
    FFN = Experts
