"""Every CUDA kernel against its NumPy twin (backends/cuda/selfcheck.py) on fresh random inputs
at several shapes, odd ones included, with outputs poisoned with NaN before the launch."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda.dispatch import MMV8_KERNEL_TYPES
from realizar_backend.backends.cuda.matrices import QTYPES

pytestmark = pytest.mark.gpu

TOL = 1e-3
# every quantized type of the GPU's table: 32-weight blocks, and 256-weight blocks (K-quants, I-quants)
BLOCK32 = [q for q, i in QTYPES.items() if i.blocks and i.block == 32]
KQUANT = [q for q, i in QTYPES.items() if i.block == 256]
FLOATS = [Q.F32, Q.F16, Q.BF16]
# (N rows, K cols): hidden 896 (28 units), 576, 1536, and a 7-unit row; K-quants at 1, 6, 9, 35
# super-blocks; float types at row lengths no block size divides
SHAPES = {**{q: [(1, 896), (33, 576), (151, 1536), (896, 224)] for q in BLOCK32},
          **{q: [(1, 256), (33, 1536), (151, 2304), (64, 8960)] for q in KQUANT},
          **{q: [(1, 1), (33, 37), (151, 896), (7, 1000)] for q in FLOATS}}
CASES = [(q, n, k) for q, shapes in SHAPES.items() for n, k in shapes]


def _id(c):
    return f"{c[0].name}-{c[1]}x{c[2]}"


FLOAT_CASES = [c for c in CASES if c[0] in FLOATS]     # gemv.cu serves the float types (the rest: mmvf.cu)


@pytest.mark.parametrize("case", FLOAT_CASES, ids=_id)
@pytest.mark.parametrize("nb", [1, 3, 11])
def test_gemv(kernels, rng, case, nb):
    from realizar_backend.backends.cuda.selfcheck import check_gemv
    q, n, k = case
    err = check_gemv(kernels, q, n, k, nb, rng)
    print(f"gemv {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
    assert err <= TOL


QUANT_CASES = [c for c in CASES if c[0] not in FLOATS]


@pytest.mark.parametrize("path,case", [pytest.param(p, c, id=f"{p}-{_id(c)}") for c in QUANT_CASES
                                       for p in ("mmvf", "mmv8") if p == "mmvf" or c[0] in MMV8_KERNEL_TYPES])
@pytest.mark.parametrize("nb", [1, 3])
def test_quantized_gemv_paths(kernels, rng, path, case, nb):
    """The quantized types on each GEMV the dispatcher may pick for them: mmvf.cu (fp32 activations),
    and mmv8.cu (8-bit activations: against the twin of its quantized input) for the types it takes
    (tests/gpu/test_kernels_f32.py covers both over more launch shapes)."""
    from realizar_backend.backends.cuda.selfcheck import check_mmvf
    q, n, k = case
    err = check_mmvf(kernels, [(q, n)], k, nb, rng, bias=True, q8=path == "mmv8")
    print(f"{path} {q.name} {n}x{k} batch {nb}: rel.err {err:.2e}")
    assert err <= 2e-5


@pytest.mark.parametrize("q", FLOATS, ids=lambda q: q.name)
def test_gemv_bias_and_residual(kernels, rng, q):
    from realizar_backend.backends.cuda.selfcheck import check_gemv
    k = 96
    assert check_gemv(kernels, q, 45, k, 5, rng, bias=True) <= TOL
    assert check_gemv(kernels, q, 45, k, 9, rng, accumulate=True) <= TOL


@pytest.mark.parametrize("q", FLOATS, ids=lambda q: q.name)
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu"])
def test_ffn_gate_up(kernels, rng, q, act):
    from realizar_backend.backends.cuda.selfcheck import check_ffn
    k = 896
    for nb in (1, 9):
        assert check_ffn(kernels, q, 131, k, nb, act, rng) <= TOL


# launches of few long rows, where several warps share a row (ops.gemv_wpr): the routers of
# Qwen3-30B-A3B [128, 2048] and gpt-oss-20b [32, 2880], a shared expert's one-row gate [1, 2048], a
# row length of no whole 16-byte pieces (the units path, its warps interleaved too), and rows whose
# last block holds a row past the matrix (on 132 SMs: two warps a row, two rows a block, an odd count)
FEW_ROWS = [(128, 2048), (32, 2880), (1, 2048), (3, 2051), (601, 1024)]


@pytest.mark.parametrize("q", FLOATS, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", FEW_ROWS, ids=lambda v: str(v))
@pytest.mark.parametrize("nb", [1, 3, 11])
def test_gemv_few_rows(kernels, rng, q, n, k, nb):
    """Several warps a row against NumPy: plain, with a bias (the router's), and accumulating."""
    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.selfcheck import check_gemv
    wpr = ops.gemv_wpr(n, ops.row_bytes(q, k), nb, kernels.sm_count)
    for bias, accumulate in ((False, False), (True, False), (False, True)):
        err = check_gemv(kernels, q, n, k, nb, rng, bias=bias, accumulate=accumulate)
        print(f"gemv {q.name} {n}x{k} batch {nb} wpr {wpr} bias {bias} acc {accumulate}: rel.err {err:.2e}")
        assert err <= TOL


@pytest.mark.parametrize("q", FLOATS, ids=lambda q: q.name)
def test_ffn_gate_up_few_rows(kernels, rng, q):
    """The fused gate/up with several warps a row (a few rows of a long input)."""
    from realizar_backend.backends.cuda.selfcheck import check_ffn
    for n, k in ((8, 4096), (3, 2051)):
        for nb in (1, 9):
            assert check_ffn(kernels, q, n, k, nb, 0, rng) <= TOL


@pytest.mark.parametrize("q", FLOATS, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k,nb", [(128, 2048, 1), (32, 2880, 3), (1, 2048, 1), (3, 2051, 11)])
def test_gemv_deterministic(kernels, rng, q, n, k, nb):
    """The same launch on the same inputs gives the same bits (the warps' sums of a row are added in
    a fixed order)."""
    import cupy
    import numpy as np

    from realizar_backend.backends.cuda import ops
    from realizar_backend.backends.cuda.selfcheck import random_weight, upload_weight
    w, keep = upload_weight(q, random_weight(q, n, k, rng))
    b = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    x = cupy.asarray(rng.standard_normal((nb, k)).astype(np.float32))
    ys = [cupy.zeros((nb, n), cupy.float32) for _ in range(3)]
    for y in ys:
        ops.gemv(kernels, w, x.data.ptr, k, y.data.ptr, n, nb, b.data.ptr)
    got = [y.get().view(np.uint32) for y in ys]
    assert all(np.array_equal(got[0], g) for g in got[1:])


@pytest.mark.parametrize("q", BLOCK32 + KQUANT + FLOATS, ids=lambda q: q.name)
def test_dequant_and_embed(kernels, rng, q):
    from realizar_backend.backends.cuda.selfcheck import check_dequant, check_embed
    k = 2304 if q in KQUANT else (896 if q in BLOCK32 else 37)
    assert check_dequant(kernels, q, 19, k, rng) <= 1e-6
    assert check_embed(kernels, q, 50, k, 7, 25.3, rng) <= 1e-6


@pytest.mark.parametrize("rows,width", [(1, 576), (5, 896), (3, 1536), (28, 64), (9, 256), (4, 1000)])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm(kernels, rng, rows, width, add):
    from realizar_backend.backends.cuda.selfcheck import check_rms_norm
    assert check_rms_norm(kernels, rows, width, add, rng) <= TOL


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_rope_kv(kernels, rng, H, KVH, D, neox):
    from realizar_backend.backends.cuda.selfcheck import check_rope_kv
    for theta in (10000.0, 1000000.0):
        assert check_rope_kv(kernels, 7, H, KVH, D, neox, theta, rng, ctx=600) <= TOL


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("ctx,window", [(1, 0), (77, 0), (300, 0), (700, 512)])
def test_attention(kernels, rng, H, KVH, D, ctx, window):
    from realizar_backend.backends.cuda.selfcheck import check_attention
    err = check_attention(kernels, 5, H, KVH, D, ctx, window, rng)
    print(f"attention H{H}/{KVH} D{D} ctx {ctx} window {window}: rel.err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("items,window", [
    ([(0, 0, 1)], 0),                              # a one-token prompt
    ([(1, 0, 77)], 0),                             # one prompt, the last tile partial
    ([(2, 40, 37), (0, 0, 5), (1, 3, 20)], 0),     # a batch of prompts: tiles span two sequences
    ([(0, 100, 600)], 512),                        # a chunk after 100 cached tokens, sliding window
    ([(1, 0, 300), (2, 290, 33)], 64),             # short window: early keys of a tile fall out
], ids=["one", "single", "batch", "window", "batch-window"])
def test_attention_prompt_tiles(kernels, rng, H, KVH, D, items, window):
    """Prompt rows go through attn_tile (rows of one sequence share the staged K/V tiles)."""
    from realizar_backend.backends.cuda.selfcheck import check_attention_prompt
    err = check_attention_prompt(kernels, items, H, KVH, D, 720, window, rng)
    print(f"attention (prompt tiles) H{H}/{KVH} D{D} items {items} window {window}: rel.err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("ctx,window", [(1, 0), (77, 0), (700, 512)])
@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_attention_fused_rope(kernels, rng, H, KVH, D, ctx, window, neox):
    """Decode attention doing RoPE (angles from the host-made table) and the paged KV-cache write
    itself (no rope_kv launch)."""
    from realizar_backend.backends.cuda.selfcheck import check_attention_rope
    n = 1 if ctx == 1 else 3
    err = check_attention_rope(kernels, n, H, KVH, D, ctx, window, neox, 1000000.0, rng)
    print(f"attention+rope H{H}/{KVH} D{D} ctx {ctx} window {window}: rel.err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("D,rope_dim", [(128, 64), (64, 32), (256, 128)])
@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_attention_fused_partial_rope(kernels, rng, D, rope_dim, neox):
    """Fused decode RoPE when only the first rope_dim dims of a head rotate: the rest pass through
    (q) and into the cache unrotated (k)."""
    from realizar_backend.backends.cuda.selfcheck import check_attention_rope
    err = check_attention_rope(kernels, 3, 8, 2, D, 90, 0, neox, 10000.0, rng, rope_dim=rope_dim)
    print(f"attention+rope D{D} rope_dim {rope_dim}: rel.err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("H,KVH,D,rope_dim", [(32, 4, 128, 128), (16, 8, 128, 128), (8, 4, 256, 256),
                                              (9, 3, 64, 32)])
@pytest.mark.parametrize("ctx,window", [(1, 0), (300, 0), (700, 512)])
@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_attention_fused_head_norms(kernels, rng, H, KVH, D, rope_dim, ctx, window, neox):
    """Decode attention with the per-head q/k norms (qwen3: Qwen3-30B-A3B's 32/4 heads, 16/8;
    gemma3's 256 dims; a partial rotation) folded in before RoPE: against the float64 twin, and bit
    for bit the rms_norm launches followed by the launch without them (check_attention_rope: inf
    where not)."""
    from realizar_backend.backends.cuda.selfcheck import check_attention_rope
    n = 1 if ctx == 1 else 3
    err = check_attention_rope(kernels, n, H, KVH, D, ctx, window, neox, 1000000.0, rng, rope_dim=rope_dim,
                               head_norms=True)
    print(f"attention+norms+rope H{H}/{KVH} D{D} ctx {ctx} window {window}: rel.err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("window", [0, 128])
def test_attention_sinks(kernels, rng, window):
    """gpt-oss's attention on attention.cu (short decode rows, and prompt tiles where flash does not
    take the head size): each head's sink logit joins its rows' softmax, outputs poisoned."""
    from realizar_backend.backends.cuda.selfcheck import (check_attention, check_attention_prompt,
                                                          check_attention_rope)
    H, KVH, D = 16, 2, 64
    errs = [check_attention(kernels, 5, H, KVH, D, 300, window, rng, sinks=True),
            check_attention_prompt(kernels, [(1, 0, 150), (2, 90, 33)], H, KVH, D, 300, window, rng, sinks=True),
            check_attention_rope(kernels, 3, H, KVH, D, 300, window, True, 150000.0, rng, sinks=True)]
    print(f"attention with sinks, window {window}: rel.err {errs}")
    assert max(errs) <= TOL


@pytest.mark.parametrize("rows,cols", [(1, 49152), (3, 151936), (5, 1000), (2, 7)])
def test_argmax(kernels, rng, rows, cols):
    from realizar_backend.backends.cuda.selfcheck import check_argmax
    assert check_argmax(kernels, rows, cols, rng) == 0.0


@pytest.mark.parametrize("rows,cols", [(1, 1), (4, 70), (33, 8960)])
def test_glue_kernels(kernels, rng, rows, cols):
    from realizar_backend.backends.cuda.selfcheck import check_glue
    assert check_glue(kernels, rows, cols, rng) <= TOL


def test_self_check_runs_for_every_model_type(kernels):
    from realizar_backend.backends.cuda.selfcheck import run_self_check
    from realizar_backend.model.config import ModelConfig
    cfg = ModelConfig(arch="gemma3", n_layers=1, hidden=640, n_heads=4, n_kv_heads=1, head_dim=256,
                      ffn_dim=2048, vocab_size=1000, context_length=512, rms_eps=1e-6, rope_theta=1e6,
                      rope_style="neox", rope_dim=256, tie_embeddings=True, qkv_bias=False, qk_norm=True,
                      activation="gelu_tanh")
    errs = run_self_check(kernels, set(BLOCK32 + KQUANT + FLOATS), cfg)
    assert max(errs.values()) <= TOL


@pytest.mark.parametrize("q,n,k", [(Q.Q6_K, 1, 256), (Q.Q6_K, 33, 1536), (Q.Q6_K, 7, 4864), (Q.Q6_K, 5, 8960),
                                   (Q.Q5_0, 1, 32), (Q.Q5_0, 33, 896), (Q.Q5_0, 7, 4864),
                                   (Q.Q8_0, 1, 32), (Q.Q8_0, 33, 896), (Q.Q8_0, 7, 1536),
                                   (Q.MXFP4, 1, 32), (Q.MXFP4, 33, 2880), (Q.MXFP4, 7, 4864)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_repack_equals_numpy_twin(kernels, rng, q, n, k):
    """repack.cu writes a regrouped type's device layout byte for byte as formats/gpu_layout.to_device
    does, padding included (the destination is poisoned first), at row strides that need padding."""
    import cupy
    import numpy as np
    from realizar_backend.backends.cuda.selfcheck import random_weight
    from realizar_backend.formats.gpu_layout import device_row_bytes, to_device
    host = random_weight(q, n, k, rng)
    rb = device_row_bytes(q, k)
    src = cupy.asarray(host.reshape(-1))
    dst = cupy.full(n * rb, 0xAB, cupy.uint8)
    total = n * (k // 32)
    kernels.repack[q](((total + 255) // 256,), (256,), (src, np.int32(n), np.int32(k), dst, np.int64(rb)))
    assert np.array_equal(dst.get().reshape(n, rb), to_device(q, host, k))
