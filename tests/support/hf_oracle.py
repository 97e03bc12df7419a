"""Tiny random models of any architecture, written by transformers and converted to GGUF by
llama.cpp's own convert_hf_to_gguf.py: an oracle for architectures whose real weights cannot be
fetched here, but whose reference implementations can.

    gguf = tiny_gguf("qwen3")             # cached; the transformers checkpoint is gguf.parent / "hf"
    ref = reference_model(gguf)           # transformers, float32 on the CPU, on the same weights
    assert_greedy_parity(ref, CPUBackend(open_model(gguf), ...), prompt_ids, label="qwen3")

Every model keeps its architecture's whole feature set (grouped KV heads, biases, q/k norms,
sliding windows, RoPE scaling, tied or untied embeddings, experts, linear-attention layers) at
small widths; `tiny_gguf(arch, **overrides)` changes any config.json field. The weights are drawn
from a seeded generator, at scales chosen so that the logits spread and every part shows in them
(transformers' own initialisation, std 0.02, unit norms and zero biases, leaves the logits nearly
flat and would hide a bias or norm that a backend forgot).

The converter comes from the llama-cpp-python sdist on PyPI (pip download; the wheels do not carry
it), pinned to LLAMA_CPP_PYTHON, the newest release whose converter knows qwen3moe, gpt-oss and
qwen35/qwen35moe. It runs in a subprocess with its own gguf-py first on sys.path (the script puts
it there), so the installed `gguf` version does not matter.

The tokenizer is StarCoder2's (49,152 tokens), as transformers reads it from the vocabulary GGUF
that llama.cpp ships in the same sdist (models/ggml-vocab-starcoder.gguf). The converter takes a
byte-level BPE tokenizer only when the hash of its output on a test text is one it knows, so it
must be a real model's: this is the smallest of the vocabularies in the sdist whose transformers
reading hashes to a known pre-tokenizer ("starcoder"; GPT-2's 50,257 also does, deepseek-coder's
32k does not). Every architecture takes it; the converter writes it as tokenizer.ggml.pre
"starcoder".

Everything lands under CACHE: the converter once, each model in a directory keyed by a hash of its
architecture, config, seed, FACTORY_VERSION and the transformers version (`hf/` the checkpoint,
beside it one GGUF per output type and converter), so a test run pays for a conversion at most
once, and a machine whose cache survives pays once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from support.real_models import CACHE as MODEL_CACHE
from realizar_backend.backends.base import PrefillItem

LLAMA_CPP_PYTHON = "0.3.36"
CACHE = MODEL_CACHE.parent / "hf-oracle"
TOKENIZER_VOCAB = "starcoder"                 # models/ggml-vocab-<this>.gguf in the sdist
VOCAB_SIZE = 49152
EOS_ID = 0                                    # <|endoftext|>
# Bumped whenever the weights drawn for the same config change, so that cached models are rebuilt.
FACTORY_VERSION = 1

# Drawn weights: matrices N(0, 1/fan_in) keep activations at unit scale through a layer; the input
# embeddings enter the residual stream at EMBED_STD (after any embedding scale), small beside what
# the layers add, so that the next token depends on the context more than on the token itself (a
# tied head otherwise repeats its input); biases are drawn at BIAS_STD, large enough that a
# forgotten one shows in the logits, small enough not to drive every position to the same token;
# norm weights and other vectors move NORM_JITTER from their initial value (1, or 0 where the model
# adds 1). Last, the final norm is scaled so that the logits have LOGIT_STD: top-two gaps then
# average ~1 over the 49,152 tokens, so greedy near-ties (< 0.01) are rare.
EMBED_STD = 0.25
BIAS_STD = 0.2
NORM_JITTER = 0.1
LOGIT_STD = 4.0


@dataclass(frozen=True)
class TinyArch:
    hf_class: str                  # transformers' class, also config.json's `architectures`
    gguf_arch: str                 # what the converter writes as general.architecture
    config: dict[str, Any]         # config.json fields on top of the model type's defaults
    convert_args: tuple[str, ...] = ()   # extra convert_hf_to_gguf.py options


_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
)

ARCHS: dict[str, TinyArch] = {
    # Llama 3: GQA, untied head, llama3 RoPE bands (written by the converter as rope_freqs). The
    # trained context is short so that the bands move frequencies a short test sequence turns.
    "llama": TinyArch("LlamaForCausalLM", "llama", dict(
        model_type="llama", tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    # Qwen2.5: QKV biases, tied embeddings, YaRN (its documented long-context setting).
    "qwen2": TinyArch("Qwen2ForCausalLM", "qwen2", dict(
        model_type="qwen2", tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                             original_max_position_embeddings=64))),
    # Qwen3: q/k RMSNorm per head, head_dim not hidden / heads, untied head.
    "qwen3": TinyArch("Qwen3ForCausalLM", "qwen3", dict(
        model_type="qwen3", tie_word_embeddings=False, head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # Gemma 3: sliding layers (5 of every 6) with their own RoPE base, global layers with linear
    # RoPE scaling (Gemma 3 4B+), head_dim 256 at a small width, pre and post norms (stored +1 by
    # the converter), embeddings scaled by sqrt(hidden), GELU-tanh, tied head. The local base is
    # not Gemma's 10000, so that a reader assuming 10000 fails. llama.cpp takes the attention scale
    # (1/sqrt(head_dim)) from the architecture, not the file, so query_pre_attn_scalar keeps it.
    "gemma3": TinyArch("Gemma3ForCausalLM", "gemma3", dict(
        model_type="gemma3_text", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=1000.0),
                             full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)))),
    # Qwen3-30B-A3B style mixture of experts: q/k norm, top-k of 8 experts with renormalised
    # weights, every layer sparse.
    "qwen3_moe": TinyArch("Qwen3MoeForCausalLM", "qwen3moe", dict(
        model_type="qwen3_moe", tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # gpt-oss: alternating sliding / full attention, attention sinks, biases everywhere, experts with
    # biases and the clamped SwiGLU, YaRN without truncation. The experts are float here (no MXFP4
    # blocks), so the converter writes them in the output type.
    "gpt_oss": TinyArch("GptOssForCausalLM", "gpt-oss", dict(
        model_type="gpt_oss", tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=4096))),
    # Qwen3.5 (Qwen3-Next style hybrid): three Gated DeltaNet layers then one gated full-attention
    # layer (q/k norm, partial RoPE over a quarter of head_dim 256, interleaved M-RoPE sections),
    # fewer key heads than value heads in the linear layers (the converter reorders the V heads).
    "qwen3_5": TinyArch("Qwen3_5ForCausalLM", "qwen35", dict(
        model_type="qwen3_5_text", num_hidden_layers=4, head_dim=256, tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True)),
        convert_args=("--no-mtp",)),      # transformers' CausalLM has no multi-token-prediction head
    # Qwen3.5 MoE: the same hybrid with routed experts plus a gated shared expert in every layer.
    "qwen3_5_moe": TinyArch("Qwen3_5MoeForCausalLM", "qwen35moe", dict(
        model_type="qwen3_5_moe_text", num_hidden_layers=4, head_dim=256, tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True)),
        convert_args=("--no-mtp",)),
}


def available(arch: str) -> bool:
    """Whether the installed transformers has the tiny `arch`'s model class."""
    import transformers
    return hasattr(transformers, ARCHS[arch].hf_class)


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The config.json fields of the tiny `arch` (see ARCHS), with `overrides` on top."""
    if arch not in ARCHS:
        raise KeyError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHS)}")
    spec = ARCHS[arch]
    cfg = {**_COMMON, **spec.config, **overrides}
    cfg["architectures"] = [spec.hf_class]
    return cfg


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _publish(stage: Path, final: Path) -> Path:
    """Move a finished staging directory into place; another process that got there first wins."""
    try:
        stage.rename(final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(stage, ignore_errors=True)
    return final


# ------------------------------------------------------------------ the converter


def converter_dir() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its conversion/ package, gguf-py and the tokenizer
    vocabulary we use, extracted once from the llama-cpp-python sdist."""
    root = CACHE / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", f"models/ggml-vocab-{TOKENIZER_VOCAB}.gguf")
        stage = Path(tmp) / "stage"
        with tarfile.open(sdist) as tf:
            members = []
            for m in tf.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else ""
                if rel in wanted or rel.startswith(("conversion/", "gguf-py/gguf/")):
                    m.name = rel
                    members.append(m)
            tf.extractall(stage, members, filter="data")
        if not (stage / "convert_hf_to_gguf.py").exists():
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        return _publish(stage, root)


