"""Decode steps of many sequences at once (buckets of 4-8+ rows: the tensor-core matrix multiply;
64+: the split16 GEMMs; both forced at 32 rows here) against the NumPy oracle, and each row of a
batch against the same sequence decoded alone (batch 1: the GEMVs)."""

from __future__ import annotations

import numpy as np
import pytest
from support.paging import contiguous_tables
from support.parity import CHAOTIC_MEDIAN, CHAOTIC_MEDIAN_FP16
from support.steps import greedy_step
from test_model_parity import COS_MIN, TWINS, _assert_parity, _cos, _open, _real_smol

pytestmark = pytest.mark.gpu

ROWS = 20          # a bucket of 32: 12 padded rows ride along on the scratch slot


def _force(gpu, family: str):
    """Decode steps of 8+ rows run in `family` (the dispatcher's choice for those rows replaced
    before any graph is captured), so both batched families are checked at the same rows."""
    from realizar_backend.backends.cuda.dispatch import Step
    disp = gpu.fwd.dispatcher
    own = disp.decode_step
    disp.decode_step = lambda b: Step(family, b) if b >= 8 else own(b)
    return gpu


def _model(name):
    path = _real_smol() if name == "real" else TWINS / f"{name}.gguf"
    if path is None or not path.exists():
        pytest.skip(f"{name} not on this machine")
    return _open(path)


@pytest.mark.parametrize("mode", ["mmq", "split16"])
@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270", "qwen15", "real"])
def test_batched_rows_match_the_oracle(name, mode, rng):
    """ROWS sequences of different lengths decode together for a few steps; every row's logits
    stay at the parity bar against the oracle fed the same tokens."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model(name)
    ctx = 96
    cpu = contiguous_tables(CPUBackend(model, max_slots=ROWS, max_context=ctx, kv_dtype=np.float16))
    gpu = contiguous_tables(_force(CUDABackend(model, max_slots=ROWS, max_context=ctx,
                                               settings=Settings(self_check=False, prefill_weight_cache="on",
                                                                 gemm_precision="split")), mode))
    assert gpu.fwd.dispatcher.decode_step(32).family == mode
    V = model.config.vocab_size
    lens = [int(n) for n in rng.integers(3, 40, ROWS)]
    items = [PrefillItem(s, rng.integers(0, V, n).astype(np.int32)) for s, n in enumerate(lens)]
    lc = cpu.prefill(items)
    gpu.prefill(items)
    slots, pos, rows = list(range(ROWS)), list(lens), []
    for _ in range(4):
        tok = [int(t) for t in np.argmax(lc, axis=1)]
        lc = cpu.decode(slots, tok, pos)
        lg = gpu.decode(slots, tok, pos)
        rows.append(_cos(lc, lg))
        pos = [p + 1 for p in pos]
    st = gpu.stats()
    gpu.close()
    cos = np.concatenate(rows)
    print(f"{name} [{mode}] {ROWS} rows: decode cos min {cos.min():.6f} median {np.median(cos):.7f}; "
          f"graphs {st['graph_status']}")
    # the prompts (and the split16 steps) round their GEMM inputs to fp16 (Settings.gemm_precision's default)
    _assert_parity(name, cos, COS_MIN, chaotic_median=CHAOTIC_MEDIAN_FP16)
    # the bucket of 32 replays a captured graph on either path (split16's cuBLAS calls: blas.py)
    assert any(k.startswith("32") and v == "captured" for k, v in st["graph_status"].items()), st["graph_status"]


@pytest.mark.parametrize("mode", ["mmq", "split16"])
def test_batched_greedy_equals_single_stream_on_real_smollm2(mode, rng):
    """Each row of a greedy batch gives the tokens the same prompt gives decoded alone, except
    after a step whose top two logits (of the lone run) are within 0.01: there either is right.
    The GEMMs at fp32-class precision (gemm_precision split): the packed prompts and the lone ones
    take different families of step, and fp16 GEMMs' logits differ from the tensor-core tiles' by
    about the tie bar (a first token flipped at a gap of 0.0102)."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model("real")
    n, steps, ctx = 24, 24, 128
    gpu = contiguous_tables(_force(CUDABackend(model, max_slots=n, max_context=ctx,
                                               settings=Settings(self_check=False, prefill_weight_cache="on",
                                                                 gemm_precision="split")), mode))
    prompts = [rng.integers(0, 2000, int(k)).astype(np.int32) for k in rng.integers(4, 30, n)]
    first = gpu.prefill([PrefillItem(s, p) for s, p in enumerate(prompts)]).argmax(-1)
    slots = list(range(n))
    toks, pos, batch = [int(t) for t in first], [len(p) for p in prompts], [[int(t)] for t in first]
    for _ in range(steps):
        toks = greedy_step(gpu, slots, toks, pos).tolist()
        pos = [p + 1 for p in pos]
        for s in slots:
            batch[s].append(toks[s])
    compared = forks = 0
    for s, p in enumerate(prompts):
        lg = gpu.prefill([PrefillItem(s, p)])[0]            # the slot again, alone
        alone = []
        for i in range(steps + 1):
            if i:
                lg = gpu.decode([s], [alone[-1]], [len(p) + i - 1])[0]      # bucket 1: the GEMVs
            top2 = np.sort(lg)[-2:]
            alone.append(int(np.argmax(lg)))
            near_tie = top2[1] - top2[0] < 0.01
            if alone[-1] != batch[s][i]:
                assert near_tie, (f"row {s}: batch {batch[s]} != alone {alone} at step {i} "
                                  f"(top-2 gap {top2[1] - top2[0]:.4f})")
            if near_tie:                                     # from here on either fork is right
                forks += 1
                break
            compared += 1
    gpu.close()
    print(f"[{mode}] {n} rows: {compared} greedy tokens compared, {forks} rows stopped at a near tie")
    assert compared >= n * steps // 2                        # the comparison covered most tokens


