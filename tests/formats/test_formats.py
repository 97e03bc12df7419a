"""GGUF loading: every supported storage type decodes to the weights it was made from, the
config comes out of the metadata as a user would read it, and the real SmolLM2 opens."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf import quants as gq

from support import synth
from realizar_backend.formats import open_model
from realizar_backend.formats.quants import SUPPORTED, dequantize, row_bytes


def _ref_dequant(t) -> np.ndarray:
    """The llama.cpp team's reference decode of the same stored bytes."""
    if t.qtype in (Q.F32, Q.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(t.shape)
    return gq.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)


# the types tests/support/synth.py can write (gguf-py decodes every SUPPORTED type but quantizes fewer)
WRITABLE = [q for q in SUPPORTED if q in synth.TOLERANCE]


@pytest.mark.parametrize("qtype", WRITABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_writable_type_decodes_to_its_source(tmp_path, qtype, arch):
    m = synth.write_gguf(tmp_path / "m.gguf", arch=arch, qtype=qtype)
    mf = open_model(m.path)
    assert mf.quant_mix()[qtype.name] >= 7 * m.dims["n_layers"]
    for name, src in m.source.items():
        t = mf.tensor(name)
        assert t.qtype == m.qtypes[name]
        assert t.shape == src.shape
        # the stored bytes are exposed as the file holds them, not converted
        assert np.array_equal(np.asarray(t.data).view(np.uint8), synth.quantize(src, t.qtype).view(np.uint8))
        if t.qtype not in (Q.F32, Q.F16):
            assert t.data.dtype == np.uint8 and t.data.shape == (*src.shape[:-1], row_bytes(t.qtype, src.shape[-1]))
        got = dequantize(t.data, t.qtype, t.shape)
        assert got.dtype == np.float32 and got.shape == src.shape
        np.testing.assert_array_equal(got, _ref_dequant(t))
        err = np.abs(got - src).max() / np.abs(src).max()
        assert err <= synth.TOLERANCE[t.qtype], f"{name}: relative error {err:.4f}"


def test_tensors_are_zero_copy_views_of_the_file(tmp_path):
    m = synth.write_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    mf = open_model(m.path)
    for t in mf.tensors.values():
        # read-only views into the mapping: loading copies no weight bytes
        assert not t.data.flags.owndata and not t.data.flags.writeable


def test_mixed_types_per_tensor(tmp_path):
    mix = {"token_embd.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q5_0,
           "output_norm.weight": Q.F16}
    m = synth.write_gguf(tmp_path / "m.gguf", qtype=Q.Q4_K, qtypes=mix, tied=False)
    mf = open_model(m.path)
    for name, q in mix.items():
        assert mf.tensor(name).qtype == q
    assert mf.tensor("output.weight").qtype == Q.Q4_K
    assert mf.tensor("blk.0.attn_norm.weight").qtype == Q.F32


def test_rows_not_a_multiple_of_256_with_legacy_quants(tmp_path):
    # hidden 96 like real models whose width is not a K-quant multiple (qwen 0.5B has 896)
    m = synth.write_gguf(tmp_path / "m.gguf", arch="qwen2", qtype=Q.Q5_0, hidden=96, n_heads=4,
                         n_kv_heads=2, ffn=160)
    mf = open_model(m.path)
    t = mf.tensor("blk.0.ffn_down.weight")
    assert t.shape == (96, 160) and t.data.shape == (96, 160 // 32 * 22)
    err = np.abs(dequantize(t.data, t.qtype, t.shape) - m.source[t.name]).max()
    assert err <= synth.TOLERANCE[Q.Q5_0] * np.abs(m.source[t.name]).max()


@pytest.mark.parametrize("version", [2, 3])
def test_gguf_v2_and_v3_open_alike(tmp_path, version):
    m = synth.write_gguf(tmp_path / "m.gguf", qtype=Q.Q4_0, version=version, seed=7)
    ref = synth.write_gguf(tmp_path / "ref.gguf", qtype=Q.Q4_0, version=3, seed=7)
    a, b = open_model(m.path), open_model(ref.path)
    assert a.config == b.config and a.metadata == b.metadata
    for name in b.tensors:
        assert np.array_equal(a.tensor(name).data, b.tensor(name).data)


def test_config_llama_tied(tmp_path):
    rng = np.random.default_rng()
    theta, eps = float(rng.uniform(1e4, 1e6)), float(rng.uniform(1e-6, 1e-5))
    m = synth.write_gguf(tmp_path / "m.gguf", "llama", rope_theta=theta, rms_eps=eps, context_length=512,
                         n_layers=3, hidden=128, n_heads=4, n_kv_heads=1, ffn=256)
    c = open_model(m.path).config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == \
        ("llama", 3, 128, 4, 1, 32, 256)
    assert c.vocab_size == len(synth.tiny_tokenizer()[0]) and c.context_length == 512
    assert c.q_dim == 128 and c.kv_dim == 32
    assert c.rope_theta == pytest.approx(theta, rel=1e-6) and c.rms_eps == pytest.approx(eps, rel=1e-6)
    assert c.tie_embeddings and not c.qkv_bias and not c.qk_norm
    assert c.rope_style == "normal"          # llama GGUF stores q/k permuted for adjacent pairs


def test_config_qwen2_bias_untied_and_explicit_head_dim(tmp_path):
    # head_dim 48 != hidden / heads: the config must take key_length, not divide
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2", tied=False, hidden=128, n_heads=4, n_kv_heads=2,
                         head_dim=48, ffn=256)
    mf = open_model(m.path)
    c = mf.config
    assert c.qkv_bias and not c.tie_embeddings and c.rope_style == "neox"
    assert (c.head_dim, c.q_dim, c.kv_dim) == (48, 192, 96)
    assert mf.tensor("blk.0.attn_q.bias").shape == (192,)
    assert mf.tensor("blk.1.attn_output.weight").shape == (128, 192)


def test_metadata_matches_the_reference_reader(tmp_path):
    # this package parses the header itself; the gguf package's reader is the reference
    extra = {"test.flag": True, "test.i8": (-5, synth.GGUFValueType.INT8), "test.u64": (2 ** 40, synth.GGUFValueType.UINT64),
             "test.f64": (0.1, synth.GGUFValueType.FLOAT64), "test.floats": ([0.5, -1.25], synth.GGUFValueType.FLOAT32),
             "test.nested": [[1, 2], [3]], "test.unicode": "héllo ✓"}
    m = synth.write_gguf(tmp_path / "m.gguf", "qwen2", qtype=Q.Q6_K, extra_metadata=extra)
    mf = open_model(m.path)
    r = GGUFReader(m.path)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "test.nested":   # the reader flattens nested arrays
            continue
        assert mf.metadata[key] == f.contents(), key
    assert set(mf.metadata) == {k for k in r.fields if not k.startswith("GGUF.")}
    assert mf.metadata["test.flag"] is True and mf.metadata["test.u64"] == 2 ** 40
    assert mf.metadata["test.nested"] == [[1, 2], [3]]
    assert mf.metadata["tokenizer.ggml.merges"] == synth.tiny_tokenizer()[1]
    assert mf.name == "synth"
    for rt in r.tensors:
        t = mf.tensor(rt.name)
        assert t.qtype == rt.tensor_type and t.shape == tuple(reversed(rt.shape.tolist()))
        assert np.array_equal(t.data, rt.data)


def test_string_arrays_with_a_nul_or_bytes_that_are_not_utf8_read_item_by_item(tmp_path):
    # a string array is decoded in one call when it can be: an item holding a NUL or bytes that
    # are not UTF-8 (a character cut short, a stray continuation byte) still reads as that item
    # read alone would, the bad bytes as U+FFFD, and its neighbours stay whole
    from gguf import GGUFValueType as V

    from support import gguf_kv
    src = synth.write_gguf(tmp_path / "src.gguf", "llama", qtype=Q.F32)
    parts = gguf_kv.read(src.path)
    cases = {"test.nul": ["a", "b\x00c", "", "\x00"],
             "test.bad": [b"x", b"\xe4\xb8", b"\x80y", "z\u00e9".encode(), b""],
             "test.plain": ["\u0120the", "\u00e9", "", "<|im_end|>"]}
    kvs = parts.kvs + [gguf_kv.KV(k, V.ARRAY, v, V.STRING) for k, v in cases.items()]
    mf = open_model(gguf_kv.write(parts, kvs, tmp_path / "strings.gguf"))
    assert mf.metadata["test.nul"] == cases["test.nul"]
    assert mf.metadata["test.bad"] == ["x", "\ufffd", "\ufffdy", "z\u00e9", ""]
    assert mf.metadata["test.plain"] == cases["test.plain"]
    assert mf.metadata["tokenizer.ggml.tokens"] == synth.tiny_tokenizer()[0]


# ------------------------------------------------------------------ the real SmolLM2


def test_smollm2_config(smol_model):
    c = smol_model.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == \
        ("llama", 30, 576, 9, 3, 64, 1536)
    assert c.vocab_size == 49152 and c.context_length == 8192
    assert c.rope_theta == 100000.0 and c.rms_eps == pytest.approx(1e-5)
    assert c.tie_embeddings and not c.qkv_bias and c.rope_style == "normal"
    assert smol_model.metadata["tokenizer.ggml.model"] == "gpt2"
    assert smol_model.metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(smol_model.metadata["tokenizer.ggml.merges"]) == 48900
    assert "<|im_start|>" in smol_model.metadata["tokenizer.chat_template"]


def test_smollm2_quant_mix_and_decode(smol_model):
    assert smol_model.quant_mix() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    q8 = [t for t in smol_model.tensors.values() if t.qtype == Q.Q8_0]
    assert [t.name for t in q8] == ["token_embd.weight"]
    rng = np.random.default_rng()
    for name in ["token_embd.weight", f"blk.{rng.integers(30)}.ffn_down.weight", "output_norm.weight"]:
        t = smol_model.tensor(name)
        w = dequantize(t.data, t.qtype, t.shape)
        np.testing.assert_array_equal(w, _ref_dequant(t))
        assert np.isfinite(w).all() and 0 < np.abs(w).max() < 100


def test_smollm2_tensor_table_matches_the_reference_reader(smol_path, smol_model):
    r = GGUFReader(smol_path)
    assert len(r.tensors) == len(smol_model.tensors)
    for rt in r.tensors:
        t = smol_model.tensor(rt.name)
        assert t.qtype == rt.tensor_type and t.shape == tuple(reversed(rt.shape.tolist()))
        assert t.nbytes == rt.n_bytes and np.array_equal(t.data, rt.data)
