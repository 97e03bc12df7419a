"""The tiny gpt-oss models of the GPU tests (tests/gpu/test_gptoss_gpu.py): tests/support/hf_oracle.py's
tiny gpt-oss (transformers' GptOssForCausalLM with random weights, converted by llama.cpp's
convert_hf_to_gguf.py; the NumPy backend matches transformers on it) at gpt-oss's head size (64), with
everything that sets gpt-oss apart: sinks, q/k/v and output biases, a router bias, experts' biases and
the clamped SwiGLU, YaRN, sliding-window attention on the even layers.

    f16    4 q heads over 2 KV heads, a window of 8: F16 matrices, F32 experts and router
    mxfp4  8 q heads over 1 KV head (gpt-oss's group of 8), a window of 32: F16 attention matrices,
           the experts in MXFP4 (as gpt-oss ships them), the router F32

Both keep the token embeddings in Q4_0 (the 49,152-token tables dominate the files: the two stay
under 20 MB); the LM head is F16 in f16 and Q8_0 in mxfp4. The GPU machine has no transformers and no network, so the files are
made here and carried:

    python tests/support/gptoss_models.py DIR      # writes DIR/gptoss-f16.gguf and DIR/gptoss-mxfp4.gguf

and the GPU tests read them from $REALIZAR_GPTOSS_MODELS (or make them where they can).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

if __name__ == "__main__":                      # as a script: tests/, the support package, on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.carried_models import CarriedModels  # noqa: E402

ARCH = "gpt_oss"
NAMES = ("f16", "mxfp4")
# config.json overrides of each model (tests/support/hf_oracle.py ARCHS has the rest: 4 experts, 2 a
# token, hidden 64, expert FFN 32, 2 layers: sliding then full)
OVERRIDES = {
    "f16": dict(head_dim=64),
    "mxfp4": dict(head_dim=64, num_attention_heads=8, num_key_value_heads=1, sliding_window=32),
}


def types(name: str):
    """The model's type of each tensor (None: as converted, F32: vectors, the router, f16's experts)."""
    def pick(tensor: str, shape: tuple[int, ...]) -> Q | None:
        if len(shape) < 2 or tensor.endswith("ffn_gate_inp.weight"):
            return None
        if tensor == "token_embd.weight":
            return Q.Q4_0
        if tensor == "output.weight":
            return Q.F16 if name == "f16" else Q.Q8_0
        if "_exps." in tensor:
            return None if name == "f16" else Q.MXFP4
        return Q.F16
    return pick


MODELS = CarriedModels("gptoss", "REALIZAR_GPTOSS_MODELS", ".device/gptoss", {n: ARCH for n in NAMES}, OVERRIDES,
                       {n: types(n) for n in NAMES})
model_path = MODELS.model_path

if __name__ == "__main__":
    MODELS.main()
