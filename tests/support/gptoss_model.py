"""A tiny random gpt-oss model carrying the real gpt-oss-20b tokenizer and chat template, for the
harmony tests (CPU): `write_gptoss_model(path)`.

The tokenizer (201,088 tokens, its harmony markers special tokens) and the template come from the
twin header shared/models/gptoss20.head.gz (a gzipped head of the real GGUF, found above the
checkout: `gptoss_head()`, None when it is not there); the weights are random, in the layout
llama.cpp's converter writes for gpt-oss (the same as tests/support/hf_oracle.py's gpt_oss): two
layers (sliding then full attention, sinks, biases), four experts of which two are used, hidden
size 32, so the embedding and output matrices (201,088 rows) stay ~26 MB each.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from support import gguf_kv

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, FFN, LAYERS = 32, 2, 1, 16, 4, 2, 16, 2


def gptoss_head() -> Path | None:
    return gguf_kv.shared_head("gptoss20")


def write_gptoss_model(path: str | Path, context_length: int = 4096, seed: int = 0) -> Path:
    a = "gpt-oss"
    w, kvs, n_vocab = gguf_kv.tiny_writer(path, "gptoss20", a, layers=LAYERS, context_length=context_length,
                                          hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    for key, val in [(f"{a}.expert_count", EXPERTS), (f"{a}.expert_used_count", USED),
                     (f"{a}.expert_feed_forward_length", FFN), (f"{a}.attention.sliding_window", 8),
                     (f"{a}.rope.scaling.original_context_length", 4096)]:
        w.add_uint32(key, val)
    for key, val in [(f"{a}.rope.freq_base", 150000.0), (f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
                     (f"{a}.rope.scaling.factor", 32.0), (f"{a}.rope.scaling.yarn_beta_fast", 32.0),
                     (f"{a}.rope.scaling.yarn_beta_slow", 1.0)]:
        w.add_float32(key, val)
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_uint32("general.file_type", 0)

    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        # numpy shapes are the GGUF shape reversed (rows last in GGUF)
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    t("token_embd.weight", n_vocab, HIDDEN, scale=1.0)
    t("output.weight", n_vocab, HIDDEN)
    ones("output_norm.weight", HIDDEN)
    q, kvd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", HIDDEN)
        ones(b + "post_attention_norm.weight", HIDDEN)
        t(b + "attn_q.weight", q, HIDDEN); t(b + "attn_q.bias", q)
        t(b + "attn_k.weight", kvd, HIDDEN); t(b + "attn_k.bias", kvd)
        t(b + "attn_v.weight", kvd, HIDDEN); t(b + "attn_v.bias", kvd)
        t(b + "attn_output.weight", HIDDEN, q); t(b + "attn_output.bias", HIDDEN)
        t(b + "attn_sinks.weight", HEADS)
        t(b + "ffn_gate_inp.weight", EXPERTS, HIDDEN); t(b + "ffn_gate_inp.bias", EXPERTS)
        t(b + "ffn_gate_exps.weight", EXPERTS, FFN, HIDDEN); t(b + "ffn_gate_exps.bias", EXPERTS, FFN)
        t(b + "ffn_up_exps.weight", EXPERTS, FFN, HIDDEN); t(b + "ffn_up_exps.bias", EXPERTS, FFN)
        t(b + "ffn_down_exps.weight", EXPERTS, HIDDEN, FFN); t(b + "ffn_down_exps.bias", EXPERTS, HIDDEN)
    gguf_kv.finish(w, kvs)
    return Path(path)
