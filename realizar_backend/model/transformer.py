"""The models, written once: the blocks a layer is made of and the layer of every family.

    x = embed(tokens) * embed_scale
    dense (llama, qwen2, qwen3, gemma3):        x = attention(x);  x = mlp(x)
    mixture of experts (qwen3moe, gpt-oss):    x = attention(x);  x = experts(x)
    linear-attention hybrid (qwen35):          x = delta_net(x) or gated_attention(x);  x = mlp(x)
    hybrid mixture of experts (qwen35moe):     x = delta_net(x) or gated_attention(x);  x = experts(x)
    logits = RMSNorm(x) @ output.T

attention: RMSNorm -> q, k, v (biases: qwen2, gpt-oss) -> per-head q/k norms (qwen3, gemma3) -> RoPE
and the KV cache -> attention (a sliding window on gemma3's local and gpt-oss's even layers; a sink
logit per head: gpt-oss) -> output projection (bias: gpt-oss) into the residual (through a post-norm:
gemma3). mlp: RMSNorm -> act(gate) * up -> down into the residual (post-norm: gemma3). experts:
RMSNorm -> the router's softmax (bias: gpt-oss) picks each token's top k experts -> their gated MLPs
(biases and the clamped SwiGLU: gpt-oss), weighted by the routing probabilities renormalised over
the k, plus a shared expert gated by sigmoid (qwen35moe), into the residual. delta_net (Gated DeltaNet: three of every four qwen35 layers): RMSNorm ->
the mixed q|k|v rows, the output gate z, beta and alpha -> a short causal convolution, then the
gated delta rule over a fixed-size state per sequence -> RMSNorm of each head times silu(z) -> the
output projection into the residual. gated_attention (qwen35's other layers): attention whose q
projection also yields a gate per head, sigmoid(gate) on the heads' output, partial RoPE. The
optional tensors are the differences between the architectures.

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
        o = ops.attention(q, k, v, self.spec, self.sinks, self.head_norms)
        return ops.linear_residual(o, self.wo, x, self.post_norm, self.bo)

    @property
    def head_norms(self) -> tuple[Any, Any] | None:
        """The per-head q and k norms (qwen3, gemma3, qwen35's gated attention), or None."""
        return None if self.q_norm is None else (self.q_norm, self.k_norm)

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
        return cls(ld.vector(b + ARCHITECTURES[c.arch].ffn_norm), ld.matrix(b + "ffn_gate.weight"),
                   ld.matrix(b + "ffn_up.weight"),
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
    # a shared expert every token takes (qwen35moe), weighted by sigmoid(h @ shared_router.T)
    shared_gate: Any = None
    shared_up: Any = None
    shared_down: Any = None
    shared_router: Any = None

    @classmethod
    def load(cls, c: ModelConfig, i: int, ld: Loader) -> "Experts":
        b = f"blk.{i}."
        opt = _optional(ld, b)
        return cls(ld.vector(b + ARCHITECTURES[c.arch].ffn_norm), ld.matrix(b + "ffn_gate_inp.weight"),
                   ld.matrix(b + "ffn_gate_exps.weight"), ld.matrix(b + "ffn_up_exps.weight"),
                   ld.matrix(b + "ffn_down_exps.weight"), c.n_experts_used, c.expert_renormalize, c.activation,
                   opt("ffn_gate_inp.bias"), opt("ffn_gate_exps.bias"), opt("ffn_up_exps.bias"),
                   opt("ffn_down_exps.bias"), *(ld.matrix(b + n) if ld.has(b + n) else None for n in (
                       "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
                       "ffn_gate_inp_shexp.weight")))

    def __call__(self, ops: Ops, x: Any) -> Any:
        return ops.norm_moe_residual(x, self.norm, self)

    def projections(self) -> list[tuple[str, tuple]]:
        """The router and the routed experts; a shared expert as the dense MLP it is (its gate and
        up a gated group, its down projection a linear one) and its one-output gate a router."""
        shared = [("gated", (self.shared_gate, self.shared_up)), ("linear", (self.shared_down,)),
                  ("router", (self.shared_router,))] if self.shared_gate is not None else []
        return [("router", (self.router,)), ("experts", (self.gate, self.up, self.down))] + shared


class GatedAttention(Attention):
    """qwen35's full-attention layers: the q projection gives each head's query and a gate
    ([query | gate] per head), the heads' output is multiplied by sigmoid(gate)."""

    def __call__(self, ops: Ops, x: Any) -> Any:
        qg, k, v = ops.norm_linear(x, self.norm, (self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))
        q, gate = ops.split_heads(qg, 2)
        o = ops.attention(q, k, v, self.spec, head_norms=self.head_norms)
        return ops.linear_residual(ops.sigmoid_gate(o, gate), self.wo, x, self.post_norm, self.bo)


@dataclass
class DeltaNet:
    """A Gated DeltaNet layer: per value head h a state S_h [k_dim, v_dim] per sequence, and a
    causal convolution over the mixed q|k|v channels with the last conv_kernel - 1 inputs kept.
    Value head h reads key head h % k_heads (llama.cpp's tiled order of the GGUF's value heads).
    a_coef = -exp(A_log), as GGUF stores it."""
    layer: int                 # its state's index among the model's recurrent layers
    norm: Any
    qkv: Any                   # [2 * k_heads * k_dim + v_heads * v_dim, hidden]
    gate: Any                  # z: [v_heads * v_dim, hidden]
    beta: Any                  # [v_heads, hidden]
    alpha: Any                 # [v_heads, hidden]
    conv: Any                  # [channels, conv_kernel]
    a_coef: Any                # [v_heads]
    dt_bias: Any               # [v_heads]
    out_norm: Any              # [v_dim]
    out: Any                   # [hidden, v_heads * v_dim]
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    @classmethod
    def load(cls, c: ModelConfig, i: int, ld: Loader) -> "DeltaNet":
        b = f"blk.{i}."
        return cls(sum(c.recurrent[:i]), ld.vector(b + "attn_norm.weight"), ld.matrix(b + "attn_qkv.weight"),
                   ld.matrix(b + "attn_gate.weight"), ld.matrix(b + "ssm_beta.weight"), ld.matrix(b + "ssm_alpha.weight"),
                   ld.vector(b + "ssm_conv1d.weight"), ld.vector(b + "ssm_a"), ld.vector(b + "ssm_dt.bias"),
                   ld.vector(b + "ssm_norm.weight"), ld.matrix(b + "ssm_out.weight"),
                   c.ssm_k_heads, c.ssm_k_dim, c.ssm_v_heads, c.ssm_v_dim)

    def __call__(self, ops: Ops, x: Any) -> Any:
        mixed, z, beta, alpha = ops.norm_linear(x, self.norm, (self.qkv, self.gate, self.beta, self.alpha),
                                                (None,) * 4)
        o = ops.delta_rule(mixed, z, beta, alpha, self)
        return ops.linear_residual(o, self.out, x, None)

    def projections(self) -> list[tuple[str, tuple]]:
        return [("linear", (self.qkv, self.gate, self.beta, self.alpha)), ("linear", (self.out,))]


def _optional(ld: Loader, prefix: str):
    def get(name: str) -> Any:
        return ld.vector(prefix + name) if ld.has(prefix + name) else None
    return get


# ---------------------------------------------------------------- families
@dataclass
class Layer:
    attention: Attention | DeltaNet
    ffn: MLP | Experts


class Transformer:
    """A stack of layers, each attention then its feed-forward block (an MLP, or experts)."""
    FFN: type = MLP

    @staticmethod
    def mixer(c: ModelConfig, i: int) -> type:
        """The block that mixes the positions of layer i."""
        return Attention

    def __init__(self, config: ModelConfig, tok_embd: Any, output_norm: Any, output: Any, layers: list[Layer]):
        self.config = config
        self.tok_embd, self.output_norm, self.output = tok_embd, output_norm, output
        self.layers = layers

    @classmethod
    def load(cls, c: ModelConfig, ld: Loader) -> "Transformer":
        tok_embd = ld.matrix("token_embd.weight")
        output = tok_embd if c.tie_embeddings else ld.matrix("output.weight")
        output_norm = ld.vector("output_norm.weight")
        layers = [Layer(cls.mixer(c, i).load(c, i, ld), cls.FFN.load(c, i, ld)) for i in range(c.n_layers)]
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


class HybridTransformer(Transformer):
    """Gated DeltaNet layers, every few of them a gated full-attention layer."""
    FFN = MLP

    @staticmethod
    def mixer(c: ModelConfig, i: int) -> type:
        return DeltaNet if c.is_recurrent(i) else GatedAttention


class HybridMoeTransformer(HybridTransformer):
    FFN = Experts
