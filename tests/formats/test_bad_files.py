"""Bad model files: each one gets a typed error that names the file and says what is wrong.
Every case runs in a forked child with a time limit, so a hang or a crash (segfault, bus
error, runaway allocation) fails the test instead of taking the test run down with it."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

from support import synth
from realizar_backend.errors import ModelFormatError, RealizarError, UnsupportedModelError
from realizar_backend.formats import open_model
from realizar_backend.model.arch import supported_list

MFE, UME = ModelFormatError, UnsupportedModelError
LIMIT_S = 20         # generous for CI; a correct loader answers each case in well under a second


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Valid files the cases copy and damage: a Q4_K qwen2 GGUF and an F32 llama HF directory."""
    d = tmp_path_factory.mktemp("base")
    gguf_model = synth.write_gguf(d / "base.gguf", "qwen2", qtype=Q.Q4_K)
    hf_model = synth.write_gguf(d / "llama.gguf", "llama")
    hf_dir = synth.write_hf_dir(d / "hf", hf_model, shards=2)
    return {"gguf": gguf_model.path, "hf": hf_dir, "hf_model": hf_model}


# ------------------------------------------------------------------ builders: (tmp, base) -> path

def corrupted(kind):
    def build(tmp, base):
        return synth.corrupt(base["gguf"], tmp / f"{kind}.gguf", kind)
    build.kind = kind
    return build


def gguf_with(**kw):
    def build(tmp, base):
        return synth.write_gguf(tmp / "m.gguf", kw.pop("arch", "llama"), **kw).path
    return build


def dims_patch(tensor, value):
    """Rewrite the first dimension of `tensor` in the tensor table."""
    def build(tmp, base):
        p = shutil.copy(base["gguf"], tmp / "m.gguf")
        at = synth._layout(Path(p))["tensors"][tensor]["dims"]
        with open(p, "r+b") as f:
            f.seek(at)
            f.write(struct.pack("<Q", value))
        return Path(p)
    return build


def real_header_only(tmp, base):
    # the first 3 MB of the real SmolLM2: its whole header, then the tensor data stops
    from support.real_models import smollm2_path
    with open(smollm2_path(), "rb") as f:
        (tmp / "smol_cut.gguf").write_bytes(f.read(3 << 20))
    return tmp / "smol_cut.gguf"


def hf(mutate):
    """A copy of the HF directory, changed by `mutate(dir)`."""
    def build(tmp, base):
        d = Path(shutil.copytree(base["hf"], tmp / "hfdir"))
        mutate(d)
        return d
    return build


def _edit_json(d, name, fn):
    p = d / name
    obj = json.loads(p.read_text())
    fn(obj)
    p.write_text(json.dumps(obj))


def _shard_names(d):
    return sorted(p.name for p in d.glob("*.safetensors"))


def _rewrite_shard(d, drop=(), retype=None):
    """Rewrite the shard that holds the tensors named, dropping or re-typing them."""
    from safetensors.numpy import load_file
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = drop[0] if drop else retype[0]
    shard = d / index["weight_map"][name]
    tensors = load_file(str(shard))
    raw = {}
    for n, a in tensors.items():
        if n in drop:
            continue
        if retype and n == retype[0]:
            raw[n] = (retype[1], a.shape, a.astype(retype[2]).tobytes())
        else:
            raw[n] = ("F32", a.shape, a.astype(np.float32).tobytes())
    synth.write_safetensors_raw(shard, raw)
    if drop:
        _edit_json(d, "model.safetensors.index.json",
                   lambda o: [o["weight_map"].pop(n) for n in drop])


def _truncate_shard(d):
    p = d / _shard_names(d)[0]
    p.write_bytes(p.read_bytes()[:-100])


def _garbage_header(d):
    p = d / _shard_names(d)[1]
    p.write_bytes(struct.pack("<Q", 40) + b"{not json at all, really not json!!!!!!}" + b"\0" * 64)


def _single_file_without_index(d):
    for p in d.glob("*.safetensors"):
        p.unlink()
    (d / "model.safetensors.index.json").unlink()


