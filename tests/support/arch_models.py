"""Tiny random GGUFs of the architectures beyond the dense ones, with synth's tiny tokenizer (no
real header needed, a few hundred KB each): `write_arch_gguf(path, arch, replace=...)` for
qwen35 (Gated DeltaNet layers and a gated attention layer), qwen35moe (the same with routed
experts and a shared expert) and gpt-oss (sinks, biases, MXFP4 experts). The tensors are in the
layout llama.cpp's converter writes (checked against the real files' tensor tables in
tests/formats/test_tensor_shapes.py); `replace` swaps named tensors for other arrays, to make
a file whose shapes disagree with its metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from support import synth

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 32, 96
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 2, 4, 16, 16, 4          # the DeltaNet layers
EXPERTS, USED, EXPERT_FFN, SHARED_FFN = 4, 2, 32, 48
LAYERS = {"qwen35": 4, "qwen35moe": 4, "gpt-oss": 2}
INTERVAL = 4                                                     # qwen35: layer 3 is full attention
ARCHS = tuple(LAYERS)


def arch_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of a tiny `arch`, canonical names, numpy (rows, cols) order."""
    rng = np.random.default_rng(seed)
    vocab = len(synth.tiny_tokenizer()[0])
    H, q, kv = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def mat(*shape: int, scale: float | None = None) -> np.ndarray:
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    w = {"token_embd.weight": mat(vocab, H, scale=1.0), "output_norm.weight": ones(H)}
    if arch == "gpt-oss":
        w["output.weight"] = mat(vocab, H)
    for i in range(LAYERS[arch]):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = ones(H)
        w[b + "post_attention_norm.weight"] = ones(H)
        if arch == "gpt-oss":
            w.update({b + "attn_q.weight": mat(q, H), b + "attn_q.bias": mat(q, scale=0.1),
                      b + "attn_k.weight": mat(kv, H), b + "attn_k.bias": mat(kv, scale=0.1),
                      b + "attn_v.weight": mat(kv, H), b + "attn_v.bias": mat(kv, scale=0.1),
                      b + "attn_output.weight": mat(H, q), b + "attn_output.bias": mat(H, scale=0.1),
                      b + "attn_sinks.weight": mat(HEADS, scale=0.5)})
        elif (i + 1) % INTERVAL:                                 # a Gated DeltaNet layer
            C, V = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, V_HEADS * V_DIM
            w.update({b + "attn_qkv.weight": mat(C, H), b + "attn_gate.weight": mat(V, H),
                      b + "ssm_beta.weight": mat(V_HEADS, H), b + "ssm_alpha.weight": mat(V_HEADS, H),
                      b + "ssm_conv1d.weight": mat(C, CONV, scale=0.5),
                      b + "ssm_a": -np.exp(mat(V_HEADS, scale=0.5)), b + "ssm_dt.bias": mat(V_HEADS, scale=0.5),
                      b + "ssm_norm.weight": ones(V_DIM), b + "ssm_out.weight": mat(H, V)})
        else:                                                    # gated attention: [query | gate] rows
            w.update({b + "attn_q.weight": mat(2 * q, H), b + "attn_k.weight": mat(kv, H),
                      b + "attn_v.weight": mat(kv, H), b + "attn_output.weight": mat(H, q),
                      b + "attn_q_norm.weight": ones(HEAD_DIM), b + "attn_k_norm.weight": ones(HEAD_DIM)})
        if arch == "qwen35":
            w.update({b + "ffn_gate.weight": mat(FFN, H), b + "ffn_up.weight": mat(FFN, H),
                      b + "ffn_down.weight": mat(H, FFN)})
        else:
            E, F = EXPERTS, EXPERT_FFN
            w.update({b + "ffn_gate_inp.weight": mat(E, H), b + "ffn_gate_exps.weight": mat(E, F, H),
                      b + "ffn_up_exps.weight": mat(E, F, H), b + "ffn_down_exps.weight": mat(E, H, F)})
        if arch == "gpt-oss":
            w.update({b + "ffn_gate_inp.bias": mat(EXPERTS, scale=0.1),
                      b + "ffn_gate_exps.bias": mat(EXPERTS, EXPERT_FFN, scale=0.1),
                      b + "ffn_up_exps.bias": mat(EXPERTS, EXPERT_FFN, scale=0.1),
                      b + "ffn_down_exps.bias": mat(EXPERTS, H, scale=0.1)})
        if arch == "qwen35moe":
            w.update({b + "ffn_gate_shexp.weight": mat(SHARED_FFN, H), b + "ffn_up_shexp.weight": mat(SHARED_FFN, H),
                      b + "ffn_down_shexp.weight": mat(H, SHARED_FFN), b + "ffn_gate_inp_shexp.weight": mat(1, H)})
    return w


def arch_metadata(arch: str) -> dict:
    a = arch + "."
    md: dict = {a + "rope.dimension_count": HEAD_DIM}
    if arch in ("qwen35", "qwen35moe"):
        md.update({a + "rope.dimension_count": HEAD_DIM // 4, a + "full_attention_interval": INTERVAL,
                   a + "ssm.conv_kernel": CONV, a + "ssm.state_size": K_DIM, a + "ssm.group_count": K_HEADS,
                   a + "ssm.time_step_rank": V_HEADS, a + "ssm.inner_size": V_HEADS * V_DIM})
    if arch in ("qwen35moe", "gpt-oss"):
        md.update({a + "expert_count": EXPERTS, a + "expert_used_count": USED,
                   a + "expert_feed_forward_length": EXPERT_FFN})
    if arch == "qwen35moe":
        md[a + "expert_shared_feed_forward_length"] = SHARED_FFN
    if arch == "gpt-oss":
        md.update({a + "attention.sliding_window": 8, a + "rope.scaling.type": "yarn",
                   a + "rope.scaling.factor": 4.0, a + "rope.scaling.original_context_length": 64})
    return md


def _qtype(arch: str, name: str) -> Q | None:
    # gpt-oss's experts MXFP4 as in the real files; every other tensor F32
    return Q.MXFP4 if arch == "gpt-oss" and name.endswith("_exps.weight") else Q.F32


def write_arch_gguf(path: str | Path, arch: str, *, replace: dict[str, np.ndarray] | None = None,
                    drop_tensors: tuple[str, ...] = (), seed: int = 0) -> synth.SynthModel:
    weights = arch_weights(arch, seed)
    weights.update(replace or {})
    dims = dict(n_layers=LAYERS[arch], hidden=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                ffn=FFN, vocab=weights["token_embd.weight"].shape[0])
    return synth.write_gguf(path, arch, weights=weights, extra_metadata=arch_metadata(arch),
                            drop_tensors=drop_tensors, qtypes=lambda n: _qtype(arch, n), context_length=128,
                            **dims)
