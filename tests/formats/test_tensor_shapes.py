"""Every tensor a model reads has the shape its metadata implies, checked at load (validate_model
in formats/gguf.py): a file that disagrees gets a ModelFormatError naming the tensor, its shape
and the implied one, never a shape error in a forward pass or an out-of-bounds read on the GPU.
The newer architectures' tensors (Gated DeltaNet, shared experts, gpt-oss's sinks and biases,
MXFP4 experts) on tiny files of tests/support/arch_models.py, and the real files' tensor tables
(the shared/models twin headers) pass the same table."""

from __future__ import annotations

import numpy as np
import pytest

from support import arch_models as am
from support import gguf_kv
from support.paging import contiguous_tables
from realizar_backend.backends.base import PrefillItem
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.errors import ModelFormatError
from realizar_backend.formats import open_model

H, E, F, S = am.HIDDEN, am.EXPERTS, am.EXPERT_FFN, am.SHARED_FFN
C = 2 * am.K_HEADS * am.K_DIM + am.V_HEADS * am.V_DIM          # the DeltaNet's mixed q|k|v channels
VD = am.V_HEADS * am.V_DIM


@pytest.mark.parametrize("arch", am.ARCHS)
def test_tiny_files_load_and_run(tmp_path, arch):
    """The untouched files pass the table and run a step: the table asks no more than the model reads."""
    mf = open_model(am.write_arch_gguf(tmp_path / "m.gguf", arch).path)
    assert mf.config.arch == arch
    be = contiguous_tables(CPUBackend(mf, max_slots=1, max_context=32))
    logits = be.prefill([PrefillItem(0, np.arange(3, 10), 0)])
    assert logits.shape[-1] == mf.config.vocab_size and np.isfinite(logits).all()
    be.close()


# (arch, tensor, the wrong shape written, the shape the metadata implies)
WRONG = [
    # Gated DeltaNet: a conv kernel wider than ssm.conv_kernel, and channels not the q|k|v mix
    ("qwen35", "blk.0.ssm_conv1d.weight", (C, am.CONV + 1), (C, am.CONV)),
    ("qwen35", "blk.1.ssm_conv1d.weight", (C + 16, am.CONV), (C, am.CONV)),
    ("qwen35", "blk.0.attn_qkv.weight", (C - 16, H), (C, H)),
    ("qwen35", "blk.2.attn_gate.weight", (VD + 16, H), (VD, H)),
    ("qwen35", "blk.0.ssm_alpha.weight", (am.V_HEADS + 1, H), (am.V_HEADS, H)),
    ("qwen35", "blk.1.ssm_beta.weight", (am.V_HEADS, H + 8), (am.V_HEADS, H)),
    ("qwen35", "blk.0.ssm_a", (am.V_HEADS * 2,), (am.V_HEADS,)),
    ("qwen35", "blk.2.ssm_dt.bias", (am.V_HEADS - 1,), (am.V_HEADS,)),
    ("qwen35", "blk.0.ssm_norm.weight", (VD,), (am.V_DIM,)),
    ("qwen35", "blk.1.ssm_out.weight", (H, VD + 16), (H, VD)),
    # the gated attention layer: its q projection carries a gate per head
    ("qwen35", "blk.3.attn_q.weight", (am.HEADS * am.HEAD_DIM, H), (2 * am.HEADS * am.HEAD_DIM, H)),
    ("qwen35moe", "blk.0.ssm_conv1d.weight", (C, am.CONV - 1), (C, am.CONV)),
    # the shared expert and its gate
    ("qwen35moe", "blk.0.ffn_gate_shexp.weight", (S + 16, H), (S, H)),
    ("qwen35moe", "blk.1.ffn_up_shexp.weight", (S, H + 16), (S, H)),
    ("qwen35moe", "blk.3.ffn_down_shexp.weight", (H, S - 16), (H, S)),
    ("qwen35moe", "blk.2.ffn_gate_inp_shexp.weight", (2, H), (1, H)),
    ("qwen35moe", "blk.0.ffn_gate_exps.weight", (E, F + 16, H), (E, F, H)),
    # gpt-oss: sinks, the output projection's bias, the router's bias, the experts' biases, MXFP4 experts
    ("gpt-oss", "blk.0.attn_sinks.weight", (am.HEADS + 1,), (am.HEADS,)),
    ("gpt-oss", "blk.1.attn_output.bias", (H + 8,), (H,)),
    ("gpt-oss", "blk.0.ffn_gate_inp.bias", (E + 1,), (E,)),
    ("gpt-oss", "blk.0.ffn_gate_exps.bias", (E, F + 8), (E, F)),
    ("gpt-oss", "blk.1.ffn_up_exps.bias", (E - 1, F), (E, F)),
    ("gpt-oss", "blk.0.ffn_down_exps.bias", (E, F), (E, H)),
    ("gpt-oss", "blk.1.ffn_down_exps.weight", (E, H, F + 32), (E, H, F)),
    ("gpt-oss", "blk.0.attn_q.bias", (am.HEADS * am.HEAD_DIM + 4,), (am.HEADS * am.HEAD_DIM,)),
]


