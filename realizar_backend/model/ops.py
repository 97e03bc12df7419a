"""The operations a model is written in, and what each means.

A model (transformer.py) calls these on an `Ops` object for one step; a backend implements them:
the NumPy backend as the plain math of model/math.py, the CUDA backend as kernel launches (fused
where a kernel does several at once, on the kernel its matrix-multiply dispatcher picks). Values
are the backend's own: NumPy arrays on the CPU, workspace buffers on the GPU. A step covers T
rows: the tokens of one or more sequences, each at its own position.

The fusions are named operations, so a backend that fuses them needs no second copy of the layer:
- norm_linear: RMSNorm then one or more projections of the normed rows (Q, K and V share one);
- linear_residual: a projection added into the residual stream (through a post-norm where the
  model has one, gemma3);
- norm_gated_mlp: RMSNorm then act(gate) * up;
- norm_moe_residual: RMSNorm, the router and the chosen experts' MLPs, into the residual;
- attention with head_norms: each head of q and k RMSNorm'd (qwen3, gemma3) before RoPE, where a
  decode step's attention launch loads them anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from .config import RopeScaling


@dataclass(frozen=True)
class Rope:
    """RoPE of one layer: the first `dim` dims of each head rotate by position * frequency (math.py
    rope_frequencies: theta and scaling), as adjacent pairs ("normal") or halves ("neox")."""
    dim: int
    theta: float
    scaling: RopeScaling | None
    style: str


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention needs beyond q, k and v: its index (which KV cache it reads and
    writes), its sliding window (0: every earlier position), its RoPE and the score scale."""
    layer: int
    window: int
    rope: Rope
    scale: float


class Ops(Protocol):
    def embed(self, table: Any, scale: float) -> Any:
        """Rows of the embedding table for the step's token ids, times scale."""

    def norm_linear(self, x: Any, norm: Any, mats: Sequence[Any], biases: Sequence[Any | None]) -> tuple:
        """h = RMSNorm(x) * norm; (h @ W.T + b for each matrix W and bias b (None: none))."""

    def attention(self, q: Any, k: Any, v: Any, spec: AttentionSpec, sinks: Any | None = None,
                  head_norms: tuple[Any, Any] | None = None) -> Any:
        """head_norms = (q_norm, k_norm): first each head of q and of k RMSNorm'd over its head_dim
        values, times q_norm and k_norm (None: no norms). Then RoPE on q and k; k and v written to the layer's KV cache at each row's position; each
        row attends (causal, within spec.window) to its sequence's cached positions up to its own,
        grouped KV heads (sinks: one more logit per head in the softmax, attending nowhere);
        returns the rows of the heads' outputs."""

    def linear_residual(self, a: Any, w: Any, x: Any, post_norm: Any | None, bias: Any | None = None) -> Any:
        """x + (a @ w.T + bias), or x + RMSNorm(a @ w.T + bias) * post_norm: the new residual stream."""

    def norm_gated_mlp(self, x: Any, norm: Any, gate: Any, up: Any, act: str) -> Any:
        """h = RMSNorm(x) * norm; act(h @ gate.T) * (h @ up.T) (act: "silu" | "gelu_tanh")."""

    def norm_moe_residual(self, x: Any, norm: Any, experts: Any) -> Any:
        """h = RMSNorm(x) * norm; each row's router probabilities softmax(h @ router.T + router_bias),
        its top_k experts e (their probabilities p_e renormalised to sum to one where
        experts.renormalize); x + sum_e p_e * down_e(act(h @ gate_e.T, h @ up_e.T)), each projection
        with its expert's bias where it has one; plus sigmoid(h @ shared_router.T) times the shared
        expert's SwiGLU MLP of h where the model has one (model/transformer.py Experts)."""

    def split_heads(self, y: Any, parts: int) -> tuple:
        """Rows of heads whose each head is `parts` equal pieces [p0 | p1 | ...] -> the rows of the
        heads' p0s, of their p1s, ... (a gated attention's [query | gate])."""

    def sigmoid_gate(self, y: Any, gate: Any) -> Any:
        """y * sigmoid(gate), elementwise."""

    def delta_rule(self, mixed: Any, z: Any, beta: Any, alpha: Any, net: Any) -> Any:
        """A Gated DeltaNet's core over each sequence's rows (model/transformer.py DeltaNet):
        c = silu(causal depthwise conv of the mixed rows, the sequence's last conv_kernel - 1 rows
        before them from its state); q, k, v = c's parts, q and k l2-normalised per head, q / sqrt(k_dim);
        per value head h, with g = a_coef_h * softplus(alpha_h + dt_bias_h) and b = sigmoid(beta_h):
        S <- exp(g) S;  S <- S + k (b (v - S^T k))^T;  o = S^T q  (S the sequence's state, carried on);
        returns RMSNorm(o per head) * out_norm * silu(z). A sequence's first step (position 0)
        starts from zero state."""

    def logits(self, x: Any, norm: Any, w: Any) -> Any:
        """RMSNorm(x) * norm @ w.T at the last row of each sequence of the step (a decode step's
        every row)."""