@pytest.mark.parametrize("precision", ["fp16", "split"])
def test_the_split16_gemms_take_the_wide_steps(precision, rng):
    """The dispatcher: buckets below SPLIT16_MIN_ROWS of the precision (fp16: 17, split: 64) on the
    tensor-core matrix multiplies, from there on the split16 GEMMs (split: paired rows up to 128,
    prefill.cu) where those weights are kept; 130 sequences decoding together (bucket 256,
    captured) stay at the parity bar against the oracle."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.backends.cuda.dispatch import SPLIT16_MIN_ROWS
    from realizar_backend.settings import Settings
    model = _model("qwen05")
    n, ctx = 130, 48
    gpu = contiguous_tables(CUDABackend(model, max_slots=n, max_context=ctx,
                                        settings=Settings(self_check=False, prefill_weight_cache="on",
                                                          gemm_precision=precision)))
    first = SPLIT16_MIN_ROWS[precision]
    assert gpu.fwd.dispatcher.decode_step(first - 1).family == "mmq"
    assert all(gpu.fwd.dispatcher.decode_step(b).family == "split16" for b in (first, 64, 128, 256))
    cpu = contiguous_tables(CPUBackend(model, max_slots=n, max_context=ctx, kv_dtype=np.float16))
    V = model.config.vocab_size
    items = [PrefillItem(s, rng.integers(0, V, int(k)).astype(np.int32)) for s, k in enumerate(rng.integers(2, 20, n))]
    lc = cpu.prefill(items)
    gpu.prefill(items)
    slots, pos, rows = list(range(n)), [len(it.tokens) for it in items], []
    for _ in range(3):
        tok = [int(t) for t in np.argmax(lc, axis=1)]
        lc = cpu.decode(slots, tok, pos)
        rows.append(_cos(lc, gpu.decode(slots, tok, pos)))
        pos = [p + 1 for p in pos]
    st = gpu.stats()["graph_status"]
    gpu.close()
    cos = np.concatenate(rows)
    print(f"qwen05 {precision}, {n} rows: decode cos min {cos.min():.6f}; graphs {st}")
    _assert_parity("qwen05", cos, COS_MIN,
                   chaotic_median=CHAOTIC_MEDIAN_FP16 if precision == "fp16" else CHAOTIC_MEDIAN)
    assert any(k.startswith("256") and v == "captured" for k, v in st.items()), st
