"""Hugging Face checkpoint directories: the same model saved as GGUF and as safetensors must
run the same. Synthetic checks are fast; the real SmolLM2 round trip through transformers is
marked slow (it needs torch + transformers and ~40 s)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from support import synth
from support.paging import contiguous_tables
from realizar_backend.backends.base import PrefillItem
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.formats import open_model
from realizar_backend.formats.quants import dequantize


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _greedy(model, prompt: np.ndarray, steps: int, max_context: int = 256) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the prompt's last-position logits on the CPU reference backend."""
    be = contiguous_tables(CPUBackend(model, max_slots=1, max_context=max_context))
    first = be.prefill([PrefillItem(0, prompt, 0)])[0]
    out, logits, pos = [], first, len(prompt)
    for _ in range(steps):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = be.decode([0], [tok], [pos])[0]
        pos += 1
    be.close()
    return out, first


# ------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("arch,dtype,shards", [("llama", "F32", 1), ("llama", "BF16", 2),
                                               ("qwen2", "F16", 3), ("qwen2", "F32", 2)])
def test_hf_dir_runs_like_the_gguf_it_mirrors(tmp_path, arch, dtype, shards):
    # llama GGUF holds q/k permuted for adjacent-pair RoPE, the HF dir un-permuted for halves:
    # equal logits prove the name map, the un-permutation convention and rope_style together
    m = synth.write_gguf(tmp_path / "m.gguf", arch, tied=(arch == "llama"))
    d = synth.write_hf_dir(tmp_path / "hf", m, dtype=dtype, shards=shards)
    g, h = open_model(m.path), open_model(d)
    assert h.format == "safetensors" and h.config.rope_style == "neox"
    assert (h.config.tie_embeddings, h.config.qkv_bias) == (g.config.tie_embeddings, g.config.qkv_bias)
    assert set(h.tensors) == set(g.tensors)
    prompt = np.random.default_rng().integers(3, g.config.vocab_size, 12)
    be_g, be_h = contiguous_tables(CPUBackend(g, 1, 64)), contiguous_tables(CPUBackend(h, 1, 64))
    lg = be_g.prefill([PrefillItem(0, prompt, 0)])
    lh = be_h.prefill([PrefillItem(0, prompt, 0)])
    tol = {"F32": 1e-4, "F16": 5e-3, "BF16": 3e-2}[dtype]     # the storage rounding, carried through
    assert np.abs(lg - lh).max() <= tol * np.abs(lg).max()
    assert _cos(lg, lh) > 0.9999


def test_bf16_stays_raw_and_decodes(tmp_path):
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2")
    h = open_model(synth.write_hf_dir(tmp_path / "hf", m, dtype="BF16"))
    t = h.tensor("blk.1.ffn_down.weight")
    src = m.source["blk.1.ffn_down.weight"]
    # raw bytes like a GGUF BF16 tensor: uint8 (rows, 2*cols), zero-copy from the file
    assert t.qtype == Q.BF16 and t.data.dtype == np.uint8 and t.data.shape == (src.shape[0], 2 * src.shape[1])
    assert not t.data.flags.owndata
    w = dequantize(t.data, t.qtype, t.shape)
    # bfloat16 keeps 8 significant bits: relative error <= 2**-8
    assert np.all(np.abs(w - src) <= np.abs(src) * 2 ** -8 + 1e-30)
    assert dequantize(h.tensor("blk.0.attn_q.bias").data, Q.BF16, (m.dims["head_dim"] * m.dims["n_heads"],)).shape == \
        (m.dims["head_dim"] * m.dims["n_heads"],)


def test_hf_dir_tokenizer_and_metadata(tmp_path):
    m = synth.write_gguf(tmp_path / "m.gguf", "llama")
    d = synth.write_hf_dir(tmp_path / "hf", m)
    h = open_model(d)
    assert h.tokenizer_json == d / "tokenizer.json"
    assert h.tokenizer_config["chat_template"] == synth.CHAT_TEMPLATE
    assert h.metadata["general.name"] == "synth-hf" and h.name == "synth-hf"
    assert h.metadata["general.architecture"] == "llama"
    assert h.metadata["tokenizer.ggml.bos_token_id"] == 1 and h.metadata["tokenizer.ggml.eos_token_id"] == 2


def test_chat_template_from_jinja_file(tmp_path):
    # transformers >= 4.47 writes the template to chat_template.jinja, not tokenizer_config.json
    m = synth.write_gguf(tmp_path / "m.gguf", "llama")
    d = synth.write_hf_dir(tmp_path / "hf", m)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template") + "{# from the jinja file #}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(template)
    h = open_model(d)
    assert h.tokenizer_config["chat_template"] == template
    assert h.metadata["tokenizer.chat_template"] == template


def test_hf_dir_without_tokenizer_files(tmp_path):
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2")
    h = open_model(synth.write_hf_dir(tmp_path / "hf", m, tokenizer=False))
    assert h.tokenizer_json is None and h.tokenizer_config == {}


def test_transformers5_rope_parameters(tmp_path):
    # transformers 5 moved rope_theta into rope_parameters
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2")
    d = synth.write_hf_dir(tmp_path / "hf", m, config_overrides={
        "rope_theta": None, "rope_parameters": {"rope_theta": 123456.0, "rope_type": "default"}})
    assert open_model(d).config.rope_theta == 123456.0


# ------------------------------------------------------------------ the real SmolLM2 via transformers


@pytest.fixture(scope="module")
def smol_hf(tmp_path_factory, smol_path):
    """SmolLM2 GGUF -> transformers (dequantized to float32) -> save_pretrained directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smol_path.parent), gguf_file=smol_path.name, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    # transformers marks GGUF-loaded models "quantized" and refuses to save them, though the
    # weights are plain float tensors by now: drop the marker to save them as a checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out = tmp_path_factory.mktemp("smol_hf")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    prompt = tok("The three primary colors are red, yellow and")["input_ids"]
    del model
    return out, np.array(prompt)


@pytest.mark.slow
def test_smollm2_saved_by_transformers_runs_like_the_gguf(smol_hf, smol_model):
    d, prompt = smol_hf
    h = open_model(d)
    g = smol_model.config
    c = h.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        (g.arch, g.n_layers, g.hidden, g.n_heads, g.n_kv_heads, g.head_dim, g.ffn_dim, g.vocab_size)
    assert c.rope_theta == g.rope_theta and c.rms_eps == pytest.approx(g.rms_eps)
    assert c.rope_style == "neox" and g.rope_style == "normal" and c.tie_embeddings
    assert h.tokenizer_json is not None and "<|im_start|>" in h.tokenizer_config["chat_template"]
    assert h.quant_mix() == {"F32": 272}

    toks_g, first_g = _greedy(smol_model, prompt, 24)
    toks_h, first_h = _greedy(h, prompt, 24)
    assert toks_h == toks_g
    assert _cos(first_g, first_h) >= 0.999
