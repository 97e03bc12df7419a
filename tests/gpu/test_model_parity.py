"""Whole-model parity: the CUDA backend against the NumPy oracle (CPUBackend) on the same model
file. Shape twins of the four real models (expanded by tools/device_check.sh into
$REALIZAR_TWINS, default /tmp/twins) and the real SmolLM2 ($REALIZAR_REAL_SMOL, or the
default model in the model cache)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from support.paging import contiguous_tables
from support.parity import CHAOTIC, CHAOTIC_MEDIAN_FP16, COS_MIN
from support.parity import assert_parity as _assert_parity
from support.parity import cosines as _cos
from support.steps import greedy_step

pytestmark = pytest.mark.gpu

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))
ONE_ROW_STEPS = 16


def _real_smol() -> Path | None:
    p = os.environ.get("REALIZAR_REAL_SMOL")
    if p and Path(p).exists():
        return Path(p)
    try:
        from realizar_backend.model.default import default_model_path
        return default_model_path()
    except Exception:
        return None


def _open(path: Path):
    from realizar_backend.formats import open_model
    return open_model(path)


def _backends(model, slots=2, ctx=256, **gpu_kw):
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    # the oracle stores K/V in fp16 as the GPU does: on the gemma270 twin, rounding K/V to fp16
    # alone moves the oracle's own prompt logits to cosine 0.9972 for some prompts (its attention
    # is nearly one-hot), so a float32-KV oracle would measure the storage format, not the kernels
    cpu = contiguous_tables(CPUBackend(model, max_slots=slots, max_context=ctx, kv_dtype=np.float16))
    gpu = contiguous_tables(CUDABackend(model, max_slots=slots, max_context=ctx,
                                        settings=Settings(self_check=True, **gpu_kw)))
    return cpu, gpu


def _parity(model, rng, steps=64, sensitivity=False, **gpu_kw):
    """64-token prompt (plus a 17-token one in a second slot), then `steps` decode steps of both
    sequences together, each backend fed the CPU's greedy tokens. Returns (prefill cos, decode cos,
    the GPU's stats, and with `sensitivity` the oracle's rows against its own with K/V in fp32, else
    None). Decode cosines come as a flat array (steps of two rows, then of one)."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cpu import CPUBackend
    cpu, gpu = _backends(model, **gpu_kw)
    own = (contiguous_tables(CPUBackend(model, max_slots=2, max_context=256, kv_dtype=np.float32))
           if sensitivity else None)
    V = model.config.vocab_size
    items = [PrefillItem(0, rng.integers(0, V, 64).astype(np.int32)),
             PrefillItem(1, rng.integers(0, V, 17).astype(np.int32))]
    lc, lg = cpu.prefill(items), gpu.prefill(items)
    assert lg.shape == lc.shape and lg.dtype == np.float32
    pre = _cos(lc, lg)
    sens = [_cos(lc, own.prefill(items))] if own else []
    pos = [64, 17]
    dec = []
    for i in range(steps):
        # the last ONE_ROW_STEPS decode the first sequence alone: one-row steps take the GEMVs the
        # dispatcher keeps for them (mmv8.cu on a large enough group of its types)
        slots = [0, 1] if i < steps - ONE_ROW_STEPS else [0]
        tok = [int(t) for t in np.argmax(lc, axis=1)][:len(slots)]
        lc = cpu.decode(slots, tok, pos[:len(slots)])
        lg = gpu.decode(slots, tok, pos[:len(slots)])
        dec.append(_cos(lc, lg))
        if own:
            sens.append(_cos(lc, own.decode(slots, tok, pos[:len(slots)])))
        pos = [p + 1 for p in pos[:len(slots)]] + pos[len(slots):]
    st = gpu.stats()
    gpu.close()
    return pre, np.concatenate(dec), st, (np.concatenate([c.ravel() for c in sens]) if own else None)


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270", "qwen15"])
def test_twin_parity(name, rng):
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded (tools/device_check.sh does it)")
    pre, dec, st, own = _parity(_open(path), rng, sensitivity=name in CHAOTIC)
    print(f"{name}: prefill cos {pre.min():.6f}; decode cos min {dec.min():.6f} "
          f"(one-row steps: {dec[-ONE_ROW_STEPS:].min():.6f}); graphs {st['graph_status']}")
    # both prompts (64 and 17 tokens) run on the kept fp16 weights' GEMMs (Settings.gemm_precision)
    _assert_parity(name, np.concatenate([pre.ravel(), dec.ravel()]), COS_MIN, own, CHAOTIC_MEDIAN_FP16)
    assert st["graph_status"]


