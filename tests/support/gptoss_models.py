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

import os
import subprocess
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

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


def file_name(name: str) -> str:
    return f"gptoss-{name}.gguf"


def make(name: str, out: Path) -> Path:
    """Build the model `name` (NAMES) with transformers and the converter (cached by hf_oracle.py),
    stored as `types` says, into out."""
    from support.hf_oracle import tiny_gguf
    from support.synth import requantize
    src = tiny_gguf(ARCH, **OVERRIDES[name])
    out.parent.mkdir(parents=True, exist_ok=True)
    return requantize(src, out, types(name))


def model_path(name: str) -> Path | None:
    """The tiny model `name`: from $REALIZAR_GPTOSS_MODELS where it is there, else made now (None
    where transformers or the converter is out of reach)."""
    d = os.environ.get("REALIZAR_GPTOSS_MODELS")
    if d and (Path(d) / file_name(name)).exists():
        return Path(d) / file_name(name)
    try:
        from support.hf_oracle import available, tiny_gguf
        if not available(ARCH):
            return None
        # beside the converted model, in hf_oracle's cache (keyed by its config, seed and versions)
        out = tiny_gguf(ARCH, **OVERRIDES[name]).parent / file_name(name)
        return out if out.exists() else make(name, out)
    except (ImportError, subprocess.CalledProcessError):     # no transformers, or no network for the converter
        return None


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests/: the support package
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else ".device/gptoss")
    for n in NAMES:
        print(make(n, dest / file_name(n)))
