"""The tiny linear-attention hybrids of the GPU tests (tests/gpu/test_hybrid_gpu.py): tests/support/hf_oracle.py's
tiny qwen35 (transformers' Qwen3_5ForCausalLM with random weights, converted by llama.cpp's
convert_hf_to_gguf.py; the NumPy backend matches transformers on it): three Gated DeltaNet layers and
one gated full-attention layer (head_dim 256, RoPE over a quarter of it), and its mixture-of-experts
sibling qwen35moe:

    f32   the layers as the converter writes them (F32; hidden 64, 2 key heads and 4 value heads of
          32); the tied token embeddings / LM head Q4_0, so that the files stay small
    q4k   a wider one (hidden 256, FFN 256, value heads of 64) requantized to Q4_K_M's mix: Q4_K
          matrices (the tied embeddings / LM head too), Q6_K V
    moe   the qwen35moe of the same shape as f32 (8 routed experts, 2 a token, and a shared expert
          gated by sigmoid), Q8_0 matrices and experts, F32 routers, tied Q4_0 embeddings / LM head

The GPU machine has no transformers and no network, so the files are made here and carried:

    python tests/support/hybrid_models.py DIR      # writes DIR/qwen35-{f32,q4k,moe}.gguf

and the GPU tests read them from $REALIZAR_HYBRID_MODELS (or make them where they can).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

if __name__ == "__main__":                      # as a script: tests/, the support package, on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.carried_models import CarriedModels  # noqa: E402

NAMES = ("f32", "q4k", "moe")
# tests/support/hf_oracle.py's architecture of each model, and its config.json overrides (ARCHS has the rest)
ARCH = {"f32": "qwen3_5", "q4k": "qwen3_5", "moe": "qwen3_5_moe"}
OVERRIDES = {
    "f32": dict(tie_word_embeddings=True),
    "q4k": dict(hidden_size=256, intermediate_size=256, linear_value_head_dim=64, tie_word_embeddings=True),
    "moe": dict(tie_word_embeddings=True),
}


def f32_types(name: str, shape: tuple[int, ...]) -> Q | None:
    """The f32 model's type of each tensor: as converted, but for the vocabulary-sized ones."""
    return Q.Q4_0 if name in ("token_embd.weight", "output.weight") else None


def q4k_types(name: str, shape: tuple[int, ...]) -> Q | None:
    """The q4k model's type of each tensor (None: as converted, F32: norms, conv taps, vectors)."""
    if len(shape) < 2 or name.endswith("ssm_conv1d.weight"):
        return None
    return Q.Q6_K if name.endswith("attn_v.weight") else Q.Q4_K


def moe_types(name: str, shape: tuple[int, ...]) -> Q | None:
    """The moe model's type of each tensor (None: as converted)."""
    if len(shape) < 2 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return None
    return Q.Q4_0 if name == "token_embd.weight" else Q.Q8_0


TYPES = {"f32": f32_types, "q4k": q4k_types, "moe": moe_types}


MODELS = CarriedModels("qwen35", "REALIZAR_HYBRID_MODELS", ".device/hybrid", ARCH, OVERRIDES, TYPES)
model_path = MODELS.model_path

if __name__ == "__main__":
    MODELS.main()
