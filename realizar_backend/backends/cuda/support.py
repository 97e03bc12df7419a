"""What the GPU backend runs, decided before anything touches the GPU (no CuPy): `realizar inspect`
reports it, and CUDABackend refuses at load, by name, a model it cannot run instead of failing at its
first step or running a tensor a slow way."""

from __future__ import annotations

from ...formats import ModelFile
from .matrices import QTYPES

# the dense MLPs' activations the GPU kernels apply (kernels/common.cuh act_f)
DENSE_ACTIVATIONS = ("silu", "gelu_tanh")
# the routed experts' activations (common.cuh gated_f: those, and gpt-oss's clamped SwiGLU)
MOE_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# experts a token takes that the GPU's routing holds (kernels/moe.cu MOE_MAX_K: one per lane)
MOE_MAX_K = 32
# the head sizes the GPU's attention takes: whole warps of lanes, up to attention.cu's ATT_MAXD
ATT_MAXD = 256
# a Gated DeltaNet's shapes the GPU's kernels hold (kernels/deltanet.cu, the same names): conv inputs
# kept per channel, and the column of a head's state (k_dim floats) and the head's columns (v_dim
# threads) of one block
DN_MAX_TAPS, DN_MAX_K, DN_MAX_V = 8, 128, 256
# the k_dims with a delta-rule kernel of their own (deltanet.cu DN_DELTA_K_LIST: dn_delta_k<dk>, the
# state column's length fixed at compile time); other k_dims run the general dn_delta
DN_DELTA_K = (32, 64, 128)


def dn_delta_kernel(k_dim: int) -> str:
    """The name of deltanet.cu's delta-rule kernel for heads of k_dim key dims."""
    return f"dn_delta_k{k_dim}" if k_dim in DN_DELTA_K else "dn_delta"


# the chunked form of the delta rule (deltanet.cu dn_chunk_k<dk>, one per DN_DELTA_K): chunks of
# DN_CHUNK rows, heads of up to DN_CHUNK_MAX_V value dims (the same names there)
DN_CHUNK, DN_CHUNK_MAX_V = 32, 128


def dn_chunk_kernel(k_dim: int, v_dim: int) -> str | None:
    """The name of deltanet.cu's chunked delta-rule kernel for these heads, or None where there is
    none (those heads run dn_delta token by token)."""
    return f"dn_chunk_k{k_dim}" if k_dim in DN_DELTA_K and v_dim <= DN_CHUNK_MAX_V else None


# A hybrid's recurrent state is a fixed size per slot, allocated for every slot before the KV pool
# takes what is left: it gets at most this share of the memory left after the weights, and the
# slots are as many as fit in it (fewer than max_num_seqs where the state is large: Qwen3.6-27B's
# is 157 MB a sequence), so that the KV pool keeps room for long conversations.
RECURRENT_STATE_SHARE = 0.5


def recurrent_slots(state_bytes: int, want: int, budget: int) -> int:
    """The slots of a model whose sequences keep `state_bytes` of recurrent state each: `want`, or as
    many as RECURRENT_STATE_SHARE of `budget` (device bytes left after the weights) holds; 0 when not
    even one fits."""
    if state_bytes <= 0:
        return want
    return max(0, min(want, int(budget * RECURRENT_STATE_SHARE) // state_bytes))


def gpu_types(mf: ModelFile) -> dict[str, bool]:
    """Each storage type of the file's matrices: whether the GPU backend has kernels for it."""
    return {t.type_name: t.qtype in QTYPES for t in mf.tensors.values() if len(t.shape) >= 2}


def refusal(mf: ModelFile) -> str | None:
    """Why the GPU backend cannot run this model (None: it can)."""
    c = mf.config
    if c.head_dim % 32 or c.head_dim > ATT_MAXD:
        return f"head_dim {c.head_dim}: the GPU attention kernels need a multiple of 32 up to {ATT_MAXD}"
    if c.has_recurrent_state and not (c.ssm_conv_kernel - 1 <= DN_MAX_TAPS and c.ssm_k_dim <= DN_MAX_K
                                      and c.ssm_v_dim <= DN_MAX_V):
        return (f"{c.arch}: the GPU's Gated DeltaNet kernels take conv kernels of up to {DN_MAX_TAPS + 1} and "
                f"heads of up to {DN_MAX_K} key and {DN_MAX_V} value dims (this model: {c.ssm_conv_kernel}, "
                f"{c.ssm_k_dim}, {c.ssm_v_dim})")
    if c.n_experts and c.activation not in MOE_ACTIVATIONS:
        return f"{c.arch}: the GPU backend has no {c.activation} experts yet"
    if not c.n_experts and c.activation not in DENSE_ACTIVATIONS:
        return f"{c.arch}: the GPU backend has no {c.activation} MLPs yet"
    if c.n_experts_used > MOE_MAX_K:
        return f"{c.arch}: {c.n_experts_used} experts a token; the GPU backend routes at most {MOE_MAX_K}"
    for name, t in mf.tensors.items():
        if name.endswith(".ffn_gate_shexp.weight") and t.shape[0] != c.shared_expert_ffn_dim:
            # the workspace holds a shared expert of the width the metadata gives
            return (f"tensor {name}: {t.shape[0]} rows, but the metadata gives a shared expert FFN of "
                    f"{c.shared_expert_ffn_dim}")
        if c.post_norms and name.endswith("attn_output.bias"):
            return f"tensor {name}: the GPU backend adds no output-projection bias before a post-norm yet"
        if len(t.shape) >= 2 and t.qtype not in QTYPES:
            return f"tensor {name}: type {t.type_name} has no GPU kernel yet"
    return None