def tokenizer_dir() -> Path:
    """StarCoder2's tokenizer as transformers writes it (tokenizer.json + tokenizer_config.json),
    read by transformers from llama.cpp's vocabulary GGUF."""
    out = CACHE / f"tokenizer-{TOKENIZER_VOCAB}"
    if (out / "tokenizer.json").exists():
        return out
    import transformers
    vocab = converter_dir() / "models" / f"ggml-vocab-{TOKENIZER_VOCAB}.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name)
    if len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"{vocab.name}: {len(tok)} tokens, expected {VOCAB_SIZE}")
    stage = Path(tempfile.mkdtemp(dir=CACHE))
    tok.save_pretrained(stage)
    return _publish(stage, out)


# ------------------------------------------------------------------ models


def _draw_weights(model, seed: int) -> None:
    """Every parameter redrawn or jittered from `seed`, by the rules above EMBED_STD."""
    import torch
    g = torch.Generator().manual_seed(seed)
    embeddings = {id(m.weight): float(getattr(m, "embed_scale", 1.0))
                  for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if id(p) in embeddings:
                p.copy_(noise * (EMBED_STD / embeddings[id(p)]))
            elif name.endswith("bias"):
                p.copy_(noise * BIAS_STD)
            elif p.ndim >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:                        # norm weights (1, or 0 where the model adds 1), sinks, A_log
                p.add_(noise * NORM_JITTER)
        probe = torch.randint(0, model.config.vocab_size, (1, 16), generator=g)
        std = float(model(probe).logits.std())
        _scale_norm(model.get_decoder().norm, LOGIT_STD / std)


def _scale_norm(norm, factor: float) -> None:
    """Multiply what an RMSNorm multiplies by: its weight, or 1 + weight (Gemma's), found by
    zeroing the weight and seeing whether the output vanishes."""
    import torch
    w = norm.weight
    saved = w.detach().clone()
    w.zero_()
    adds_one = bool(norm(torch.ones(1, w.shape[0])).abs().max() > 0)
    w.copy_((1 + saved) * factor - 1 if adds_one else saved * factor)


def tiny_hf_dir(arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A transformers `save_pretrained` directory (float32 safetensors, config.json, tokenizer)
    of the tiny `arch` with weights drawn from `seed`; cached."""
    import torch
    import transformers
    cfg = tiny_config(arch, **overrides)
    key = _key(arch, cfg, seed, FACTORY_VERSION, TOKENIZER_VOCAB, transformers.__version__)
    out = CACHE / "models" / f"{arch}-{key}" / "hf"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir()
    fields = dict(cfg)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    cls = getattr(transformers, ARCHS[arch].hf_class)
    torch.manual_seed(seed)              # transformers' own draws (A_log) are jittered, not replaced
    model = cls(config).to(torch.float32).eval()
    _draw_weights(model, seed)
    stage = Path(tempfile.mkdtemp(dir=out.parent))
    model.save_pretrained(stage)
    for f in tok.iterdir():
        shutil.copy(f, stage / f.name)
    return _publish(stage, out)


def tiny_gguf(arch: str, seed: int = 0, outtype: str = "f32", **overrides: Any) -> Path:
    """The tiny `arch` (config.json fields overridden by `overrides`, weights from `seed`)
    converted by llama.cpp's convert_hf_to_gguf.py to `outtype` (f32, f16, bf16, q8_0); cached.
    Its transformers checkpoint is the directory `path.parent / "hf"`."""
    hf = tiny_hf_dir(arch, seed, **overrides)
    out = hf.parent / f"model-{outtype}-{LLAMA_CPP_PYTHON}.gguf"
    if out.exists():
        return out
    conv = converter_dir()
    tmp = out.with_suffix(f".{os.getpid()}.part")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(tmp),
                           "--outtype", outtype, *ARCHS[arch].convert_args],
                          capture_output=True, text=True, env=env, cwd=conv)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed on the tiny {arch} (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def reference_model(gguf: Path):
    """transformers' model of a tiny_gguf file, float32 on the CPU, eager attention (the textbook
    softmax, sliding windows and sinks included)."""
    import torch
    import transformers
    hf = Path(gguf).parent / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    cls = getattr(transformers, cfg["architectures"][0])
    return cls.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()


# ------------------------------------------------------------------ the comparison

STEPS = 16
COSINE = 0.999               # last-position logits, every step
NEAR_TIE = 0.01              # a greedy divergence is acceptable only where the reference's top two
                             # logits are closer than this


def reference_greedy(ref, ids: list[int], steps: int = STEPS) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation of `ids` (up to `steps` tokens; it stops at an end of
    text): the tokens and the logits each was chosen from."""
    import torch
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                           num_beams=1, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                           repetition_penalty=None, temperature=None, top_p=None, top_k=None)
    return out.sequences[0, len(ids):].tolist(), [l[0].float().numpy() for l in out.logits]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_greedy_parity(ref, backend, ids: list[int], steps: int = STEPS, label: str = "", tokenizer=None,
                         reference=None) -> int:
    """Prefill `ids` into slot 0 of `backend` (its table set) and decode greedily beside `ref`:
    every step's logits to cosine >= COSINE, and the same tokens until a divergence that the
    reference's own near-tie explains (a failure shows both continuations, as text where a
    `tokenizer` is given). `reference`: reference_greedy's result, when the caller has it.
    Returns the steps compared."""
    def show(toks: list[int]) -> str:
        return repr(tokenizer.decode(toks)) if tokenizer is not None else str(toks)

    ref_tokens, ref_logits = reference if reference is not None else reference_greedy(ref, ids, steps)
    logits = backend.prefill([PrefillItem(0, np.asarray(ids, dtype=np.int32), 0)])[0]
    got: list[int] = []
    for step in range(len(ref_tokens)):
        c = _cos(logits, ref_logits[step])
        assert c >= COSINE, f"{label}: step {step} logits cosine {c:.6f} < {COSINE}"
        t = int(np.argmax(logits))
        got.append(t)
        if t != ref_tokens[step]:
            top2 = np.sort(ref_logits[step])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, (
                f"{label}: step {step} ours {t} ref {ref_tokens[step]} (ref top-2 gap {top2[1] - top2[0]:.4f})\n"
                f"ours {show(got)}\nref  {show(ref_tokens)}")
            return step + 1   # past a legitimate near-tie the two continuations differ
        if step + 1 < len(ref_tokens):
            logits = backend.decode([0], [t], [len(ids) + step])[0]
    return len(ref_tokens)