@pytest.mark.parametrize("arch,tensor,shape,implied", WRONG, ids=[f"{w[0]}-{w[1]}" for w in WRONG])
def test_a_tensor_of_the_wrong_shape_is_a_typed_error_at_load(tmp_path, arch, tensor, shape, implied):
    bad = (0.1 * np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
    path = am.write_arch_gguf(tmp_path / "m.gguf", arch, replace={tensor: bad}).path
    with pytest.raises(ModelFormatError) as info:
        open_model(path)
    assert f"tensor {tensor!r} has shape {list(shape)} but the metadata implies {list(implied)}" in str(info.value)
    assert str(path) in str(info.value)


def test_a_conv_kernel_the_metadata_does_not_give_is_a_typed_error(tmp_path):
    """The conv state is sized by ssm.conv_kernel: a file whose taps disagree fails at load."""
    m = am.write_arch_gguf(tmp_path / "m.gguf", "qwen35")
    m2 = am.synth.write_gguf(tmp_path / "k.gguf", "qwen35", weights=m.source, **_rewrite(m, {
        "qwen35.ssm.conv_kernel": am.CONV - 1}))
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.ssm_conv1d\.weight' has shape \[\d+, 4\] but the "
                                               r"metadata implies \[\d+, 3\]"):
        open_model(m2.path)


def _rewrite(m, metadata: dict) -> dict:
    """write_gguf's arguments for m again, its metadata changed."""
    d = dict(m.dims)
    return dict(extra_metadata={**am.arch_metadata(m.arch), **metadata}, qtypes=m.qtypes, context_length=128,
                **{k: d[k] for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab")})


@pytest.mark.parametrize("arch,dropped", [
    ("qwen35", "blk.0.ssm_out.weight"), ("qwen35", "blk.2.ssm_conv1d.weight"), ("qwen35", "blk.1.ssm_a"),
    ("qwen35", "blk.3.attn_q_norm.weight"), ("qwen35", "blk.3.attn_k.weight"),
    ("qwen35moe", "blk.1.attn_gate.weight"), ("qwen35moe", "blk.3.attn_output.weight"),
])
def test_each_layer_kind_requires_its_own_tensors(tmp_path, arch, dropped):
    """A DeltaNet layer needs its ssm_* tensors and a gated attention layer its attention ones (and
    neither the other's: the untouched files, whose layers have only their own, load)."""
    path = am.write_arch_gguf(tmp_path / "m.gguf", arch, drop_tensors=(dropped,)).path
    with pytest.raises(ModelFormatError, match=f"'{dropped}'"):
        open_model(path)


def test_a_partial_shared_expert_is_a_typed_error(tmp_path):
    path = am.write_arch_gguf(tmp_path / "m.gguf", "qwen35moe", drop_tensors=("blk.2.ffn_up_shexp.weight",)).path
    with pytest.raises(ModelFormatError, match="layer 2 has a partial shared expert"):
        open_model(path)


def test_a_shared_expert_without_its_width_in_the_metadata_agrees_with_itself(tmp_path):
    """No expert_shared_feed_forward_length: the gate's rows are the width, the others must agree."""
    m = am.write_arch_gguf(tmp_path / "m.gguf", "qwen35moe")
    kw = _rewrite(m, {})
    kw["skip_metadata"] = ("qwen35moe.expert_shared_feed_forward_length",)
    ok = am.synth.write_gguf(tmp_path / "ok.gguf", "qwen35moe", weights=m.source, **kw)
    assert open_model(ok.path).config.shared_expert_ffn_dim == 0
    bad = dict(m.source, **{"blk.1.ffn_down_shexp.weight": np.zeros((H, S + 16), np.float32)})
    worse = am.synth.write_gguf(tmp_path / "bad.gguf", "qwen35moe", weights=bad, **kw)
    with pytest.raises(ModelFormatError, match=rf"'blk\.1\.ffn_down_shexp\.weight' has shape \[{H}, {S + 16}\] "
                                               rf"but the metadata implies \[{H}, {S}\]"):
        open_model(worse.path)


# ------------------------------------------------------------------ the real files' tensor tables

def _twin(tmp_path, name: str, kvs_edit=None):
    """The real file `name`'s header over a sparse data region of its real size (gguf_kv.header_twin)."""
    path = gguf_kv.header_twin(name, tmp_path, kvs_edit)
    if path is None:
        pytest.skip(f"shared/models/{name}.head.gz is not here")
    return path


@pytest.mark.parametrize("name,arch", [("qwen36", "qwen35"), ("gptoss20", "gpt-oss")])
def test_real_tensor_tables_pass(tmp_path, name, arch):
    """Qwen3.6-27B's and gpt-oss-20b's tensors (as llama.cpp's converter writes them) have the
    shapes the table implies."""
    mf = open_model(_twin(tmp_path, name))
    assert mf.config.arch == arch


def test_real_qwen36moe_header_opens_as_it_is(tmp_path):
    """Qwen3.6-35B-A3B's file as published: its tensors (shared expert included) pass, and with no
    qwen35moe.feed_forward_length (no dense FFN) its FFN width is its widest expert's."""
    c = open_model(_twin(tmp_path, "qwen36moe")).config
    assert c.arch == "qwen35moe" and c.shared_expert_ffn_dim > 0 and c.n_experts > 1
    assert c.ffn_dim == max(c.expert_ffn_dim, c.shared_expert_ffn_dim)