CASES = [
    # id, builder, error type, substring of the message
    ("empty", corrupted("empty"), MFE, "too short to be GGUF"),
    ("wrong-magic", corrupted("magic"), MFE, "not a GGUF file"),
    ("version-1", corrupted("version1"), UME, "GGUF version 1 is not supported; supported: 2, 3"),
    ("version-99", corrupted("version99"), UME, "GGUF version 99"),
    ("big-endian", corrupted("big_endian"), UME, "big-endian"),
    ("truncated-header", corrupted("truncate_header"), MFE, "tokenizer.ggml.tokens"),
    ("truncated-data", corrupted("truncate_data"), MFE, "truncated"),
    ("real-header-only", real_header_only, MFE, "truncated or bad offset"),
    ("offset-past-end", corrupted("tensor_offset_past_end"), MFE, "truncated or bad offset"),
    ("offset-misaligned", corrupted("tensor_offset_misaligned"), MFE, "not a multiple of the alignment 32"),
    ("overlapping-tensors", corrupted("overlapping_tensors"), MFE, "overlap"),
    ("unknown-tensor-type", corrupted("tensor_type_unknown"), MFE, "unknown type id 250"),
    ("unsupported-tensor-type", corrupted("tensor_type_unsupported"), UME, "TQ2_0, which is not supported"),
    ("kv-count-2**60", corrupted("kv_count_huge"), MFE, "metadata kv count is 1152921504606846976, impossible"),
    ("tensor-count-2**60", corrupted("tensor_count_huge"), MFE, "tensor count is 1152921504606846976"),
    ("array-len-2**60", corrupted("array_len_huge"), MFE, "array length of 'tokenizer.ggml.token_type'"),
    ("string-len-2**60", corrupted("string_len_huge"), MFE, "string value of 'general.name'"),
    ("too-many-dims", corrupted("n_dims_huge"), MFE, "9 dimensions"),
    ("unknown-value-type", corrupted("value_type_unknown"), MFE, "unknown value type 77"),
    ("row-not-block-multiple", dims_patch("blk.0.ffn_up.weight", 250), MFE, "not a multiple of the Q4_K block size 256"),
    ("zero-dim", dims_patch("blk.0.attn_norm.weight", 0), MFE, "zero dimension"),
    ("missing-tensor", gguf_with(drop_tensors=("blk.1.ffn_down.weight",)), MFE, "'blk.1.ffn_down.weight'"),
    ("missing-norm", gguf_with(drop_tensors=("output_norm.weight",)), MFE, "'output_norm.weight'"),
    ("shape-vs-metadata", gguf_with(extra_metadata={"llama.feed_forward_length": 384}), MFE,
     "'blk.0.ffn_gate.weight' has shape [512, 256] but the metadata implies [384, 256]"),
    ("vocab-vs-embeddings", gguf_with(tokenizer=False, extra_metadata={"llama.vocab_size": 1000}), MFE,
     "'token_embd.weight' has shape"),
    ("unsupported-arch", gguf_with(extra_metadata={"general.architecture": "mamba"}), UME,
     f"architecture 'mamba' is not supported; supported: {supported_list()}"),
    ("missing-metadata", gguf_with(skip_metadata=("llama.block_count",)), MFE, "'llama.block_count'"),
    ("block-count-10**12", gguf_with(extra_metadata={"llama.block_count": (10 ** 12, V.UINT64)}), MFE,
     "the metadata says 1000000000000 layers"),
    ("block-count-too-small", gguf_with(extra_metadata={"llama.block_count": 1}), MFE,
     "says 1 layers but the tensors describe 2"),
    ("metadata-wrong-type", gguf_with(extra_metadata={"llama.embedding_length": "wide"}), MFE,
     "'llama.embedding_length' should be an integer"),
    ("heads-not-divisible", gguf_with(extra_metadata={"llama.attention.head_count_kv": 3}), MFE,
     "inconsistent dimensions"),
    ("bad-alignment", gguf_with(extra_metadata={"general.alignment": 24}), MFE, "power of two"),
    ("no-such-file", lambda tmp, base: tmp / "nope.gguf", MFE, "no such file"),
    # Hugging Face directories
    ("hf-empty-dir", lambda tmp, base: Path(tmp / "empty").mkdir() or tmp / "empty", MFE, "config.json is missing"),
    ("hf-config-not-json", hf(lambda d: (d / "config.json").write_text("{'hidden_size': 1")), MFE,
     "config.json is not valid JSON"),
    ("hf-config-lacks-field", hf(lambda d: _edit_json(d, "config.json", lambda o: o.pop("hidden_size"))), MFE,
     "hidden_size"),
    ("hf-no-weights", hf(_single_file_without_index), MFE, "no weights: expected model.safetensors"),
    ("hf-missing-shard", hf(lambda d: (d / _shard_names(d)[1]).unlink()), MFE,
     "shard 'model-00002-of-00002.safetensors' named by model.safetensors.index.json is missing"),
    ("hf-bad-index", hf(lambda d: _edit_json(d, "model.safetensors.index.json", lambda o: o.pop("weight_map"))),
     MFE, "bad shard index"),
    ("hf-index-escapes-dir", hf(lambda d: _edit_json(d, "model.safetensors.index.json",
                                                     lambda o: o["weight_map"].update({"x": "../evil.safetensors"}))),
     MFE, "is not a file name"),
    ("hf-truncated-shard", hf(_truncate_shard), MFE, "corrupt safetensors file"),
    ("hf-garbage-header", hf(_garbage_header), MFE, "corrupt safetensors file"),
    ("hf-unsupported-dtype", hf(lambda d: _rewrite_shard(d, retype=("model.layers.0.self_attn.q_proj.weight",
                                                                   "F64", np.float64))),
     UME, "dtype F64, which is not supported; supported: F32, F16, BF16"),
    ("hf-missing-tensor", hf(lambda d: _rewrite_shard(d, drop=("model.layers.1.mlp.down_proj.weight",))), MFE,
     "missing required tensor 'model.layers.1.mlp.down_proj.weight' (blk.1.ffn_down.weight)"),
    ("hf-unknown-arch", hf(lambda d: _edit_json(d, "config.json", lambda o: o.update(
        architectures=["GPT2LMHeadModel"], model_type="gpt2"))), UME, f"is not supported; supported: {supported_list()}"),
    ("hf-gemma3", hf(lambda d: _edit_json(d, "config.json", lambda o: o.update(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text"))), UME, "gemma3 safetensors checkpoints"),
    ("hf-shape-vs-config", hf(lambda d: _edit_json(d, "config.json", lambda o: o.update(intermediate_size=384))),
     MFE, "but the metadata implies [384, 256]"),
    ("hf-untied-without-lm-head", hf(lambda d: _edit_json(d, "config.json", lambda o: o.update(
        tie_word_embeddings=False))), MFE, "no 'lm_head.weight'"),
    ("hf-rope-scaling", hf(lambda d: _edit_json(d, "config.json", lambda o: o.update(
        rope_scaling={"rope_type": "dynamic", "factor": 4.0}))), UME, "RoPE scaling 'dynamic'"),
]


def _child(path: str, conn) -> None:
    try:
        open_model(path)
        conn.send(("ok", "", False))
    except BaseException as e:       # report everything, typed or not, to the parent
        conn.send((type(e).__name__, str(e), isinstance(e, RealizarError)))
    conn.close()


def open_in_child(path: Path) -> tuple[str, str, bool, float]:
    """open_model in a forked child: (error type name, message, is typed, seconds)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(str(path), send))
    t0 = time.monotonic()
    proc.start()
    send.close()
    try:
        if not recv.poll(LIMIT_S):
            proc.kill()
            pytest.fail(f"open_model({path}) still running after {LIMIT_S} s: a hang")
        try:
            result = recv.recv()
        except EOFError:
            proc.join(5)
            pytest.fail(f"open_model({path}) crashed the process (exit code {proc.exitcode})")
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"
    return (*result, time.monotonic() - t0)


@pytest.mark.parametrize("builder,error,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_file_gets_a_typed_error(tmp_path, base, builder, error, needle):
    path = builder(tmp_path, base)
    name, message, typed, seconds = open_in_child(path)
    assert name == error.__name__ and typed, f"expected {error.__name__}, got {name}: {message}"
    assert needle in message
    assert str(path) in message or any(str(p) in message for p in Path(path).glob("*")), \
        f"the message does not name the file: {message}"
    assert seconds < LIMIT_S / 2
    # the same error in this process, as a caller catching it would see it
    with pytest.raises(error) as info:
        open_model(path)
    assert info.value.problem in message


def test_table_is_broad():
    assert len(CASES) >= 12 and {c[2] for c in CASES} == {MFE, UME}
    assert sum(c[0].startswith("hf-") for c in CASES) >= 8


def test_each_corruption_kind_is_covered():
    kinds = {getattr(c[1], "kind", None) for c in CASES} - {None}
    assert kinds == set(synth.CORRUPTIONS)


def test_valid_bases_open(base):
    # the damaged copies differ from these only in the defect
    assert open_model(base["gguf"]).config.arch == "qwen2"
    assert open_model(base["hf"]).config.arch == "llama"
