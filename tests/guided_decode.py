"""Constrained decoding driven by hand, the way the engine drives it: a Guide's mask on the host
sampler's first token (prefill logits), then every decode step sampled by the backend with the
row's mask (the CPU backend's twin of the GPU kernels). For tests on real models."""

from __future__ import annotations

import functools
import time

import numpy as np

from realizar_backend.backends.base import PrefillItem
from realizar_backend.engine.sampling import Sampler, SamplingParams


@functools.lru_cache(maxsize=None)
def qwen05_cpu():
    """(CPU backend, tokenizer, guidance) for the real Qwen2.5-Coder-0.5B, once per process."""
    from real_models import real_model

    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.engine.guidance import Guidance
    from realizar_backend.formats import open_model
    from realizar_backend.model.tokenizer import Tokenizer
    mf = open_model(real_model("qwen05"))
    tok = Tokenizer.from_model_file(mf)
    return CPUBackend(mf, max_slots=1, max_context=1024), tok, Guidance(tok, mf.config.vocab_size)


def generate(backend, tokenizer, guidance, prompt_ids, constraint=None, max_tokens=64, **sampling):
    """Token ids of one reply (the stop token not included) and why it ended: "stop" (a stop
    token, or the grammar complete), "length"."""
    vocab = backend.config.vocab_size
    sampler = Sampler(SamplingParams(**sampling).validate(vocab), list(prompt_ids), vocab)
    guide = guidance.guide(constraint) if constraint is not None else None
    slot = 0
    t0 = time.perf_counter()
    logits = backend.prefill([PrefillItem(slot, np.asarray(prompt_ids, np.int32))])[0]
    tok = sampler.sample(logits, mask=guide.compute_mask() if guide else None)
    out, reason = [], "length"
    try:
        while True:
            if guide is not None:
                assert guide.consume(tok), guide.error      # the mask allowed it
            if tok in tokenizer.stop_ids:
                reason = "stop"
                break
            out.append(tok)
            if guide is not None and guide.finished:
                reason = "stop"
                break
            if len(out) >= max_tokens:
                break
            row = sampler.row(step=len(out), mask=guide.compute_mask() if guide else None)
            res = backend.decode_sample([slot], [tok], [len(prompt_ids) + len(out) - 1], [row])
            tok = int(res.tokens[0])
    finally:
        backend.release(slot)
    print(f"generated {len(out)} tokens after a {len(prompt_ids)}-token prompt in {time.perf_counter() - t0:.1f} s")
    return out, reason


def chat_ids(tokenizer, messages, **template_kwargs):
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs),
                            add_special_tokens=False)
