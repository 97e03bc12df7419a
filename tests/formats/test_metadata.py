"""Every metadata value the loader reads is checked for type, shape and range: a bad one is a
ModelFormatError that names the file and the key, never a TypeError, a ValueError or a
`tokenizers` exception. The cases damage the real SmolLM2 header, one key at a time."""

from __future__ import annotations

import math

import pytest
from gguf import GGUFValueType as V

from support import gguf_kv
from support.gguf_kv import replaced
from realizar_backend.errors import ModelFormatError, UnsupportedModelError
from realizar_backend.formats import open_model
from realizar_backend.model.tokenizer import Tokenizer
from support.real_models import smollm2_path

T = "tokenizer.ggml."
VOCAB = 49152


def _merges_with(parts, index, text):
    merges = list(next(kv.value for kv in parts.kvs if kv.key == T + "merges"))
    merges[index] = text
    return replaced(parts.kvs, T + "merges", V.ARRAY, merges, V.STRING)


def _token_renamed(parts, old, new):
    tokens = [new if t == old else t for t in next(kv.value for kv in parts.kvs if kv.key == T + "tokens")]
    return replaced(parts.kvs, T + "tokens", V.ARRAY, tokens, V.STRING)


def _set(key, vtype, value, itype=None):
    return lambda parts: replaced(parts.kvs, key, vtype, value, itype)


def _drop(key):
    return lambda parts: replaced(parts.kvs, key, drop=True)


