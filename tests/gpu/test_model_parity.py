"""Whole-model parity: the CUDA backend against the NumPy oracle (CPUBackend) on the same model
file. Shape twins of the four real models (expanded by tools/device_check.sh into
$REALIZAR_TWINS, default /tmp/twins) and the real SmolLM2 ($REALIZAR_REAL_SMOL, or the
default model in the model cache)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from paging import contiguous_tables

pytestmark = pytest.mark.gpu

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))
COS_MIN = 0.999


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# The gemma270 twin is chaotic: its random weights make attention nearly one-hot, so for some
# prompts a difference at float32 rounding level flips which key a head attends to. Measured on
# the CPU: 1e-7 relative noise on the oracle's norm outputs moved one prompt's logits to cosine
# 0.9995, and on the H100 even the fp32 SGEMM prefill reached 0.9998 on one prompt set (8 seeds x
# 6 prompt sets, docs/perf-notes.md v11). A worst-row floor there measures the prompt, not the
# kernels; the median row does not move: <= 1e-5 (1 - cos) on the fp32 paths in every run, 3e-6 to
# 5e-4 with an fp16 prefill, ~1e-4 with int8 activations.
CHAOTIC = {"gemma270"}
CHAOTIC_MEDIAN = {"exact": 2e-5, "lossy": 1e-2}   # bound on the median row's 1 - cos
# any row: still far above a broken kernel's. gemma270's worst of 80 batched rows lands at 0.96 on
# some draws with either batched kernel (H100: mmq 0.960, split16 0.961) while the median row stays
# at ~1e-6: the random twin amplifies rounding-level differences in a few rows.
CHAOTIC_FLOOR = {"exact": 0.9, "lossy": 0.8}


def _assert_parity(name: str, cos: np.ndarray, floor: float, lossy: bool = False) -> None:
    """Every row's logits cosine >= floor; on a chaotic twin, the median row within the
    precision's bound and every row above a floor that only a broken kernel breaks."""
    cos = np.asarray(cos, np.float64).ravel()
    if name not in CHAOTIC:
        assert cos.min() >= floor, f"{name}: worst row cosine {cos.min():.7f} < {floor}"
        return
    kind = "lossy" if lossy else "exact"
    median = float(np.median(1.0 - cos))
    print(f"{name}: {cos.size} rows, median 1 - cos {median:.1e}, worst cos {cos.min():.6f}")
    assert median <= CHAOTIC_MEDIAN[kind], f"{name}: median row 1 - cos {median:.2e} > {CHAOTIC_MEDIAN[kind]:.0e}"
    assert cos.min() >= CHAOTIC_FLOOR[kind], f"{name}: worst row cosine {cos.min():.6f} < {CHAOTIC_FLOOR[kind]}"


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


def _parity(model, rng, steps=64, **gpu_kw):
    """64-token prompt (plus a 17-token one in a second slot), then `steps` decode steps of both
    sequences together, each backend fed the CPU's greedy tokens. Returns (prefill cos, decode cos)."""
    from realizar_backend.backends.base import PrefillItem
    cpu, gpu = _backends(model, **gpu_kw)
    V = model.config.vocab_size
    items = [PrefillItem(0, rng.integers(0, V, 64).astype(np.int32)),
             PrefillItem(1, rng.integers(0, V, 17).astype(np.int32))]
    lc, lg = cpu.prefill(items), gpu.prefill(items)
    assert lg.shape == lc.shape and lg.dtype == np.float32
    pre = _cos(lc, lg)
    pos = [64, 17]
    dec = []
    for _ in range(steps):
        tok = [int(t) for t in np.argmax(lc, axis=1)]
        lc = cpu.decode([0, 1], tok, pos)
        lg = gpu.decode([0, 1], tok, pos)
        dec.append(_cos(lc, lg))
        pos = [p + 1 for p in pos]
    st = gpu.stats()
    gpu.close()
    return pre, np.array(dec), st


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270", "qwen15"])
def test_twin_parity(name, rng):
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded (tools/device_check.sh does it)")
    pre, dec, st = _parity(_open(path), rng)
    print(f"{name}: prefill cos {pre.min():.6f}; decode cos min {dec.min():.6f} "
          f"(after 64: {dec[-1].min():.6f}); graphs {st['graph_status']}")
    _assert_parity(name, np.concatenate([pre.ravel(), dec.ravel()]), COS_MIN)
    assert st["graph_status"]


# the faster precision settings against the oracle (the default, fp32 decode activations with the
# split16 prefill, is above). 8-bit activations and fp16 GEMM inputs cost accuracy by design
# (measured on the H100: decode cosine 0.998-0.9995 on the real SmolLM2, down to 0.98 on the
# gemma270 twin), so they answer to a looser floor that still catches a broken kernel (which lands
# near 0); figures are printed.
LOSSY_MIN = 0.95

VARIANTS = [("int8", "fp16"), ("int8-fp32-down", "fp16"), ("fp32", "fp16"), ("int8", "fp32")]


@pytest.mark.parametrize("name", ["smol135", "gemma270", "real"])
@pytest.mark.parametrize("decode,prefill", VARIANTS, ids=["/".join(v) for v in VARIANTS])
def test_parity_precision_variants(name, decode, prefill, rng):
    path = _real_smol() if name == "real" else TWINS / f"{name}.gguf"
    if path is None or not path.exists():
        pytest.skip(f"{name} not on this machine")
    pre, dec, st = _parity(_open(path), rng, decode_activations=decode, prefill_precision=prefill)
    print(f"{name} [{decode}/{prefill}]: prefill cos {pre.min():.6f}; decode cos min {dec.min():.6f} "
          f"(after 64: {dec[-1].min():.6f})")
    _assert_parity(name, np.concatenate([pre.ravel(), dec.ravel()]), LOSSY_MIN, lossy=True)


def test_real_smollm2_parity_and_greedy(rng):
    path = _real_smol()
    if path is None:
        pytest.skip("real SmolLM2 not on this machine")
    model = _open(path)
    pre, dec, _ = _parity(model, rng)
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
        tg.append(int(gpu.decode_argmax([0], [tg[-1]], [p])[0]))
    print(f"greedy cpu {tc}\ngreedy gpu {tg}")
    gpu.close()
    assert tc == tg


def test_decode_argmax_matches_logits(rng):
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
    ids = gpu.decode_argmax([0, 1, 2], toks, pos)
    assert ids.dtype == np.int32 and ids.shape == (3,)
    assert list(ids) == list(np.argmax(logits, axis=1))
    gpu.close()
