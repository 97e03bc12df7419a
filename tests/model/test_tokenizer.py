"""The tokenizer built from GGUF metadata gives the ids transformers gives for the same file, and
decodes them back. Fast tests use the default SmolLM2; comparisons with transformers and the
other real models are marked slow."""

from __future__ import annotations

import dataclasses

import pytest

from realizar_backend.errors import ContextOverflowError, RequestError, UnsupportedModelError
from realizar_backend.model.tokenizer import Tokenizer
from support.tokenizer_corpus import CORPUS, MODELS, ours, reference, reference_smollm_fixed


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 200
    assert len(set(CORPUS)) > 0.9 * len(CORPUS)


# ---------------------------------------------------------------- fast: SmolLM2, no transformers
@pytest.fixture(scope="module")
def smol():
    return ours("smol135")


def test_smol_basic_properties(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1 and smol.eos_id == 2
    assert not smol.add_bos          # SmolLM2's GGUF says add_bos_token = false
    # <|im_end|> (eos) and <|endoftext|> both end generation
    assert {smol.encode("<|im_end|>")[0], smol.encode("<|endoftext|>")[0]} <= smol.stop_ids
    assert smol.has_chat_template


def test_encode_with_a_limit(smol):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    n = len(smol.encode(text))
    assert smol.encode(text, limit=n) == smol.encode(text)
    with pytest.raises(ContextOverflowError, match=f"has {n} tokens"):
        smol.encode(text, limit=n - 1)
    # far beyond any limit: refused from its length alone, without tokenizing
    with pytest.raises(ContextOverflowError, match="far beyond"):
        smol.encode("a" * 10_000_000, limit=512)


def test_a_lone_surrogate_is_a_request_error(smol):
    with pytest.raises(RequestError) as e:
        smol.encode("abc\ud800def")
    assert e.value.code == "invalid_unicode"


def test_special_tokens_are_single_ids(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == smol.bos_id and ids[-1] == smol.eos_id
    assert smol.decode(ids) == "user\nhi"                              # specials skipped
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_smollm_isolates_digits(smol):
    # SmolLM2's vocabulary was trained with every digit its own pre-token (llama.cpp "smollm")
    assert [smol.token_text(i) for i in smol.encode("a  12")] == ["a", "  ", "1", "2"]


@pytest.mark.parametrize("text", CORPUS)
def test_smol_round_trip(smol, text):
    ids = smol.encode(text)
    assert all(0 <= i < smol.vocab_size for i in ids)
    assert smol.decode(ids, skip_special_tokens=False) == text       # byte-level BPE is lossless


def test_token_text_joins_to_decode(smol):
    text = "Hello, world! don't 123 中文"
    ids = smol.encode(text)
    assert "".join(smol.token_text(i) for i in ids) == text


def test_unknown_tokenizer_type_is_unsupported(smol_model):
    md = dict(smol_model.metadata, **{"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(UnsupportedModelError, match="rwkv"):
        Tokenizer.from_model_file(dataclasses.replace(smol_model, metadata=md))


def test_no_tokenizer_is_unsupported(smol_model):
    md = {k: v for k, v in smol_model.metadata.items() if not k.startswith("tokenizer.")}
    with pytest.raises(UnsupportedModelError):
        Tokenizer.from_model_file(dataclasses.replace(smol_model, metadata=md))


def test_directory_without_tokenizer_json_is_unsupported(tmp_path, smol_model):
    mf = dataclasses.replace(smol_model, format="safetensors", path=tmp_path, tokenizer_json=None)
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        Tokenizer.from_model_file(mf)


def test_from_tokenizer_json_directory(tmp_path, smol_model, smol):
    """A safetensors directory's tokenizer.json: the same vocabulary saved by `tokenizers` loads
    back to the same ids, with BOS/EOS and the chat template from tokenizer_config."""
    smol._tk.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
           "chat_template": smol.chat_template, "add_bos_token": False}
    mf = dataclasses.replace(smol_model, format="safetensors", path=tmp_path,
                             tokenizer_json=tmp_path / "tokenizer.json", tokenizer_config=cfg)
    tok = Tokenizer.from_model_file(mf)
    assert tok.bos_id == smol.bos_id and tok.eos_id == smol.eos_id and tok.eos_id in tok.stop_ids
    for text in CORPUS[:80]:
        assert tok.encode(text) == smol.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == smol.apply_chat_template(msgs)
    # without token names in tokenizer_config, the ids config.json gave (in metadata) are used
    bare = Tokenizer.from_model_file(dataclasses.replace(mf, tokenizer_config={}))
    assert bare.eos_id == smol.eos_id and bare.special_tokens["eos_token"] == "<|im_end|>"


# ---------------------------------------------------------------- slow: against transformers
def _reference_for(name: str):
    return reference_smollm_fixed() if name == "smol135" else reference(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_ids_equal_transformers(name):
    tok, ref = ours(name), _reference_for(name)
    assert tok.vocab_size == len(ref)
    assert tok.bos_id == ref.bos_token_id and tok.eos_id == ref.eos_token_id
    bad = []
    for text in CORPUS:
        for special in (True, False):
            got, want = tok.encode(text, add_special_tokens=special), ref.encode(text, add_special_tokens=special)
            if got != want:
                bad.append((text, special, got, want))
    assert not bad, f"{len(bad)} of {2 * len(CORPUS)} differ; first: {bad[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_decode_equals_transformers(name):
    tok, ref = ours(name), _reference_for(name)
    for text in CORPUS:
        ids = ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_round_trip(name):
    tok = ours(name)
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        # SentencePiece spells a space as U+2581, so a literal U+2581 comes back as a space
        want = text.replace("\u2581", " ") if tok._spm_pieces else text
        assert tok.decode(ids, skip_special_tokens=False) == want, text


@pytest.mark.slow
def test_smollm_transformers_gap_is_only_digits_after_spaces():
    """Against transformers' SmolLM2 tokenizer as it loads from the GGUF (no digit isolation), the
    only differences are strings where a digit follows whitespace or another digit run boundary."""
    tok, ref = ours("smol135"), reference("smol135")
    differ = [t for t in CORPUS if tok.encode(t) != ref.encode(t)]
    assert all(any(c.isdigit() or c.isnumeric() for c in t) for t in differ), differ
    assert tok.encode("a  1") != ref.encode("a  1")   # the known gap, so this test notices a fix


@pytest.mark.slow
def test_gemma_properties():
    tok, ref = ours("gemma270"), reference("gemma270")
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id == ref.bos_token_id
    assert tok.encode("<start_of_turn>", add_special_tokens=False) == [ref.convert_tokens_to_ids("<start_of_turn>")]
    assert {tok.eos_id, ref.convert_tokens_to_ids("<end_of_turn>")} <= tok.stop_ids
    assert tok.token_text(ref.convert_tokens_to_ids("\u2581Hello")) == " Hello"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen05", "qwen15"])
def test_qwen_stop_ids(name):
    tok, ref = ours(name), reference(name)
    assert {ref.convert_tokens_to_ids("<|im_end|>"), ref.convert_tokens_to_ids("<|endoftext|>")} <= tok.stop_ids
    assert tok.encode("<tool_call>", add_special_tokens=False) == [ref.convert_tokens_to_ids("<tool_call>")]


def test_the_tokens_to_respell_are_those_outside_the_byte_alphabet():
    # the vocabulary is respelled only when one pass finds a character outside GPT-2's byte
    # alphabet: that pass must see exactly the alphabet the byte-level tokenizer is written in
    from realizar_backend.model.tokenizer import _outside_alphabet, bytes_to_unicode
    alphabet = set(bytes_to_unicode().values())
    for code in range(0x3000):
        c = chr(code)
        assert _outside_alphabet(["Ġthe", c, "ab"]) == (c not in alphabet), hex(code)
    assert not _outside_alphabet(sorted(alphabet)) and _outside_alphabet(["<|im_start|>", "✓"])