# id, change(parts) -> kvs, the key the error must name
CASES = [
    # the cases that used to fail untyped
    ("eos-id-empty-array", _set(T + "eos_token_id", V.ARRAY, [], V.UINT32), T + "eos_token_id"),
    ("eot-id-string", _set(T + "eot_token_id", V.STRING, "abc"), T + "eot_token_id"),
    ("eom-id-nan", _set(T + "eom_token_id", V.FLOAT32, math.nan), T + "eom_token_id"),
    ("merges-scalar", _set(T + "merges", V.UINT32, 255), T + "merges"),
    ("token-type-scalar", _set(T + "token_type", V.INT32, 0), T + "token_type"),
    ("token-type-strings", _set(T + "token_type", V.ARRAY, ["1"] * VOCAB, V.STRING), T + "token_type"),
    ("merge-names-unknown-token", lambda p: _merges_with(p, 5, "Ġ zzzzqqq"), T + "merges"),
    ("token-renamed-merges-broken", lambda p: _token_renamed(p, "Ġthe", "Ġthx"), T + "merges"),
    # the rest of what the loader reads
    ("bos-id-outside-vocab", _set(T + "bos_token_id", V.UINT32, VOCAB), T + "bos_token_id"),
    ("eos-id-negative", _set(T + "eos_token_id", V.INT32, -1), T + "eos_token_id"),
    ("pad-id-float", _set(T + "padding_token_id", V.FLOAT32, 2.5), T + "padding_token_id"),
    ("unk-id-bool", _set(T + "unknown_token_id", V.BOOL, True), T + "unknown_token_id"),
    ("token-type-short", _set(T + "token_type", V.ARRAY, [1] * 100, V.INT32), T + "token_type"),
    ("token-type-out-of-range", _set(T + "token_type", V.ARRAY, [99] * VOCAB, V.INT32), T + "token_type"),
    ("tokens-scalar", _set(T + "tokens", V.STRING, "hello"), T + "tokens"),
    ("tokens-empty", _set(T + "tokens", V.ARRAY, [], V.STRING), T + "tokens"),
    ("tokens-integers", _set(T + "tokens", V.ARRAY, list(range(VOCAB)), V.INT32), T + "tokens"),
    ("merges-integers", _set(T + "merges", V.ARRAY, [1, 2, 3], V.INT32), T + "merges"),
    ("merge-without-space", lambda p: _merges_with(p, 0, "Ġt"), T + "merges"),
    ("merges-missing", _drop(T + "merges"), T + "merges"),
    ("model-integer", _set(T + "model", V.UINT32, 2), T + "model"),
    ("pre-array", _set(T + "pre", V.ARRAY, ["smollm"], V.STRING), T + "pre"),
    ("add-bos-integer", _set(T + "add_bos_token", V.UINT32, 1), T + "add_bos_token"),
    ("add-eos-string", _set(T + "add_eos_token", V.STRING, "yes"), T + "add_eos_token"),
    ("spm-without-scores", _set(T + "model", V.STRING, "llama"), T + "scores"),
    ("chat-template-integer", _set("tokenizer.chat_template", V.UINT32, 5), "tokenizer.chat_template"),
    ("chat-template-syntax", _set("tokenizer.chat_template", V.STRING, "{% if %}"), "tokenizer.chat_template"),
    ("arch-integer", _set("general.architecture", V.UINT32, 7), "general.architecture"),
    ("context-zero", _set("llama.context_length", V.UINT32, 0), "llama.context_length"),
    ("context-2**40", _set("llama.context_length", V.UINT64, 2 ** 40), "llama.context_length"),
    ("rope-theta-inf", _set("llama.rope.freq_base", V.FLOAT32, math.inf), "llama.rope.freq_base"),
    ("rope-theta-negative", _set("llama.rope.freq_base", V.FLOAT32, -1.0), "llama.rope.freq_base"),
    ("rms-eps-nan", _set("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, math.nan),
     "llama.attention.layer_norm_rms_epsilon"),
    ("heads-zero", _set("llama.attention.head_count", V.UINT32, 0), "llama.attention.head_count"),
    ("kv-heads-above-heads", _set("llama.attention.head_count_kv", V.UINT32, 18), "llama.attention.head_count_kv"),
    ("hidden-2**62", _set("llama.embedding_length", V.UINT64, 2 ** 62), "llama.embedding_length"),
    ("block-count-string", _set("llama.block_count", V.STRING, "30"), "llama.block_count"),
    ("rope-dim-above-head-dim", _set("llama.rope.dimension_count", V.UINT32, 128), "llama.rope.dimension_count"),
    ("ffn-float-fraction", _set("llama.feed_forward_length", V.FLOAT32, 1536.5), "llama.feed_forward_length"),
    ("alignment-zero", _set("general.alignment", V.UINT32, 0), "general.alignment"),
]


@pytest.fixture(scope="module")
def parts():
    return gguf_kv.read(smollm2_path())


def load(path):
    """What the server does at start: open the model, then build its tokenizer."""
    mf = open_model(path)
    return mf, Tokenizer.from_model_file(mf)


def test_the_untouched_header_loads(parts, tmp_path):
    mf, tok = load(gguf_kv.write(parts, parts.kvs, tmp_path / "same.gguf"))
    assert tok.vocab_size == VOCAB and tok.encode("Hello", add_special_tokens=False) == [19556]


@pytest.mark.parametrize("change,key", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_metadata_is_a_model_format_error_naming_the_key(parts, tmp_path, change, key):
    path = gguf_kv.write(parts, change(parts), tmp_path / "bad.gguf")
    with pytest.raises(ModelFormatError) as e:
        load(path)
    assert str(path) in str(e.value)
    assert repr(key) in str(e.value) or key in str(e.value), e.value


def test_an_unknown_architecture_is_unsupported(parts, tmp_path):
    path = gguf_kv.write(parts, replaced(parts.kvs, "general.architecture", V.STRING, "mamba"), tmp_path / "m.gguf")
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load(path)


def test_the_table_names_every_tokenizer_key_the_loader_reads():
    keys = {c[2] for c in CASES}
    for name in ("model", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "unknown_token_id",
                 "padding_token_id", "eot_token_id", "eom_token_id", "add_bos_token", "add_eos_token", "pre",
                 "scores"):
        assert T + name in keys, name
