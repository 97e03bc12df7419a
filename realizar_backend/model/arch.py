"""Per-architecture facts: which tensors a block has, which are required, how GGUF lays out
RoPE pairs. Canonical tensor names are GGUF's (`blk.N.attn_q.weight`); safetensors names are
mapped onto them at load."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    name: str
    gguf_rope_style: str                 # llama.cpp permutes llama q/k to adjacent pairs
    block_required: tuple[str, ...]      # every layer's
    block_optional: tuple[str, ...] = ()
    # a hybrid's layers of each kind (model/config.py is_recurrent): the tensors that kind reads;
    # neither kind is asked for the other's
    attention_required: tuple[str, ...] = ()
    recurrent_required: tuple[str, ...] = ()
    experts: bool = False                # mixture of experts (model/transformer.py Experts)
    recurrent: bool = False              # linear-attention hybrid (model/transformer.py DeltaNet layers)
    gated_attention: bool = False        # attn_q also gives a gate per head ([query | gate])
    # the RMSNorm before the feed-forward block (llama.cpp names gpt-oss's post_attention_norm)
    ffn_norm: str = "ffn_norm.weight"


_LLAMA_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                "ffn_down.weight")
_ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
_EXPERTS = ("ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
            "ffn_down_exps.weight")
_BIAS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
_QKNORM = ("attn_q_norm.weight", "attn_k_norm.weight")
_GATED_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight") + _QKNORM
_DELTANET = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_conv1d.weight",
             "ssm_a", "ssm_dt.bias", "ssm_norm.weight", "ssm_out.weight")
# qwen35moe's shared expert (optional; all four or none: validate_model in formats/gguf.py)
SHARED_EXPERT = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "normal", _LLAMA_BLOCK, _BIAS),
    "qwen2": ArchSpec("qwen2", "neox", _LLAMA_BLOCK + _BIAS),
    "qwen3": ArchSpec("qwen3", "neox", _LLAMA_BLOCK + _QKNORM, _BIAS),
    "gemma3": ArchSpec("gemma3", "neox", _LLAMA_BLOCK + _QKNORM + (
        "post_attention_norm.weight", "post_ffw_norm.weight")),
    "qwen3moe": ArchSpec("qwen3moe", "neox", _ATTENTION + _QKNORM + _EXPERTS, _BIAS, experts=True),
    "gpt-oss": ArchSpec("gpt-oss", "neox", _ATTENTION + _BIAS + (
        "attn_output.bias", "attn_sinks.weight", "post_attention_norm.weight", "ffn_gate_inp.weight",
        "ffn_gate_inp.bias", "ffn_gate_exps.weight", "ffn_gate_exps.bias", "ffn_up_exps.weight", "ffn_up_exps.bias",
        "ffn_down_exps.weight", "ffn_down_exps.bias"), experts=True, ffn_norm="post_attention_norm.weight"),
    # Qwen3.5 / 3.6: Gated DeltaNet layers and gated full-attention layers (model/transformer.py
    # loads each kind's tensors; block_required are those every layer has)
    "qwen35": ArchSpec("qwen35", "neox", ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight",
                                          "ffn_up.weight", "ffn_down.weight"),
                       attention_required=_GATED_ATTENTION, recurrent_required=_DELTANET,
                       recurrent=True, gated_attention=True, ffn_norm="post_attention_norm.weight"),
    "qwen35moe": ArchSpec("qwen35moe", "neox", ("attn_norm.weight", "post_attention_norm.weight") + _EXPERTS[1:],
                          SHARED_EXPERT, attention_required=_GATED_ATTENTION, recurrent_required=_DELTANET,
                          experts=True, recurrent=True, gated_attention=True, ffn_norm="post_attention_norm.weight"),
}

# transformers' `architectures` entries -> canonical arch
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}

GLOBAL_REQUIRED = ("token_embd.weight", "output_norm.weight")
GLOBAL_OPTIONAL = ("output.weight",)


def supported_list() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def required_tensors(arch: str, n_layers: int, recurrent: tuple[bool, ...] = ()) -> list[str]:
    """The tensors a model must have; a hybrid's layer by its kind (recurrent[i]: layer i is
    recurrent, as ModelConfig.recurrent says)."""
    spec = ARCHITECTURES[arch]
    names = list(GLOBAL_REQUIRED)
    for i in range(n_layers):
        kind = spec.recurrent_required if i < len(recurrent) and recurrent[i] else spec.attention_required
        names += [f"blk.{i}.{t}" for t in spec.block_required + kind]
    return names


# Hugging Face parameter names -> canonical (GGUF) names; `{i}` is the layer.
HF_TO_CANONICAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
