"""The fast fp32-activation kernels (mmvf.cu: multi-segment GEMV with bias / residual, fused
gate+up+activation) against float64 NumPy twins (backends/cuda/selfcheck.py) on fresh random
inputs, odd shapes included: K = 576, 896 (units that no warp pass divides), 1536, 2304, 8960
(4 warps per row), rows that no group of rows divides, batches that need two grid columns,
activation and output row strides wider than the matrix, outputs poisoned before every launch."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.matrices import QTYPES

pytestmark = pytest.mark.gpu

TOL = 1e-3
FP32_TOL = 2e-5      # fp32 accumulation: what "accurate" means for these kernels
# every quantized type of the GPU's table: 32-weight blocks, and 256-weight blocks (K-quants, I-quants)
BLOCK32 = [q for q, i in QTYPES.items() if i.blocks and i.block == 32]
KQUANT = [q for q, i in QTYPES.items() if i.block == 256]
SHAPES = {**{q: [(1, 896), (33, 576), (151, 1536), (7, 8960), (5, 4864)] for q in BLOCK32},
          **{q: [(1, 256), (37, 1536), (151, 2304), (9, 8960), (3, 512)] for q in KQUANT}}
CASES = [(q, n, k) for q, shapes in SHAPES.items() for n, k in shapes]


def _id(c):
    return f"{c[0].name}-{c[1]}x{c[2]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("nb", [1, 2, 3, 11])
def test_mmvf(kernels, rng, case, nb):
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    q, n, k = case
    err = check_mmvf(kernels, [(q, n)], k, nb, rng)
    print(f"mmvf {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
    assert err <= FP32_TOL


@pytest.mark.parametrize("segs,K", [([(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536),
                                    ([(Q.Q5_0, 896), (Q.Q5_0, 129), (Q.Q8_0, 127)], 896),
                                    ([(Q.Q8_0, 576), (Q.Q8_0, 193), (Q.Q8_0, 191)], 576),
                                    ([(Q.Q4_1, 33), (Q.Q4_1, 7), (Q.Q4_1, 5)], 576),
                                    ([(Q.Q6_K, 3), (Q.Q4_K, 1), (Q.Q5_K, 2)], 8960),
                                    ([(Q.IQ4_XS, 512), (Q.IQ3_S, 129), (Q.Q3_K, 127)], 1536),
                                    ([(Q.IQ2_XXS, 64), (Q.IQ2_XS, 33), (Q.IQ2_S, 7)], 2304),
                                    ([(Q.MXFP4, 65), (Q.IQ4_NL, 9), (Q.Q8_0, 3)], 2880),
                                    ([(Q.Q2_K, 31), (Q.IQ3_XXS, 8), (Q.Q6_K, 5)], 4864)],
                         ids=["qwen15-qkv", "qwen05-qkv-odd", "smol-qkv", "tiny", "long-mixed", "iq4xs-iq3s-q3k",
                              "iq2", "mxfp4-iq4nl", "q2k-iq3xxs"])
@pytest.mark.parametrize("nb", [1, 2, 5, 9])
def test_mmvf_segments_bias_residual(kernels, rng, segs, K, nb):
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    e1 = check_mmvf(kernels, segs, K, nb, rng, bias=True)
    e2 = check_mmvf(kernels, segs[:1], K, nb, rng, accumulate=True)
    e3 = check_mmvf(kernels, segs, K, nb, rng, bias=True, accumulate=True, x_pad=0)
    print(f"mmvf segments K={K} batch {nb}: {e1:.2e} {e2:.2e} {e3:.2e}")
    assert max(e1, e2, e3) <= FP32_TOL


@pytest.mark.parametrize("q", BLOCK32 + KQUANT, ids=lambda q: q.name)
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu"])
def test_ffn_f(kernels, rng, q, act):
    from realizar_backend.backends.cuda.selfcheck import check_ffn_f
    for n, k, nb in ((97, 1536 if q in KQUANT else 896, 1), (64, 512 if q in KQUANT else 576, 3),
                     (161, 1536, 9), (33, 8960 if q in KQUANT else 4864, 2)):
        err = check_ffn_f(kernels, q, n, k, nb, act, rng)
        print(f"ffn_f {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
        assert err <= FP32_TOL


@pytest.mark.parametrize("segs,K", [([(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536),
                                    ([(Q.Q5_0, 896), (Q.Q5_0, 129), (Q.Q8_0, 127)], 896),
                                    ([(Q.Q8_0, 577)], 576), ([(Q.Q8_0, 5), (Q.Q5_0, 7)], 640)],
                         ids=["qwen15-qkv", "qwen05-qkv-odd", "smol", "gemma-width"])
@pytest.mark.parametrize("nb", [1, 3, 8, 13])
def test_mmvf_folded_norm(kernels, rng, segs, K, nb):
    """RMSNorm computed inside the launch (staged in shared memory) against norm-then-GEMV in float64,
    with inputs of very different scales per row."""
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    e1 = check_mmvf(kernels, segs, K, nb, rng, bias=True, norm=True)
    e2 = check_mmvf(kernels, segs[:1], K, nb, rng, accumulate=True, norm=True)
    print(f"mmvf+norm K={K} batch {nb}: {e1:.2e} {e2:.2e}")
    assert max(e1, e2) <= FP32_TOL


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.IQ4_XS, Q.MXFP4, Q.Q3_K, Q.IQ2_XXS],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("nb", [1, 4, 9])
def test_ffn_f_folded_norm(kernels, rng, q, nb):
    from realizar_backend.backends.cuda.selfcheck import check_ffn_f
    K = 1536 if q in KQUANT else 896
    err = check_ffn_f(kernels, q, 161, K, nb, 0, rng, norm=True)
    print(f"ffn_f+norm {q.name} batch {nb}: rel.err {err:.2e}")
    assert err <= FP32_TOL


@pytest.mark.parametrize("q", BLOCK32 + KQUANT, ids=lambda q: q.name)
@pytest.mark.parametrize("nb", [1, 3])
def test_mmvf_head(kernels, rng, q, nb):
    """The LM head's launch (one row: its own module, more rows a warp group): a head of rows that
    no group divides, over more groups than one wave of blocks holds, with the norm folded in."""
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    K = 1536 if q in KQUANT else 896
    err = check_mmvf(kernels, [(q, 20_003)], K, nb, rng, norm=True, head=True)
    print(f"mmvf head {q.name} 20003x{K} batch {nb}: rel.err {err:.2e}")
    assert err <= FP32_TOL


@pytest.mark.parametrize("nb", [1, 2, 5, 8])
@pytest.mark.parametrize("head", [False, True], ids=["mmvf", "head"])
def test_mmvf_fused_argmax(kernels, rng, nb, head):
    """The LM head's fused argmax equals argmax of the logits it wrote (first index on ties, NaN
    never wins), and the key buffer is left zeroed for the next step."""
    import cupy
    import numpy as np
    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight
    N, K = 49157, 768
    host = random_weight(Q.Q6_K, N, K, rng)
    w, keep = upload_weight(Q.Q6_K, host)
    x = cupy.asarray(rng.standard_normal((nb, K)).astype(np.float32))
    key = cupy.zeros(8, cupy.uint64)
    out = cupy.full(8, -7, cupy.int32)
    for step in range(3):
        y = cupy.full((nb, N), np.nan, cupy.float32)
        ops.mmvf(kernels, [(w, 0, y.data.ptr, N)], K, x.data.ptr, K, nb, amax=key.data.ptr, head=head)
        ops.argmax_unpack(kernels, key.data.ptr, out.data.ptr, nb)
        logits = y.get()
        assert out[:nb].get().tolist() == np.argmax(logits, axis=1).tolist()
        assert int(key.sum().get()) == 0
        x = cupy.asarray(rng.standard_normal((nb, K)).astype(np.float32))
    # ties: a zero input gives all-zero logits, the first row wins
    z = cupy.zeros((nb, K), cupy.float32)
    y = cupy.empty((nb, N), cupy.float32)
    ops.mmvf(kernels, [(w, 0, y.data.ptr, N)], K, z.data.ptr, K, nb, amax=key.data.ptr, head=head)
    ops.argmax_unpack(kernels, key.data.ptr, out.data.ptr, nb)
    assert out[:nb].get().tolist() == [0] * nb


@pytest.mark.parametrize("q,n,k", [(Q.Q4_K, 20000, 1536), (Q.Q6_K, 3000, 8960), (Q.Q8_0, 9001, 896),
                                   (Q.Q4_K, 1283, 27648), (Q.Q6_K, 37, 27648)],
                         ids=["wide", "long-rows", "odd", "unstaged-32b-down", "unstaged-few-rows"])
def test_mmvf_more_groups_than_resident_blocks(kernels, rng, q, n, k):
    """Launches with more row groups than one wave of blocks holds: blocks stride over the groups
    (with block barriers when warps share a row)."""
    from realizar_backend.backends.cuda.selfcheck import check_ffn_f, check_mmvf
    e1 = check_mmvf(kernels, [(q, n)], k, 1, rng, bias=True)
    e2 = check_mmvf(kernels, [(q, n)], k, 2, rng, accumulate=True, norm=k <= 1536)
    e3 = check_ffn_f(kernels, q, n, k, 1, 0, rng) if k <= 1536 else 0.0
    print(f"mmvf {q.name} {n}x{k}: {e1:.2e} {e2:.2e} {e3:.2e}")
    assert max(e1, e2, e3) <= FP32_TOL
