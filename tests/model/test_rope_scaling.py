"""RoPE scaling for contexts past the trained one: read from GGUF metadata (llama.cpp's keys, and
the rope_freqs tensor of llama3-style GGUFs) and from config.json (transformers' rope_scaling /
rope_parameters), and applied by the oracle's rope_frequencies / rope_angles exactly as
transformers' own rope init functions compute it (the GPU reads the same numbers through
ops.rope_table)."""

from __future__ import annotations

import numpy as np
import pytest

from support import synth
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.model.math import rope_angles, rope_frequencies
from realizar_backend.errors import UnsupportedModelError
from realizar_backend.formats import open_model
from support.paging import contiguous_tables

torch = pytest.importorskip("torch")


def _transformers(rope: dict, theta: float, head_dim: int = 64, max_pos: int = 4096):
    """(inv_freq, attention_factor) from transformers' rope init function for `rope`."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {**rope, "rope_theta": theta}
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=params)
    inv, att = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    return inv.double().numpy(), float(att)


HF_CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},          # Qwen2.5's advice
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
     "beta_slow": 2.0, "truncate": False},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
]


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"], ids=["transformers4", "transformers5"])
@pytest.mark.parametrize("rope", HF_CASES, ids=lambda r: f"{r['rope_type']}-{r['factor']:g}")
def test_config_json_scaling_matches_transformers(tmp_path, rope, style):
    theta = 1e6 if rope["rope_type"] != "llama3" else 5e5
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2", rope_theta=theta)
    over = ({"rope_theta": theta, "rope_scaling": rope} if style == "rope_scaling"
            else {"rope_theta": None, "rope_parameters": {**rope, "rope_theta": theta}})
    c = open_model(synth.write_hf_dir(tmp_path / "hf", m, config_overrides=over)).config
    assert c.rope_scaling is not None and c.rope_scaling.kind == rope["rope_type"]
    inv, mscale = rope_frequencies(c.rope_dim, c.rope_theta, c.rope_scaling)
    ref_inv, ref_att = _transformers(rope, theta, c.head_dim)
    np.testing.assert_allclose(inv, ref_inv, rtol=2e-6)        # transformers computes in float32
    assert mscale == pytest.approx(ref_att, rel=1e-12)
    # cos and sin carry the attention factor (HF: cos * attention_scaling)
    cos, sin = rope_angles(np.array([0, 12345]), c.rope_dim, c.rope_theta, c.rope_scaling)
    np.testing.assert_allclose(cos[0], ref_att, rtol=1e-6)
    np.testing.assert_allclose(cos[1] ** 2 + sin[1] ** 2, ref_att ** 2, rtol=1e-5)


def _gguf(tmp_path, arch="qwen2", theta=1e6, context_length=32768, weights=None, dims=None, **scaling):
    md = {f"{arch}.rope.scaling.{k}": v for k, v in scaling.items()}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return open_model(synth.write_gguf(tmp_path / "m.gguf", arch, rope_theta=theta, context_length=context_length,
                                       extra_metadata=md, weights=weights, **(dims or {"seed": 1})).path).config


def test_gguf_yarn_matches_transformers(tmp_path):
    """llama.cpp's YaRN (ggml_rope_yarn: ramp between corner dims, mscale = 1 + 0.1 ln factor on
    cos/sin) and transformers' give the same frequencies for the same parameters."""
    c = _gguf(tmp_path, type="yarn", factor=4.0, original_context_length=32768)
    assert c.rope_scaling.kind == "yarn" and c.rope_scaling.original_context == 32768
    inv, mscale = rope_frequencies(c.rope_dim, c.rope_theta, c.rope_scaling)
    ref_inv, ref_att = _transformers({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                                     1e6, c.head_dim)
    np.testing.assert_allclose(inv, ref_inv, rtol=2e-6)
    assert mscale == pytest.approx(ref_att, rel=1e-6)


def test_gguf_yarn_attention_factors_and_betas(tmp_path):
    """The llama.cpp/gguf-py keys: the attention factors multiply mscale; the betas move the ramp;
    ext_factor 0 turns the ramp and mscale off (plain interpolation)."""
    c = _gguf(tmp_path, type="yarn", factor=8.0, original_context_length=4096, attn_factor=1.1,
              yarn_attn_factor=0.5, yarn_beta_fast=16.0, yarn_beta_slow=2.0)
    inv, mscale = rope_frequencies(c.rope_dim, c.rope_theta, c.rope_scaling)
    ref_inv, ref_att = _transformers({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 16.0, "beta_slow": 2.0}, 1e6, c.head_dim)
    np.testing.assert_allclose(inv, ref_inv, rtol=2e-6)
    assert mscale == pytest.approx(ref_att * 1.1 * 0.5, rel=1e-6)
    off = _gguf(tmp_path / "x", type="yarn", factor=8.0, yarn_ext_factor=0.0)
    inv0, m0 = rope_frequencies(off.rope_dim, off.rope_theta, off.rope_scaling)
    np.testing.assert_allclose(inv0, rope_frequencies(off.rope_dim, off.rope_theta)[0] / 8.0, rtol=1e-12)
    assert m0 == 1.0


def test_gguf_linear_and_legacy_key(tmp_path):
    for i, md in enumerate(({"type": "linear", "factor": 2.0}, {"factor": 2.0})):
        c = _gguf(tmp_path / str(i), **md)
        assert c.rope_scaling.kind == "linear"
        inv, mscale = rope_frequencies(c.rope_dim, c.rope_theta, c.rope_scaling)
        np.testing.assert_allclose(inv, rope_frequencies(c.rope_dim, c.rope_theta)[0] / 2.0, rtol=1e-12)
        assert mscale == 1.0
    assert _gguf(tmp_path / "n", type="none").rope_scaling is None


def test_gguf_llama3_rope_freqs_tensor(tmp_path):
    """A llama3.x GGUF carries its frequency bands as rope_freqs.weight (per-pair divisors, as
    convert_hf_to_gguf writes them): the frequencies equal transformers' llama3 rope."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    ref_inv, _ = _transformers(rope, 5e5, 64)
    plain = 5e5 ** (-np.arange(0, 64, 2, dtype=np.float64) / 64)
    w, dims = synth.make_weights("llama", seed=1)
    w["rope_freqs.weight"] = (plain / ref_inv).astype(np.float32)
    c = _gguf(tmp_path, "llama", theta=5e5, weights=w, dims=dims)
    assert c.rope_scaling.kind == "none" and len(c.rope_scaling.freq_factors) == 32
    inv, mscale = rope_frequencies(c.rope_dim, c.rope_theta, c.rope_scaling)
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-6)
    assert mscale == 1.0


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_unsupported_gguf_scaling_is_named(tmp_path, kind):
    with pytest.raises(UnsupportedModelError, match=f"RoPE scaling '{kind}'"):
        _gguf(tmp_path, type=kind, factor=4.0)


def test_unsupported_config_json_scaling_is_named(tmp_path):
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2")
    d = synth.write_hf_dir(tmp_path / "hf", m, config_overrides={
        "rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [1.0]}})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'longrope'"):
        open_model(d)


def test_gemma3_scales_global_layers_only():
    from realizar_backend.model.config import config_from_gguf
    md = {"general.architecture": "gemma3", "gemma3.block_count": 6, "gemma3.embedding_length": 640,
          "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
          "gemma3.feed_forward_length": 2048, "gemma3.vocab_size": 1000, "gemma3.rope.freq_base": 1e6,
          "gemma3.attention.sliding_window": 512, "gemma3.rope.scaling.type": "linear",
          "gemma3.rope.scaling.factor": 8.0}
    c = config_from_gguf("gemma.gguf", md, set())
    assert [c.layer_rope_scaling(i) is not None for i in range(6)] == [False] * 5 + [True]
    assert c.layer_rope_theta(0) == 10000.0


def test_cpu_backend_applies_the_scaling(tmp_path):
    """The same weights with and without YaRN give different logits at long positions (the oracle
    ropes with the model's scaling) and equal ones at the first position (no rotation there, and a
    one-key softmax ignores mscale)."""
    w, dims = synth.make_weights("qwen2", seed=3)
    cfgs = []
    for i, md in enumerate(({}, {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                                 "qwen2.rope.scaling.original_context_length": 64})):
        m = synth.write_gguf(tmp_path / f"m{i}.gguf", "qwen2", context_length=2048, extra_metadata=md,
                             weights=w, **dims)
        cfgs.append(contiguous_tables(CPUBackend(open_model(m.path), max_slots=1, max_context=512)))
    toks = list(range(3, 40)) * 8
    from realizar_backend.backends.base import PrefillItem
    outs = [b.prefill([PrefillItem(0, np.array(toks, np.int32), 0)])[-1] for b in cfgs]
    first = [b.prefill([PrefillItem(0, np.array(toks[:1], np.int32), 0)])[-1] for b in cfgs]
    assert np.allclose(first[0], first[1], atol=1e-5)
    assert not np.allclose(outs[0], outs[1], atol=1e-3)
