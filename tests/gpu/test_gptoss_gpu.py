"""gpt-oss on the GPU: whole tiny gpt-oss models, CUDABackend against the NumPy oracle (CPUBackend):
attention sinks, q/k/v and output-projection biases, the router's bias, the experts' biases and clamped
SwiGLU, YaRN, a sliding window on the even layers, MXFP4 experts.

The models are tests/support/gptoss_models.py's (transformers' own tiny GptOss, converted by llama.cpp's
converter, head size 64): F16 matrices with F32 experts, and MXFP4 experts with 8 q heads per KV head.
This machine cannot make them without transformers and the network: make them where it can
(`python tests/support/gptoss_models.py .device/gptoss`) and point $REALIZAR_GPTOSS_MODELS at that
directory. The kernels' own checks (sinks with outputs poisoned, the experts' biases and activation)
are in test_flash_attention.py, test_kernels.py and test_moe.py."""

from __future__ import annotations

import numpy as np
import pytest

from support.gptoss_models import model_path
from support.steps import greedy_step
from test_model_parity import COS_MIN, _assert_parity, _backends, _cos

pytestmark = pytest.mark.gpu

NEAR_TIE = 1e-3             # a greedy token may differ only where the oracle's top two are this close


@pytest.fixture(scope="module", params=["f16", "mxfp4"])
def gptoss_model(request):
    path = model_path(request.param)
    if path is None:
        pytest.skip(f"tiny gpt-oss {request.param} not made: python tests/support/gptoss_models.py DIR, then "
                    f"REALIZAR_GPTOSS_MODELS=DIR")
    from realizar_backend.formats import open_model
    return request.param, open_model(path)


def test_the_gpu_runs_gptoss_with_the_oracles_yarn(gptoss_model):
    """The GPU takes the model, and every layer's RoPE table on the device holds the cos/sin the NumPy
    backend rotates by (YaRN: the ramp unrounded, mscale on both)."""
    from realizar_backend.backends.cuda.support import refusal
    from realizar_backend.model.math import rope_angles
    name, model = gptoss_model
    c = model.config
    assert refusal(model) is None
    assert c.arch == "gpt-oss" and c.head_dim == 64 and c.activation == "swiglu_oai"
    assert [c.is_sliding(i) for i in range(c.n_layers)] == [True, False] and c.rope_scaling.kind == "yarn"
    ctx = 512
    cpu, gpu = _backends(model, slots=1, ctx=ctx)
    try:
        for li in range(c.n_layers):
            cos, sin = rope_angles(np.arange(ctx), c.rope_dim, c.layer_rope_theta(li), c.layer_rope_scaling(li))
            table = gpu.fwd.rope_tables[li].get()[:ctx]
            assert np.array_equal(table[..., 0], cos) and np.array_equal(table[..., 1], sin), f"layer {li}"
    finally:
        gpu.close()


@pytest.mark.usefixtures("fp32_expert_activations")
def test_model_parity(gptoss_model, rng):
    """Prompt steps on the GEMVs (a few tokens), the tensor-core buckets or GEMVs (six short prompts
    at once) and the split16 GEMMs (100 tokens, then a 300-token chunk after it), decode steps of one
    row and of eight rows on attention.cu (short rows) and on the flash-decoding kernels (a row past
    backend.LONG_ATTENTION_POS), captured in graphs: every row's logits at cosine >= COS_MIN to the
    NumPy backend's; then greedy steps whose tokens (argmax on the device) are the oracle's."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda.backend import LONG_ATTENTION_POS
    name, model = gptoss_model
    cpu, gpu = _backends(model, slots=8, ctx=512)
    assert gpu.fwd.flash, "head size 64: the flash kernels take gpt-oss's attention"
    V = model.config.vocab_size
    lens = [100, 5] + [int(n) for n in rng.integers(3, 12, 6)]
    cos, pos, families = [], [0] * 8, []

    def prompt(items):
        families.append(gpu.fwd.prompt_step(sum(len(it.tokens) for it in items)).family)
        cos.append(_cos(cpu.prefill(items), gpu.prefill(items)))
        for it in items:
            pos[it.slot] = it.start_pos + len(it.tokens)

    def decode(slots, n_steps):
        for _ in range(n_steps):
            tok = [int(t) for t in rng.integers(0, V, len(slots))]
            lc = cpu.decode(slots, tok, [pos[s] for s in slots])
            lg = gpu.decode(slots, tok, [pos[s] for s in slots])
            cos.append(_cos(lc, lg))
            for s in slots:
                pos[s] += 1

    prompt([PrefillItem(1, rng.integers(0, V, lens[1]).astype(np.int32))])
    prompt([PrefillItem(s, rng.integers(0, V, lens[s]).astype(np.int32)) for s in range(2, 8)])
    prompt([PrefillItem(0, rng.integers(0, V, lens[0]).astype(np.int32))])
    decode([1], 3)                                   # short rows: attention.cu
    decode(list(range(8)), 4)
    assert max(pos) < LONG_ATTENTION_POS
    prompt([PrefillItem(0, rng.integers(0, V, 300).astype(np.int32), pos[0])])    # a chunk after the window
    assert pos[0] >= LONG_ATTENTION_POS
    decode([0], 3)                                   # a long row: flash decoding
    decode(list(range(8)), 4)
    # greedy: both fed the oracle's tokens; the device's argmax must pick the oracle's, save at near-ties
    slots, tok, misses = list(range(8)), [1] * 8, []
    for _ in range(4):
        ref = cpu.decode(slots, tok, [pos[s] for s in slots])
        got = greedy_step(gpu, slots, tok, [pos[s] for s in slots])
        top2 = np.sort(ref, axis=1)[:, -2:]
        misses += [(int(g), int(r)) for g, r, gap in zip(got, np.argmax(ref, axis=1), top2[:, 1] - top2[:, 0])
                   if g != r and gap >= NEAR_TIE]
        tok = [int(t) for t in np.argmax(ref, axis=1)]
        for s in slots:
            pos[s] += 1
    st = gpu.stats()
    gpu.close()
    cos = np.concatenate([np.ravel(c) for c in cos])
    print(f"gpt-oss {name}: prompt families {families}, {cos.size} rows, cos min {cos.min():.7f}; "
          f"graphs {st['graph_status']}")
    _assert_parity(f"gptoss-{name}", cos, COS_MIN)
    assert st["graph_status"], "no decode step was captured"
    assert not misses, f"greedy tokens differ from the oracle's (gpu, cpu): {misses}"
