"""The tiny mixture-of-experts models of the GPU tests (tests/gpu/test_moe.py): tests/support/hf_oracle.py's
tiny qwen3moe (transformers' Qwen3MoeForCausalLM with random weights, converted by llama.cpp's
convert_hf_to_gguf.py; the NumPy backend matches transformers on it), at head sizes the GPU's
attention takes:

    f32   the model as the converter writes it: F32 matrices and experts (hidden 64, head_dim 32)
    q4k   a wider one (hidden 256, expert FFN 256, head_dim 64) requantized to Q4_K_M's mix: Q4_K
          matrices and experts, Q6_K V, LM head and layer 0's expert down projections; layer 1's
          up projections Q6_K beside Q4_K gates (gate and up of two types: the unfused expert path)

The GPU machine has no transformers and no network, so the files are made here and carried:

    python tests/support/moe_models.py DIR      # writes DIR/qwen3moe-f32.gguf and DIR/qwen3moe-q4k.gguf

and the GPU tests read them from $REALIZAR_MOE_MODELS (or make them where they can).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

if __name__ == "__main__":                      # as a script: tests/, the support package, on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.carried_models import CarriedModels  # noqa: E402

ARCH = "qwen3_moe"
NAMES = ("f32", "q4k")
# config.json overrides of each model (tests/support/hf_oracle.py ARCHS has the rest: 8 experts, 2 a token,
# renormalised, q/k norms, 2 layers)
OVERRIDES = {
    "f32": dict(head_dim=32),
    "q4k": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64),
}


def q4k_types(name: str, shape: tuple[int, ...]) -> Q | None:
    """The q4k model's type of each tensor (None: as converted, F32: norms and the router)."""
    if len(shape) < 2 or name.endswith("ffn_gate_inp.weight"):
        return None
    if name == "output.weight" or name.endswith("attn_v.weight"):
        return Q.Q6_K
    if name == "blk.0.ffn_down_exps.weight" or name == "blk.1.ffn_up_exps.weight":
        return Q.Q6_K
    return Q.Q4_K


MODELS = CarriedModels("qwen3moe", "REALIZAR_MOE_MODELS", ".device/moe", {n: ARCH for n in NAMES}, OVERRIDES,
                       {"f32": None, "q4k": q4k_types})
model_path = MODELS.model_path

if __name__ == "__main__":
    MODELS.main()
