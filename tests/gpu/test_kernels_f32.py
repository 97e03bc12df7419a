"""The fast fp32-activation kernels (mmvf.cu: multi-segment GEMV with bias / residual, fused
gate+up+activation) against float64 NumPy twins (backends/cuda/selfcheck.py) on fresh random
inputs, odd shapes included: K = 576, 896 (units that no warp pass divides), 1536, 2304, 8960
(4 warps per row), rows that no group of rows divides, batches that need two grid columns,
activation and output row strides wider than the matrix, outputs poisoned before every launch.
Each test runs on both one-row GEMV paths the dispatcher can choose ("path"): mmvf.cu, and
mmv8.cu (8-bit activations, its types only) against the twin of its quantized input."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.dispatch import MMV8_KERNEL_TYPES
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
# the folded norm's float32 rounding may put one activation of an mmv8 launch on the other side of a
# half step from the twin's: an error of d |w| (d ~ 3 sigma / 127) against sum |w x| ~ 0.8 K sigma |w|
Q8_NORM_TOL = 2e-4


def paths(cases, types=lambda c: [c[0]]):
    """(path, case) for mmvf.cu, and for mmv8.cu where it takes every type of the case."""
    return [pytest.param(p, c, id=f"{p}-{_id(c) if isinstance(c, tuple) else c.name}")
            for c in cases for p in ("mmvf", "mmv8") if p == "mmvf" or set(types(c)) <= MMV8_KERNEL_TYPES]


def _id(c):
    return f"{c[0].name}-{c[1]}x{c[2]}"


@pytest.mark.parametrize("path,case", paths(CASES))
@pytest.mark.parametrize("nb", [1, 2, 3, 11])
def test_mmvf(kernels, rng, path, case, nb):
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    q, n, k = case
    err = check_mmvf(kernels, [(q, n)], k, nb, rng, q8=path == "mmv8")
    print(f"{path} {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
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
@pytest.mark.parametrize("path", ["mmvf", "mmv8"])
def test_mmvf_segments_bias_residual(kernels, rng, segs, K, nb, path):
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    q8 = path == "mmv8"
    if q8 and not {q for q, _ in segs} <= MMV8_KERNEL_TYPES:
        pytest.skip("types mmv8.cu does not take")
    e1 = check_mmvf(kernels, segs, K, nb, rng, bias=True, q8=q8)
    e2 = check_mmvf(kernels, segs[:1], K, nb, rng, accumulate=True, q8=q8)
    e3 = check_mmvf(kernels, segs, K, nb, rng, bias=True, accumulate=True, x_pad=0, q8=q8)
    print(f"{path} segments K={K} batch {nb}: {e1:.2e} {e2:.2e} {e3:.2e}")
    assert max(e1, e2, e3) <= FP32_TOL


@pytest.mark.parametrize("path,q", paths(BLOCK32 + KQUANT, lambda q: [q]))
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu"])
def test_ffn_f(kernels, rng, path, q, act):
    from realizar_backend.backends.cuda.selfcheck import check_ffn_f
    for n, k, nb in ((97, 1536 if q in KQUANT else 896, 1), (64, 512 if q in KQUANT else 576, 3),
                     (161, 1536, 9), (33, 8960 if q in KQUANT else 4864, 2)):
        err = check_ffn_f(kernels, q, n, k, nb, act, rng, q8=path == "mmv8")
        print(f"{path} ffn {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
        assert err <= FP32_TOL


@pytest.mark.parametrize("segs,K", [([(Q.Q4_K, 1536), (Q.Q4_K, 256), (Q.Q6_K, 256)], 1536),
                                    ([(Q.Q5_0, 896), (Q.Q5_0, 129), (Q.Q8_0, 127)], 896),
                                    ([(Q.Q8_0, 577)], 576), ([(Q.Q8_0, 5), (Q.Q5_0, 7)], 640)],
                         ids=["qwen15-qkv", "qwen05-qkv-odd", "smol", "gemma-width"])
@pytest.mark.parametrize("nb", [1, 3, 8, 13])
@pytest.mark.parametrize("path", ["mmvf", "mmv8"])
def test_mmvf_folded_norm(kernels, rng, segs, K, nb, path):
    """RMSNorm computed inside the launch (staged in shared memory) against norm-then-GEMV in float64,
    with inputs of very different scales per row."""
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    q8 = path == "mmv8"
    e1 = check_mmvf(kernels, segs, K, nb, rng, bias=True, norm=True, q8=q8)
    e2 = check_mmvf(kernels, segs[:1], K, nb, rng, accumulate=True, norm=True, q8=q8)
    print(f"{path}+norm K={K} batch {nb}: {e1:.2e} {e2:.2e}")
    assert max(e1, e2) <= (Q8_NORM_TOL if q8 else FP32_TOL)


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.IQ4_XS, Q.MXFP4, Q.Q3_K, Q.IQ2_XXS],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("nb", [1, 4, 9])
@pytest.mark.parametrize("path", ["mmvf", "mmv8"])
def test_ffn_f_folded_norm(kernels, rng, q, nb, path):
    from realizar_backend.backends.cuda.selfcheck import check_ffn_f
    q8 = path == "mmv8"
    if q8 and q not in MMV8_KERNEL_TYPES:
        pytest.skip("a type mmv8.cu does not take")
    K = 1536 if q in KQUANT else 896
    err = check_ffn_f(kernels, q, 161, K, nb, 0, rng, norm=True, q8=q8)
    print(f"{path}+norm {q.name} batch {nb}: rel.err {err:.2e}")
    assert err <= (Q8_NORM_TOL if q8 else FP32_TOL)


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
@pytest.mark.parametrize("head,q8", [(False, False), (True, False), (False, True)], ids=["mmvf", "head", "mmv8"])
def test_mmvf_fused_argmax(kernels, rng, nb, head, q8):
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
        ops.mmvf(kernels, [(w, 0, y.data.ptr, N)], K, x.data.ptr, K, nb, amax=key.data.ptr, head=head, q8=q8)
        ops.argmax_unpack(kernels, key.data.ptr, out.data.ptr, nb)
        logits = y.get()
        assert out[:nb].get().tolist() == np.argmax(logits, axis=1).tolist()
        assert int(key.sum().get()) == 0
        x = cupy.asarray(rng.standard_normal((nb, K)).astype(np.float32))
    # ties: a zero input gives all-zero logits, the first row wins
    z = cupy.zeros((nb, K), cupy.float32)
    y = cupy.empty((nb, N), cupy.float32)
    ops.mmvf(kernels, [(w, 0, y.data.ptr, N)], K, z.data.ptr, K, nb, amax=key.data.ptr, head=head, q8=q8)
    ops.argmax_unpack(kernels, key.data.ptr, out.data.ptr, nb)
    assert out[:nb].get().tolist() == [0] * nb


@pytest.mark.parametrize("q,n,k", [(Q.Q4_K, 20000, 1536), (Q.Q6_K, 3000, 8960), (Q.Q8_0, 9001, 896),
                                   (Q.Q4_K, 1283, 27648), (Q.Q6_K, 37, 27648)],
                         ids=["wide", "long-rows", "odd", "unstaged-32b-down", "unstaged-few-rows"])
@pytest.mark.parametrize("path", ["mmvf", "mmv8"])
def test_mmvf_more_groups_than_resident_blocks(kernels, rng, q, n, k, path):
    """Launches with more row groups than one wave of blocks holds: blocks stride over the groups
    (with block barriers when warps share a row); mmv8.cu stages every row here (the 32B down too)."""
    from realizar_backend.backends.cuda.selfcheck import check_ffn_f, check_mmvf
    q8 = path == "mmv8"
    e1 = check_mmvf(kernels, [(q, n)], k, 1, rng, bias=True, q8=q8)
    e2 = check_mmvf(kernels, [(q, n)], k, 2, rng, accumulate=True, norm=k <= 1536 and not q8, q8=q8)
    e3 = check_mmvf(kernels, [(q, n)], k, 1, rng, norm=True, q8=True) if q8 else 0.0
    e4 = check_ffn_f(kernels, q, n, k, 1, 0, rng, q8=q8) if k <= 1536 or q8 else 0.0
    print(f"{path} {q.name} {n}x{k}: {e1:.2e} {e2:.2e} {e3:.2e} {e4:.2e}")
    assert max(e1, e2, e4) <= FP32_TOL and e3 <= (Q8_NORM_TOL if q8 else FP32_TOL)


@pytest.mark.parametrize("q,n,k", [(Q.Q4_K, 1031, 18944), (Q.Q6_K, 517, 27648), (Q.Q8_0, 2049, 3584)],
                         ids=["q4k-7b-down", "q6k-32b-down", "q8_0"])
def test_mmv8_bitwise_reproducible(kernels, rng, q, n, k):
    """mmv8.cu splits long rows over warps and adds their sums in a fixed order (no float atomics):
    repeated launches give the same bits, the fused gate/up too."""
    import cupy
    import numpy as np
    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight
    w, keep = upload_weight(q, random_weight(q, n, k, rng))
    x = cupy.asarray(rng.standard_normal(k).astype(np.float32))
    outs = []
    for _ in range(3):
        y, a = cupy.full(n, np.nan, cupy.float32), cupy.full(n, np.nan, cupy.float32)
        ops.mmvf(kernels, [(w, 0, y.data.ptr, n)], k, x.data.ptr, k, 1, q8=True)
        ops.ffn_f(kernels, w, w, x.data.ptr, k, a.data.ptr, n, 1, 0, q8=True)
        outs.append((y.get().view(np.uint32), a.get().view(np.uint32)))
    for y, a in outs[1:]:
        assert np.array_equal(y, outs[0][0]) and np.array_equal(a, outs[0][1])
