"""Short prompt steps on the tensor-core projections (up to dispatch.PROMPT_MMQ_TOKENS: the tail after a
cached prefix, short prompts, a burst of them in one step), padded to a token bucket and replayed
from a CUDA graph, against the same steps on the prefill GEMMs: the same logits and the same K/V
(the next decode step) within fp32-class rounding, and nothing written into the other sequences.
The GEMMs run at split precision (fp32-class) and so keep the buckets to PROMPT_MMQ_TOKENS: with
the fp16 weights kept the buckets stop at PROMPT_MMQ_TOKENS_FP16_KEPT."""

from __future__ import annotations

import numpy as np
import pytest
from support.paging import contiguous_tables

pytestmark = pytest.mark.gpu

PREFIX = 600


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270", "qwen15"])
@pytest.mark.parametrize("tails", [(5,), (16,), (33,), (64,), (7, 20)], ids=lambda t: "+".join(map(str, t)))
def test_short_prompt_step_on_the_tensor_cores_equals_the_gemms(name, tails, rng):
    """Every slot holds the same cached prefix; the tails go in as one step on the tensor cores
    (slots 0..k-1) and, forced, on the split16 GEMMs (slots k..2k-1). Then one decode step of all
    of them reads what each wrote. Logits cosine >= 0.9999 (gemma270: the chaotic twin's median-row
    rule, test_model_parity._assert_parity)."""
    from test_model_parity import TWINS, _assert_parity, _cos, _open

    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded")
    model = _open(path)
    gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=PREFIX + 96,
                                        settings=Settings(self_check=False, gemm_precision="split")))
    fwd = gpu.fwd
    k = len(tails)
    disp = fwd.dispatcher
    if not disp.buckets:
        gpu.close()
        pytest.skip(f"{name}: a projection without tensor-core kernels")
    V = model.config.vocab_size
    prefix = rng.integers(0, V, PREFIX).astype(np.int32)
    tail = [rng.integers(0, V, n).astype(np.int32) for n in tails]
    kind, rows = (lambda s: (s.family, s.rows))(fwd.prompt_step(sum(tails)))
    if kind != "mmq":          # below min_rows: 8 on a model with types only mmq.cu's tiles take
        gpu.close()
        pytest.skip(f"{name}: {sum(tails)} tokens run on the {kind.upper()}s")
    assert sum(tails) <= rows < sum(tails) + 16
    for s in range(2 * k):
        gpu.prefill([PrefillItem(s, prefix)])
    mmq = gpu.prefill([PrefillItem(i, tail[i], PREFIX) for i in range(k)])
    again = gpu.prefill([PrefillItem(i, tail[i], PREFIX) for i in range(k)])     # the graph's replay
    auto = disp.buckets, disp.gemm_min_tokens
    disp.buckets, disp.gemm_min_tokens = (), 1          # every prompt step on the GEMMs
    try:
        assert fwd.prompt_step(sum(tails)).family == "split16"
        gemm = gpu.prefill([PrefillItem(k + i, tail[i], PREFIX) for i in range(k)])
    finally:
        disp.buckets, disp.gemm_min_tokens = auto
    slots = list(range(2 * k))
    tok = [int(t) for t in np.argmax(gemm, axis=1)] * 2
    pos = [PREFIX + n for n in tails] * 2
    step = gpu.decode(slots, tok, pos)
    captured = gpu.prefill_graphs.captures
    gpu.close()
    assert np.all(np.isfinite(mmq)) and np.all(np.isfinite(step))
    assert np.array_equal(mmq, again), f"replay differs from the eager step by {np.abs(mmq - again).max()}"
    assert captured >= 1
    c_pre, c_dec = _cos(mmq, gemm), _cos(step[:k], step[k:])
    print(f"{name} tails {tails} ({rows} rows): prompt cos {' '.join(f'{c:.7f}' for c in c_pre)}; "
          f"next step {' '.join(f'{c:.7f}' for c in c_dec)}; max abs logit diff {np.abs(mmq - gemm).max():.2e}")
    _assert_parity(name, np.concatenate([c_pre, c_dec]), 0.9999)