def test_mixed_type_groups_parity(tmp_path, rng):
    """A model whose projection groups mix types (a float matrix among quantized ones, gate and up
    of different types, as dynamic quant mixes do): the groups the tensor cores cannot take run on
    the GEMVs matrix by matrix (dispatch.py) in every family of step (1 and 12 rows, a short and a
    long prompt), at the parity bar against the oracle."""
    from gguf import GGMLQuantizationType as Q
    from support.synth import write_gguf
    from realizar_backend.backends.base import PrefillItem
    mixed = {"blk.0.attn_k.weight": Q.F16, "blk.0.ffn_up.weight": Q.Q6_K, "blk.1.attn_output.weight": Q.F32,
             "blk.1.ffn_down.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.Q4_1}
    m = write_gguf(tmp_path / "mixed.gguf", arch="qwen2", qtype=Q.Q4_K, qtypes=mixed, seed=int(rng.integers(1 << 30)),
                   hidden=256, n_heads=4, n_kv_heads=2, ffn=512, context_length=512)
    model = _open(m.path)
    n = 12
    cpu, gpu = _backends(model, slots=n, ctx=256)
    assert not gpu.fwd.dispatcher.mmq_all
    V = model.config.vocab_size
    lens = [100] + [int(k) for k in rng.integers(3, 20, n - 1)]
    items = [PrefillItem(s, rng.integers(0, V, k).astype(np.int32)) for s, k in enumerate(lens)]
    cos = [_cos(cpu.prefill(items[:1]), gpu.prefill(items[:1])), _cos(cpu.prefill(items[1:]), gpu.prefill(items[1:]))]
    tail = [PrefillItem(0, rng.integers(0, V, 5).astype(np.int32), lens[0])]      # a 5-token step: the GEMVs
    cos.append(_cos(cpu.prefill(tail), gpu.prefill(tail)))
    pos = [lens[0] + 5] + lens[1:]
    for rows in (1, n, n):
        slots = list(range(rows))
        tok = [int(t) for t in rng.integers(0, V, rows)]
        cos.append(_cos(cpu.decode(slots, tok, pos[:rows]), gpu.decode(slots, tok, pos[:rows])))
        pos[:rows] = [p + 1 for p in pos[:rows]]
    gpu.close()
    cos = np.concatenate(cos)
    print(f"mixed types: {cos.size} rows, cos min {cos.min():.7f}")
    _assert_parity("mixed", cos, COS_MIN)


# every low-bit type of the GPU's table in one tiny model, by role: each group's matrices share a
# tensor-core kernel but not a type (Q2_K's gate/up group runs on the GEMVs in batched steps)
LOW_BIT = {"attn_q": "IQ4_XS", "attn_k": "Q3_K", "attn_v": "IQ3_S", "attn_output": "MXFP4", "ffn_gate": "IQ2_XXS",
           "ffn_up": "IQ2_XXS", "ffn_down": "IQ2_S", "token_embd": "IQ4_NL", "output": "IQ3_XXS"}


@pytest.mark.parametrize("second", ["IQ2_XS", "Q2_K"], ids=["iq2xs-layer", "q2k-layer"])
def test_low_bit_types_parity(tmp_path, rng, second):
    """A model of the K-quants below 4 bits, the I-quants and MXFP4 (its second layer's FFN in IQ2_XS or
    Q2_K) against the oracle on the same blocks: prompts on the tensor cores and on split16, decode at
    1 row (GEMVs) and 12 (tensor cores; Q2_K on the GEMVs), at the parity bar."""
    from gguf import GGMLQuantizationType as Q
    from support.synth import write_gguf
    from realizar_backend.backends.base import PrefillItem

    def qtype(name: str):                   # matrices by role; norms and biases stay F32
        role = name.split(".")[-2]
        if not name.endswith(".weight") or role not in LOW_BIT:
            return None
        return Q[second] if name.startswith("blk.1.ffn_") else Q[LOW_BIT[role]]
    m = write_gguf(tmp_path / "lowbit.gguf", arch="qwen2", qtypes=qtype, seed=int(rng.integers(1 << 30)), tied=False,
                   hidden=256, n_heads=4, n_kv_heads=2, ffn=512, context_length=512)
    model = _open(m.path)
    assert {model.tensor(n).qtype.name for n in m.source if model.tensor(n).data.ndim == 2} >= {*LOW_BIT.values(), second}
    n = 12
    cpu, gpu = _backends(model, slots=n, ctx=256)
    assert gpu.fwd.dispatcher.mmq_all == (second != "Q2_K")
    V = model.config.vocab_size
    lens = [100] + [int(k) for k in rng.integers(3, 20, n - 1)]
    items = [PrefillItem(s, rng.integers(0, V, k).astype(np.int32)) for s, k in enumerate(lens)]
    cos = [_cos(cpu.prefill(items[:1]), gpu.prefill(items[:1])), _cos(cpu.prefill(items[1:]), gpu.prefill(items[1:]))]
    tail = [PrefillItem(0, rng.integers(0, V, 9).astype(np.int32), lens[0])]      # a 9-token step
    cos.append(_cos(cpu.prefill(tail), gpu.prefill(tail)))
    pos = [lens[0] + 9] + lens[1:]
    for rows in (1, n, n, 4):
        slots = list(range(rows))
        tok = [int(t) for t in rng.integers(0, V, rows)]
        cos.append(_cos(cpu.decode(slots, tok, pos[:rows]), gpu.decode(slots, tok, pos[:rows])))
        pos[:rows] = [p + 1 for p in pos[:rows]]
    gpu.close()
    cos = np.concatenate(cos)
    print(f"low-bit types ({second}): {cos.size} rows, cos min {cos.min():.7f}")
    _assert_parity("lowbit", cos, COS_MIN)


def test_real_smollm2_parity_and_greedy(rng):
    path = _real_smol()
    if path is None:
        pytest.skip("real SmolLM2 not on this machine")
    model = _open(path)
    pre, dec, _, _ = _parity(model, rng)
    print(f"real smol135: prefill cos {pre.min():.6f}; decode cos min {dec.min():.6f}")
    assert pre.min() >= COS_MIN and dec.min() >= COS_MIN
    # greedy, each backend on its own: 32 tokens must agree exactly
    from realizar_backend.backends.base import PrefillItem
    cpu, gpu = _backends(model, slots=1)
    prompt = np.array([1, 9690, 314, 253, 2377, 30, 1073, 314, 260, 3575, 282, 4649, 47], np.int32)
    prompt = prompt[prompt < model.config.vocab_size]
    tc = [int(np.argmax(cpu.prefill([PrefillItem(0, prompt)])[0]))]
    tg = [int(np.argmax(gpu.prefill([PrefillItem(0, prompt)])[0]))]
    for i in range(31):
        p = len(prompt) + i
        tc.append(int(np.argmax(cpu.decode([0], [tc[-1]], [p])[0])))
        tg.append(int(greedy_step(gpu, [0], [tg[-1]], [p])[0]))
    print(f"greedy cpu {tc}\ngreedy gpu {tg}")
    gpu.close()
    assert tc == tg


def test_greedy_step_matches_logits(rng):
    path = TWINS / "smol135.gguf"
    if not path.exists():
        pytest.skip("smol135 twin not expanded")
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _open(path)
    gpu = contiguous_tables(CUDABackend(model, max_slots=3, max_context=128, settings=Settings(self_check=False)))
    V = model.config.vocab_size
    gpu.prefill([PrefillItem(s, rng.integers(0, V, 5 + s).astype(np.int32)) for s in range(3)])
    # the same step twice (same cache rows rewritten): logits then argmax must agree
    toks, pos = [3, 7, 11], [5, 6, 7]
    logits = gpu.decode([0, 1, 2], toks, pos)
    ids = greedy_step(gpu, [0, 1, 2], toks, pos)
    assert ids.dtype == np.int32 and ids.shape == (3,)
    assert list(ids) == list(np.argmax(logits, axis=1))
    gpu.close()
