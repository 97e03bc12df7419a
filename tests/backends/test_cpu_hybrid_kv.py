"""A hybrid's NumPy backend keeps K and V for its full-attention layers alone (its Gated DeltaNet
layers keep a recurrent state per slot instead): the KV bytes it reports, and the figures its KV
pool is sized and its memory checked by, count those layers (taken from the checkpoint's
config.json, not from our reader); it reports every slot's recurrent state from load, as the GPU
backend does; and its greedy run still matches transformers. The tiny hybrids are
tests/support/hf_oracle.py's (one attention layer of four)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.hf_oracle import assert_greedy_parity, available, reference_model, tiny_gguf
from support.paging import contiguous_tables
from realizar_backend.backends import (CPU_HEADROOM_BYTES, CPU_KV_BYTES, check_cpu_memory, cpu_kv_blocks,
                                      cpu_memory_bytes, host)
from realizar_backend.backends.base import PrefillItem
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.errors import BackendError
from realizar_backend.formats import open_model
from realizar_backend.settings import Settings

pytestmark = pytest.mark.slow

SLOTS, CONTEXT, BLOCK = 3, 128, 16


def kv_bytes_per_token(hf: dict, layers: int) -> int:
    """float32 K and V of `layers` layers for one position."""
    return 2 * layers * hf["num_key_value_heads"] * hf["head_dim"] * 4


def state_bytes_per_sequence(hf: dict) -> int:
    """Per linear-attention layer: the conv's last kernel - 1 inputs of the q|k|v channels and each
    value head's key x value state, float32."""
    channels = 2 * hf["linear_num_key_heads"] * hf["linear_key_head_dim"] + \
        hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    per_layer = (hf["linear_conv_kernel_dim"] - 1) * channels + \
        hf["linear_num_value_heads"] * hf["linear_key_head_dim"] * hf["linear_value_head_dim"]
    return 4 * per_layer * hf["layer_types"].count("linear_attention")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def hybrid(request):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not available(request.param):
        pytest.skip(f"this transformers has no {request.param}")
    path = tiny_gguf(request.param)
    hf = json.loads((path.parent / "hf" / "config.json").read_text())
    return path, hf, open_model(path)


def test_a_hybrid_holds_kv_for_its_attention_layers_alone_and_still_matches_transformers(hybrid, rng):
    path, hf, model = hybrid
    attention = hf["layer_types"].count("full_attention")
    assert 0 < attention < hf["num_hidden_layers"]
    per_token = kv_bytes_per_token(hf, attention)
    be = contiguous_tables(CPUBackend(model, max_slots=SLOTS, max_context=CONTEXT, block_size=BLOCK))
    st = be.stats()
    assert st["kv_pool_bytes"] == be.num_blocks * BLOCK * per_token
    assert st["recurrent_state_bytes"] == SLOTS * state_bytes_per_sequence(hf)    # from load, as on the GPU
    ids = rng.integers(0, hf["vocab_size"], size=24).tolist()
    assert_greedy_parity(reference_model(path), be, ids, label=path.name)
    # each K/V pool it holds is an attention layer's: the run wrote every one of them
    blocks = -(-len(ids) // BLOCK)
    assert len(be.k_pool) == attention
    assert all(np.any(p[:blocks]) for p in be.k_pool + be.v_pool)
    assert be.stats() == st                     # a run allocates nothing more


def test_a_hybrids_kv_pool_is_sized_and_checked_by_its_attention_layers(hybrid, monkeypatch):
    _, hf, model = hybrid
    per_token = kv_bytes_per_token(hf, hf["layer_types"].count("full_attention"))
    assert cpu_memory_bytes(model, 1)[1] == per_token
    # the default pool: what fits in CPU_KV_BYTES (where the slots would take more)
    assert cpu_kv_blocks(model, Settings(block_size=BLOCK), 10 ** 6, CONTEXT) == CPU_KV_BYTES // per_token // BLOCK
    # the memory check counts the recurrent state of every slot beside the weights and the KV pool
    weights, kv = cpu_memory_bytes(model, 1024)
    state = SLOTS * state_bytes_per_sequence(hf)
    monkeypatch.setattr(host, "available_memory", lambda: weights + kv + state)
    with pytest.raises(BackendError) as e:
        check_cpu_memory(model, 1024, SLOTS)
    assert f"of KV cache for 1024 tokens, 0.0 GiB of recurrent state for {SLOTS} sequences)" in str(e.value)
    assert "REALIZAR_MAX_NUM_SEQS" in str(e.value)            # what to lower, the state being per sequence
    monkeypatch.setattr(host, "available_memory", lambda: weights + kv + state + CPU_HEADROOM_BYTES)
    check_cpu_memory(model, 1024, SLOTS)
