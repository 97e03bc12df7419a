"""A tiny random qwen35 (Qwen3.5 / 3.6 hybrid) carrying the real Qwen3.6 tokenizer and chat
template, for the thinking-mode tests (CPU): `write_qwen35_model(path)`.

The tokenizer (248,320 tokens; `<think>`, `</think>`, `<tool_call>` user-defined tokens) and the
template come from the twin header shared/models/qwen36.head.gz (a gzipped head of the real
Qwen3.6-27B GGUF, found above the checkout: `qwen36_head()`, None when it is not there); the
weights are random, in the layout llama.cpp's converter writes for qwen35 (that of
tests/support/hf_oracle.py's tiny qwen3_5): three Gated DeltaNet layers then one gated attention
layer, hidden size 64, tied embeddings stored F16 so that the vocabulary-sized matrix stays ~32 MB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from support import gguf_kv

HIDDEN, FFN, LAYERS, INTERVAL = 64, 128, 4, 4          # every INTERVAL-th layer is full attention
HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM = 4, 2, 256, 64      # the attention layer: RoPE over a quarter
K_HEADS, V_HEADS, SSM_DIM, CONV = 2, 4, 32, 4            # the DeltaNet layers: key/value heads of SSM_DIM


def qwen36_head(name: str = "qwen36") -> Path | None:
    """shared/models/NAME.head.gz (qwen36: Qwen3.6-27B's; qwen36moe: Qwen3.6-35B-A3B's), or None."""
    return gguf_kv.shared_head(name)


def write_qwen35_model(path: str | Path, context_length: int = 4096, seed: int = 0) -> Path:
    recurrent = [(i + 1) % INTERVAL != 0 for i in range(LAYERS)]
    a = "qwen35"
    w, kvs, n_vocab = gguf_kv.tiny_writer(path, "qwen36", a, layers=LAYERS, context_length=context_length,
                                          hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    for key, val in [(f"{a}.ssm.conv_kernel", CONV), (f"{a}.ssm.state_size", SSM_DIM),
                     (f"{a}.ssm.group_count", K_HEADS), (f"{a}.ssm.time_step_rank", V_HEADS),
                     (f"{a}.ssm.inner_size", V_HEADS * SSM_DIM), (f"{a}.full_attention_interval", INTERVAL),
                     (f"{a}.rope.dimension_count", ROPE_DIM), ("general.file_type", 1)]:
        w.add_uint32(key, val)
    w.add_float32(f"{a}.rope.freq_base", 10000000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_array(f"{a}.attention.recurrent_layers", recurrent)

    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float | None = None) -> None:
        # numpy shapes are the GGUF shape reversed (rows first here); matrices scaled by 1/sqrt(inputs)
        s = scale if scale is not None else shape[-1] ** -0.5
        w.add_tensor(name, (rng.standard_normal(shape) * s).astype(np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, HIDDEN)).astype(np.float16))
    ones("output_norm.weight", HIDDEN)
    conv_channels = 2 * K_HEADS * SSM_DIM + V_HEADS * SSM_DIM
    for i in range(LAYERS):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", HIDDEN)
        ones(b + "post_attention_norm.weight", HIDDEN)
        t(b + "ffn_gate.weight", FFN, HIDDEN)
        t(b + "ffn_up.weight", FFN, HIDDEN)
        t(b + "ffn_down.weight", HIDDEN, FFN)
        if recurrent[i]:
            w.add_tensor(b + "ssm_a", -np.exp(rng.standard_normal(V_HEADS) * 0.5).astype(np.float32))
            t(b + "ssm_conv1d.weight", conv_channels, CONV, scale=0.5)
            t(b + "ssm_dt.bias", V_HEADS, scale=0.5)
            t(b + "ssm_alpha.weight", V_HEADS, HIDDEN)
            t(b + "ssm_beta.weight", V_HEADS, HIDDEN)
            t(b + "attn_qkv.weight", conv_channels, HIDDEN)
            t(b + "attn_gate.weight", V_HEADS * SSM_DIM, HIDDEN)
            ones(b + "ssm_norm.weight", SSM_DIM)
            t(b + "ssm_out.weight", HIDDEN, V_HEADS * SSM_DIM)
        else:
            ones(b + "attn_q_norm.weight", HEAD_DIM)
            ones(b + "attn_k_norm.weight", HEAD_DIM)
            t(b + "attn_q.weight", 2 * HEADS * HEAD_DIM, HIDDEN)          # the query and its gate
            t(b + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
            t(b + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
            t(b + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
    gguf_kv.finish(w, kvs)
    return Path(path)
