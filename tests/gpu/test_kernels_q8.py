"""The 8-bit-activation kernels and the fp16 prefill path against their NumPy twins
(backends/cuda/selfcheck_q8.py) on fresh random inputs, odd shapes included (hidden 896 = 28
blocks, rows that no block of warps divides), outputs poisoned before every launch."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.gpu

TOL = 1e-3
BLOCK32 = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
KQUANT = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# (N rows, K cols): K = 896 (28 blocks, one warp per row), 4864 (152 blocks: 4 warps per row),
# 8960 (280), 256 / 2304 (1 / 9 super-blocks), 2560 (80 blocks: 2 warps per row)
SHAPES = {**{q: [(1, 896), (33, 576), (151, 4864), (7, 2560)] for q in BLOCK32},
          **{q: [(1, 256), (37, 1536), (151, 2304), (9, 8960)] for q in KQUANT}}
CASES = [(q, n, k) for q, shapes in SHAPES.items() for n, k in shapes]


def _id(c):
    return f"{c[0].name}-{c[1]}x{c[2]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("nb", [1, 3, 11])
def test_mmv_q8(kernels, rng, case, nb):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_mmv_q8
    q, n, k = case
    err = check_mmv_q8(kernels, [(q, n)], k, nb, rng)
    print(f"mmv_q8 {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("segs,K", [([(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536),
                                    ([(Q.Q5_0, 896), (Q.Q5_0, 129), (Q.Q8_0, 127)], 896),
                                    ([(Q.Q4_1, 33), (Q.Q4_1, 7), (Q.Q4_1, 5)], 576)],
                         ids=["qwen15-qkv", "qwen05-qkv-odd", "smol-tiny"])
@pytest.mark.parametrize("nb", [1, 2, 5])
def test_mmv_q8_segments_bias_residual(kernels, rng, segs, K, nb):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_mmv_q8
    assert check_mmv_q8(kernels, segs, K, nb, rng, bias=True) <= TOL
    assert check_mmv_q8(kernels, segs[:1], K, nb, rng, accumulate=True) <= TOL


def test_q8_activation_error_is_small(kernels, rng):
    """8-bit activations against fp32 activations: the approximation the decode path makes."""
    from realizar_backend.backends.cuda.selfcheck import random_weight
    from realizar_backend.backends.cuda.selfcheck_q8 import dequantize_q8, quantize_q8
    from realizar_backend.formats.quants import dequantize
    x = rng.standard_normal((4, 1536)).astype(np.float32)
    w = dequantize(random_weight(Q.Q4_K, 64, 1536, rng), Q.Q4_K, (64, 1536)).astype(np.float64)
    q, ds = quantize_q8(x)
    exact, approx = x.astype(np.float64) @ w.T, dequantize_q8(q, ds) @ w.T
    err = np.linalg.norm(approx - exact) / np.linalg.norm(exact)
    print(f"8-bit activation GEMV error vs fp32: {err:.2e}")
    assert err < 2e-2


@pytest.mark.parametrize("q", BLOCK32 + KQUANT, ids=lambda q: q.name)
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu"])
def test_ffn_q8(kernels, rng, q, act):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_ffn_q8
    k = 1536 if q in KQUANT else 896
    for n, nb in ((96, 1), (64, 3), (160, 9)):
        err, viol = check_ffn_q8(kernels, q, n, k, nb, act, rng)
        print(f"ffn_q8 {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}, 8-bit violation {viol:.3f}")
        assert err <= TOL and viol <= 1.0


@pytest.mark.parametrize("rows,width", [(1, 576), (5, 896), (3, 1536), (2, 640), (9, 64)])
def test_rms_norm_q8(kernels, rng, rows, width):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_rms_norm_q8
    e32, e16, viol = check_rms_norm_q8(kernels, rows, width, rng)
    assert e32 <= 1e-5 and e16 <= TOL and viol <= 1.0


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)])
def test_attention_q8_and_f16_outputs(kernels, rng, H, KVH, D):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_attention_outputs
    e16, viol = check_attention_outputs(kernels, 5, H, KVH, D, 77, rng)
    assert e16 <= TOL and viol <= 1.0


@pytest.mark.parametrize("q", BLOCK32 + KQUANT + [Q.F32, Q.F16], ids=lambda q: q.name)
def test_dequant16(kernels, rng, q):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_dequant16
    k = 2304 if q in KQUANT else (896 if q in BLOCK32 else 37)
    assert check_dequant16(kernels, q, 19, k, rng) <= TOL


@pytest.mark.parametrize("T,N,K", [(17, 896, 896), (512, 256, 1536), (33, 1000, 64)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_gemm(kernels, rng, T, N, K, accumulate, dtype):
    from realizar_backend.backends.cuda.selfcheck_q8 import check_gemm
    assert check_gemm(T, N, K, rng, accumulate, dtype) <= TOL
