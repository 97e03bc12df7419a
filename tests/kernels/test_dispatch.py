"""The matrix-multiply dispatcher (backends/cuda/dispatch.py): which kernel family each step runs and
which kernel each matrix takes, for the type mixes of real files. Pure rules over matrix shapes and
types: runs anywhere (no CuPy)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.backends.cuda import dispatch as d
from realizar_backend.backends.cuda.dispatch import Dispatcher, Kernel, Step
from realizar_backend.backends.cuda.matrices import QTYPES, WeightRef, check_matrix
from realizar_backend.errors import UnsupportedModelError
from realizar_backend.formats.quants import row_bytes
from realizar_backend.formats.gpu_layout import device_row_bytes


def mat(qtype: Q, rows: int, cols: int, name: str = "w") -> WeightRef:
    return WeightRef(name, qtype, 0, rows, cols, device_row_bytes(qtype, cols))


def dense(types: dict[str, Q], layers: int = 2, hidden: int = 1536, q_dim: int = 1536, kv_dim: int = 256,
          ffn: int = 8960, vocab: int = 151936, head: Q = Q.Q6_K):
    """A dense model's projection groups (model/transformer.py projections) and LM head, with the types
    given per role (missing roles: Q4_K)."""
    t = {"q": Q.Q4_K, "k": Q.Q4_K, "v": Q.Q4_K, "o": Q.Q4_K, "gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q4_K, **types}
    groups = []
    for _ in range(layers):
        groups += [("linear", (mat(t["q"], q_dim, hidden, "q"), mat(t["k"], kv_dim, hidden, "k"),
                               mat(t["v"], kv_dim, hidden, "v"))),
                   ("linear", (mat(t["o"], hidden, q_dim, "o"),)),
                   ("gated", (mat(t["gate"], ffn, hidden, "gate"), mat(t["up"], ffn, hidden, "up"))),
                   ("linear", (mat(t["down"], hidden, ffn, "down"),))]
    return groups, mat(head, vocab, hidden, "head")


Q4_K_M = {"v": Q.Q6_K, "down": Q.Q6_K}                    # Qwen2.5 Q4_K_M: Q4_K + Q6_K
Q5_K_M = {**dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), Q.Q5_K), **Q4_K_M}   # Q5_K + Q6_K
SMOL = dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), Q.Q4_1)   # SmolLM2 Q4_1 (+ Q8_0 head)


def test_every_quant_type_has_a_gemv_and_floats_take_gemv_cu():
    for qt, info in QTYPES.items():
        k = d.Dispatcher._gemv([mat(qt, 64, 256)])[0]
        assert k is (Kernel.MMVF if info.blocks else Kernel.GEMV), qt.name


def test_decode_families_by_rows_for_a_q4_k_m_model():
    groups, head = dense(Q4_K_M)
    disp = Dispatcher(groups, head, split16_kept=True)
    assert disp.mmqs_all and disp.mmq_min_rows == d.MMQS_MIN_ROWS
    assert [disp.decode_step(b).family for b in (1, 2, 4, 8, 16, 17, 32, 64, 256)] == \
        ["gemv", "gemv", "mmq", "mmq", "mmq", "split16", "split16", "split16", "split16"]
    # the split halves (4 bytes a weight) take the wide steps only
    split = Dispatcher(groups, head, split16_kept=True, precision="split")
    assert [split.decode_step(b).family for b in (1, 4, 17, 32, 63, 64, 256)] == \
        ["gemv", "mmq", "mmq", "mmq", "mmq", "split16", "split16"]
    # without the kept split weights, wide steps stay on the tensor cores
    assert Dispatcher(groups, head, split16_kept=False).decode_step(256).family == "mmq"


def test_a_type_mmqs_lacks_moves_the_tensor_cores_to_eight_rows():
    groups, head = dense(SMOL)
    disp = Dispatcher(groups, mat(Q.Q8_0, 49152, 576), split16_kept=False)
    assert disp.mmq_all and not disp.mmqs_all
    assert disp.decode_step(4).family == "gemv" and disp.decode_step(8).family == "mmq"
    step = disp.decode_step(8)
    assert disp.linear(step, groups[0][1]).kernel is Kernel.MMQ


def test_mmqs_takes_up_to_16_rows_and_beyond_only_what_stays_in_l2():
    groups, head = dense(Q4_K_M)
    disp = Dispatcher(groups, head, split16_kept=False)
    qkv, gate_up = groups[0][1], groups[2][1]
    for rows in (4, 8, 16):
        assert disp.linear(Step("mmq", rows), qkv).kernel is Kernel.MMQS
    # 32 rows: q/k/v (~2 MB) stay on mmqs; the 152k x 1536 head (~200 MB) takes mmq.cu's tiles
    assert disp.linear(Step("mmq", 32), qkv).kernel is Kernel.MMQS
    assert disp.head(32) is Kernel.MMQ and disp.head(16) is Kernel.MMQS
    assert disp.gated(Step("mmq", 8), *gate_up) == d.Choice((Kernel.MMQS, Kernel.MMQS), True)


def test_the_lm_head_takes_the_tensor_cores_from_two_rows_and_one_row_folds_the_argmax():
    groups, head = dense(Q4_K_M)
    disp = Dispatcher(groups, head, split16_kept=False)
    assert disp.head(1) is Kernel.MMV8                  # 152k x 1536 of Q6_K: mmv8.cu's rule
    assert disp.head(2) is Kernel.MMQS
    small = mat(Q.Q6_K, 2048, 1536)                     # a head under MMV8_MIN_BYTES keeps mmvf.cu
    assert Dispatcher(groups, small, split16_kept=False).head(1) is Kernel.MMVF
    q8_head = mat(Q.Q8_0, 49152, 576)                   # SmolLM2's: a type outside MMV8_TYPES
    assert Dispatcher(groups, q8_head, split16_kept=False).head(1) is Kernel.MMVF
    f16_head = mat(Q.F16, 32000, 1536)
    assert Dispatcher(groups, f16_head, split16_kept=False).head(8) is Kernel.GEMV


def test_a_group_the_tensor_cores_cannot_take_runs_on_the_gemvs_matrix_by_matrix():
    """A Q4_K_M file with one F16 projection (a vision model's converted layer, say): that group
    falls back to the GEMVs in a tensor-core step (mmvf for its quantized matrices, gemv.cu for the
    float one), the rest stays on the tensor cores, and no prompt step is a tensor-core step."""
    groups, head = dense({**Q4_K_M, "k": Q.F16})
    disp = Dispatcher(groups, head, split16_kept=False)
    step = disp.decode_step(16)
    assert step.family == "mmq" and not disp.mmq_all and disp.buckets == ()
    assert disp.linear(step, groups[0][1]).kernels == (Kernel.MMVF, Kernel.GEMV, Kernel.MMVF)
    assert disp.linear(step, groups[1][1]).kernel is Kernel.MMQS
    assert disp.prompt_step(16).family == "gemv"


def test_gate_and_up_of_different_types_are_not_fused():
    groups, head = dense({"gate": Q.Q4_K, "up": Q.Q6_K})
    disp = Dispatcher(groups, head, split16_kept=False)
    gate, up = groups[2][1]
    for rows, kern in ((1, Kernel.MMV8), (2, Kernel.MMVF), (16, Kernel.MMVF)):
        c = disp.gated(disp.decode_step(rows), gate, up)      # one launch of two segments, no fused activation
        assert not c.fused and c.kernel is kern


def test_split16_steps_run_every_matrix_there():
    groups, head = dense({**Q4_K_M, "k": Q.F16})
    disp = Dispatcher(groups, head, split16_kept=True)
    step = disp.prompt_step(512)
    assert step == Step("split16", 512)
    assert disp.linear(step, groups[0][1]).kernel is Kernel.SPLIT16
    assert disp.gated(step, *groups[2][1]) == d.Choice((Kernel.SPLIT16,) * 2, True)


def test_default_prompt_buckets():
    assert d.prompt_buckets() == (8, 16, 32, 48, 64)
    assert d.prompt_buckets(0) == ()
    assert d.prompt_buckets(8) == (8,)
    assert d.prompt_buckets(40) == (8, 16, 32, 40)


@pytest.mark.parametrize("limit", range(8, 257, 8))
def test_every_bucket_holds_its_steps_with_under_a_block_of_padding(limit):
    """Each step up to the limit has a bucket that holds it with fewer than 16 rows to spare: the
    padding fits one KV block of the scratch slot (default block size 16) as one run of rows."""
    buckets = d.prompt_buckets(limit)
    assert buckets[-1] == limit and list(buckets) == sorted(set(buckets))
    for T in range(1, limit + 1):
        rows = next(b for b in buckets if b >= T)
        assert T <= rows < T + 16


def test_prompt_steps_by_tokens():
    """GEMVs below MMQS_MIN_ROWS, the tensor-core buckets up to PROMPT_MMQ_TOKENS (up to one mmqs.cu
    group of 16 where the fp16 weights are kept), then the GEMMs on multiples of GEMM_ROW_STEP."""
    groups, head = dense(Q4_K_M)
    for kept, precision, last in ((True, "split", 64), (False, "fp16", 64), (True, "fp16", 16)):
        disp = Dispatcher(groups, head, split16_kept=kept, precision=precision)
        for T in range(1, d.MMQS_MIN_ROWS):
            assert disp.prompt_step(T) == Step("gemv", T)
        assert disp.prompt_step(16) == Step("mmq", 16)
        if last == 64:
            assert disp.prompt_step(17) == Step("mmq", 32)
            assert disp.prompt_step(64) == Step("mmq", 64)
        else:
            assert disp.buckets == (8, 16) == d.prompt_buckets(d.PROMPT_MMQ_TOKENS_FP16_KEPT)
            assert disp.prompt_step(17) == Step("split16", 64)
            assert disp.prompt_step(64) == Step("split16", 64)
        for T, rows in ((65, 128), (100, 128), (512, 512), (513, 576), (4096, 4096)):
            assert disp.prompt_step(T) == Step("split16", rows)


def test_without_tensor_core_prompt_steps_gemvs_then_gemms_on_recurring_row_counts():
    """A model with a group the tensor cores do not take: GEMVs below the GEMM threshold at the
    exact token count, GEMMs from there on a multiple of GEMM_ROW_STEP rows (fewer than that of
    padding: the keys of their graphs recur); the threshold is lower with the split weights kept."""
    groups, head = dense({**Q4_K_M, "o": Q.F16})
    for kept, first in ((True, d.GEMM_MIN_TOKENS_KEPT), (False, d.GEMM_MIN_TOKENS)):
        disp = Dispatcher(groups, head, split16_kept=kept)
        for T in range(1, 300):
            s = disp.prompt_step(T)
            if T < first:
                assert s == Step("gemv", T)
            else:
                assert s.family == "split16" and s.rows % d.GEMM_ROW_STEP == 0 and T <= s.rows < T + d.GEMM_ROW_STEP


def test_split16_pairs_rows_only_while_gemms_are_bound_by_reading_weights():
    assert Dispatcher.split16_paired(128, 1024) and not Dispatcher.split16_paired(129, 1024)
    assert not Dispatcher.split16_paired(64, 100)         # 2 x rows must fit the workspace


def moe(layers: int = 2, hidden: int = 2048, q_dim: int = 4096, kv_dim: int = 512, experts: int = 128,
        ffn: int = 768, gate: Q = Q.Q4_K, up: Q = Q.Q4_K, down: Q = Q.Q6_K, vocab: int = 151936):
    """Qwen3-30B-A3B's projection groups (Q4_K_M): attention, the F32 router, stacks of experts."""
    def stack(qt, rows, cols, name):
        return WeightRef(name, qt, 0, rows, cols, device_row_bytes(qt, cols), experts)
    groups = []
    for _ in range(layers):
        groups += [("linear", (mat(Q.Q4_K, q_dim, hidden, "q"), mat(Q.Q4_K, kv_dim, hidden, "k"),
                               mat(Q.Q6_K, kv_dim, hidden, "v"))),
                   ("linear", (mat(Q.Q4_K, hidden, q_dim, "o"),)),
                   ("router", (mat(Q.F32, experts, hidden, "router"),)),
                   ("experts", (stack(gate, ffn, hidden, "gate"), stack(up, ffn, hidden, "up"),
                                stack(down, hidden, ffn, "down")))]
    return groups, mat(Q.Q6_K, vocab, hidden, "head")


def test_a_mixture_of_experts_groups_its_experts_from_two_rows_and_keeps_the_tensor_cores():
    """The router (F32) and the stacks of experts do not take the dense families' kernels, so they
    do not decide the step's family: the attention keeps the tensor-core buckets. One-row steps run
    the experts on the per-pair GEMVs (mmv8.cu's where every stack is of its types), steps of
    MOE_GROUPED_MIN_ROWS (2) rows or more on the grouped tiles; the router on gemv.cu's GEMV, gate
    and up in one launch where they share type and shape."""
    groups, head = moe()
    disp = Dispatcher(groups, head, split16_kept=True)
    assert disp.mmq_all and disp.mmqs_all and disp.buckets
    router, (gate, up, down) = groups[2][1][0], groups[3][1]
    assert disp.experts(disp.decode_step(1), router, gate, up, down=down) == \
        d.ExpertsChoice(Kernel.GEMV, Kernel.MOE_PAIRS8 if d.MOE_PAIRS8 else Kernel.MOE_PAIRS, True)
    for step in [disp.decode_step(b) for b in (2, 4, 16, 64, 256)] + [disp.prompt_step(T) for T in (3, 40, 2048)]:
        assert disp.experts(step, router, gate, up, down=down) == \
            d.ExpertsChoice(Kernel.GEMV, Kernel.MOE_GROUPED, True, a8=d.MOE_GROUPED_A8), step
    groups, head = moe(up=Q.Q6_K)
    gate, up = groups[3][1][:2]
    assert not Dispatcher(groups, head, split16_kept=False).experts(Step("gemv", 1), router, gate, up).fused
    # a quantized router takes the quantized GEMV
    assert disp.experts(Step("gemv", 1), mat(Q.Q8_0, 128, 2048), gate, gate).router is Kernel.MMVF


def test_stacks_of_experts_fuse_only_with_the_same_count():
    a = WeightRef("gate", Q.Q4_K, 0, 768, 2048, device_row_bytes(Q.Q4_K, 2048), 128)
    assert d.same_shape(a, WeightRef("up", Q.Q4_K, 0, 768, 2048, a.row_bytes, 128))
    assert not d.same_shape(a, WeightRef("up", Q.Q4_K, 0, 768, 2048, a.row_bytes, 64))
    assert not d.same_shape(a, mat(Q.Q4_K, 768, 2048))
    assert a.expert_bytes == 768 * a.row_bytes


# the quantized types of the GPU's table that the tensor-core kernels take (mmq.cu; mmqs.cu)
LOWBIT = [Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S]
TENSOR_CORE_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, *LOWBIT]
SMALL_TYPES = [Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, *LOWBIT]


@pytest.mark.parametrize("qt", TENSOR_CORE_TYPES, ids=lambda q: q.name)
def test_each_type_has_its_tensor_core_rows(qt):
    """A model of one type decodes its batches on the tensor cores: mmq.cu for rows of whole blocks,
    mmqs.cu (from 4 rows) where it has the type; a row of a partial block stays on the GEMVs."""
    block = QTYPES[qt].block
    w = mat(qt, 96, 2 * max(block, 64))
    assert d.mmvf_ok(w) and d.mmq_ok(w)
    assert d.mmqs_ok(w) == (qt in SMALL_TYPES)
    groups, head = dense(dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), qt), hidden=1024, q_dim=1024,
                         ffn=2048, vocab=1000, head=qt)
    disp = Dispatcher(groups, head, split16_kept=False)
    assert disp.mmq_all and disp.mmqs_all == (qt in SMALL_TYPES)
    step = disp.decode_step(16)
    assert step.family == "mmq"
    want = Kernel.MMQS if qt in SMALL_TYPES else Kernel.MMQ
    assert disp.linear(step, groups[0][1]).kernel is want
    assert disp.gated(step, *groups[2][1]) == d.Choice((want, want), True)
    if block > 32:
        assert not d.mmq_ok(mat(qt, 96, block + 32)) and d.mmvf_ok(mat(qt, 96, block + 32))


def test_a_q5_k_m_file_decodes_its_batches_on_the_tensor_cores():
    """Q5_K_M (Q5_K with Q6_K attn_v, ffn_down and head): every group on mmqs.cu up to 16 rows,
    the head on mmq.cu's tiles beyond, and short prompts on the tensor cores."""
    groups, head = dense(Q5_K_M)
    disp = Dispatcher(groups, head, split16_kept=False)
    assert disp.mmq_all and disp.mmqs_all and disp.mmq_min_rows == d.MMQS_MIN_ROWS
    for rows in (4, 16, 64):
        step = disp.decode_step(rows)
        assert step.family == "mmq"
        assert all(disp.linear(step, g).kernel in (Kernel.MMQS, Kernel.MMQ) for kind, g in groups if kind == "linear")
    assert disp.head(16) is Kernel.MMQS and disp.head(64) is Kernel.MMQ
    assert disp.prompt_step(40) == Step("mmq", 48)


def test_the_quant_table_covers_the_types_of_published_files_and_their_tensor_core_rows():
    """Every type of the K-quant, I-quant and MXFP4 files people download has a GPU decoder (GEMV,
    dequantize, embed, split16) and every one but Q2_K a tensor-core row."""
    published = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
                 Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.MXFP4}
    assert published <= {q for q, info in QTYPES.items() if info.blocks}
    assert published - d.MMQ_TYPES == {Q.Q2_K} and published - d.MMQS_TYPES == {Q.Q2_K, Q.Q4_0, Q.Q4_1}
    assert set(TENSOR_CORE_TYPES) == set(d.MMQ_TYPES) and set(SMALL_TYPES) == set(d.MMQS_TYPES)


def test_a_q2_k_group_runs_on_the_gemvs_and_its_prompts_on_split16():
    """Q2_K (UD-Q2_K_XL's FFN matrices, say) has no tensor-core kernel: a group with a Q2_K matrix
    stays on the GEMVs in a batched step (nothing silently drops a row at a time: the rest keeps the
    tensor cores), and prompts go from the GEMVs to the split16 GEMMs."""
    groups, head = dense({**Q4_K_M, "gate": Q.Q2_K, "up": Q.Q2_K})
    disp = Dispatcher(groups, head, split16_kept=True)
    step = disp.decode_step(16)
    assert step.family == "mmq" and not disp.mmq_all
    assert disp.gated(step, *groups[2][1]) == d.Choice((Kernel.MMVF, Kernel.MMVF), True)
    assert disp.linear(step, groups[0][1]).kernel is Kernel.MMQS
    assert disp.prompt_step(12).family == "split16" and disp.prompt_step(11).family == "gemv"


@pytest.mark.parametrize("qt", list(QTYPES), ids=lambda q: q.name)
def test_the_gpu_loader_takes_every_type_of_its_table(qt):
    info = QTYPES[qt]
    cols = 2 * max(info.block, 32)
    assert check_matrix("m.gguf", "blk.0.ffn_up.weight", qt, (5, cols), 5 * row_bytes(qt, cols)) is info


@pytest.mark.parametrize("qt", [Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0], ids=lambda q: q.name)
def test_the_gpu_loader_refuses_a_type_it_cannot_run_naming_tensor_and_type(qt):
    """A file the NumPy backend opens but with a tensor of a type the GPU has no kernel for is
    refused at load, before anything is uploaded, with the tensor and its type in the message."""
    with pytest.raises(UnsupportedModelError, match=f"tensor blk.3.attn_q.weight: type {qt.name} has no GPU kernel"):
        check_matrix("m.gguf", "blk.3.attn_q.weight", qt, (4, 512), 4 * row_bytes(qt, 512))


def test_the_gpu_loader_refuses_partial_blocks_and_wrong_sizes():
    with pytest.raises(UnsupportedModelError, match=r"not a matrix \(or a stack of experts' matrices\) of whole IQ4_XS"):
        check_matrix("m.gguf", "w", Q.IQ4_XS, (4, 288), 4 * 288)
    with pytest.raises(UnsupportedModelError, match="of whole MXFP4 blocks"):
        check_matrix("m.gguf", "w", Q.MXFP4, (2, 4, 4, 64), 0)
    assert check_matrix("m.gguf", "blk.0.ffn_up_exps.weight", Q.MXFP4, (32, 2880, 2880), 32 * 2880 * 90 * 17)
    with pytest.raises(UnsupportedModelError, match="tensor w: 100 bytes for shape"):
        check_matrix("m.gguf", "w", Q.Q3_K, (4, 256), 100)


def test_one_row_steps_take_mmv8_for_large_groups_of_its_types():
    """The table's rule on Qwen2.5-1.5B and -7B Q4_K_M shapes: one-row steps multiply a group on
    mmv8.cu when all its types are MMV8_TYPES and it holds MMV8_MIN_BYTES of weights (1.5B: gate/up
    fused, the Q6_K down projection and the LM head; 7B: every group but the output projection); two
    rows and the small groups stay on mmvf.cu."""
    assert {Q.Q4_K, Q.Q6_K} <= d.MMV8_TYPES <= d.MMV8_KERNEL_TYPES
    for shape, takes in (({}, {("gated", "gate"), ("linear", "down")}),
                         ({"hidden": 3584, "q_dim": 3584, "kv_dim": 512, "ffn": 18944, "vocab": 152064},
                          {("linear", "q"), ("gated", "gate"), ("linear", "down")})):
        groups, head = dense(Q4_K_M, **shape)
        disp = Dispatcher(groups, head, split16_kept=False)
        one, two = disp.decode_step(1), disp.decode_step(2)
        for kind, g in groups:
            c1 = disp.gated(one, *g) if kind == "gated" else disp.linear(one, g)
            c2 = disp.gated(two, *g) if kind == "gated" else disp.linear(two, g)
            want = Kernel.MMV8 if (kind, g[0].name) in takes else Kernel.MMVF
            assert c1.kernel is want and c1.fused == (kind == "gated"), (shape, g[0].name)
            assert c2.kernel is Kernel.MMVF
        assert disp.head(1) is Kernel.MMV8


def test_mmv8_takes_a_group_only_when_it_takes_every_matrix():
    """A group with a type mmv8.cu does not take (an I-quant below 4 bits), or a row too long for its
    shared memory, stays on mmvf.cu whole: one launch a group; IQ4_XS beside Q4_K takes it."""
    disp = Dispatcher(*dense(Q4_K_M), split16_kept=False)
    one = disp.decode_step(1)
    big = 8192                                           # rows enough for MMV8_MIN_BYTES at this width
    iq = mat(Q.IQ3_S, big, 3584)
    assert disp.linear(one, (mat(Q.Q4_K, big, 3584),)).kernels == (Kernel.MMV8,)
    assert disp.linear(one, (mat(Q.Q4_K, big, 3584), iq)).kernels == (Kernel.MMVF, Kernel.MMVF)
    assert disp.linear(one, (mat(Q.Q4_K, big, 3584), mat(Q.IQ4_XS, big, 3584))).kernels == (Kernel.MMV8,) * 2
    longest = 100 * 1024 * 4 // 5                      # K + K / 4 bytes of shared memory: 100 KB
    assert disp.linear(one, (mat(Q.Q4_K, 512, longest),)).kernels == (Kernel.MMV8,)
    assert disp.linear(one, (mat(Q.Q4_K, 512, longest + 256),)).kernels == (Kernel.MMVF,)


def test_grouped_experts_take_the_steps_from_their_row_count_where_every_stack_has_mmq(monkeypatch):
    """With MOE_GROUPED_MIN_ROWS at 16 (the table has 2), steps of that many rows or more run the
    experts on the grouped tiles where gate and up share type and shape and every stack has an mmq.cu
    kernel (the down projection's stack is needed to say so); others stay on the pairs (one row of
    mmv8.cu's types: its 8-bit pairs)."""
    monkeypatch.setattr(d, "MOE_GROUPED_MIN_ROWS", 16)
    groups, head = moe()
    disp = Dispatcher(groups, head, split16_kept=True)
    router, (gate, up, down) = groups[2][1][0], groups[3][1]
    one = Kernel.MOE_PAIRS8 if d.MOE_PAIRS8 else Kernel.MOE_PAIRS
    for rows, want in ((1, one), (15, Kernel.MOE_PAIRS), (16, Kernel.MOE_GROUPED),
                       (512, Kernel.MOE_GROUPED)):
        assert disp.experts(Step("mmq", rows), router, gate, up, down=down).experts == want, rows
    assert disp.experts(Step("mmq", 64), router, gate, up).experts == Kernel.MOE_PAIRS        # no down given
    for kw in ({"up": Q.Q6_K}, {"down": Q.Q2_K}, {"gate": Q.F32, "up": Q.F32}):
        g2, _ = moe(**kw)
        gate2, up2, down2 = g2[3][1]
        assert disp.experts(Step("mmq", 64), router, gate2, up2, down=down2).experts == Kernel.MOE_PAIRS, kw


def test_grouped_experts_take_8bit_records_where_every_stack_is_of_the_8bit_types(monkeypatch):
    """With the rule on (dispatch.MOE_GROUPED_A8): the grouped tiles read 8-bit records where gate,
    up and down are all MMQ8_TYPES (gpt-oss's MXFP4 and the IQ4 types too); a stack of a 2- or 3-bit
    I-quant or Q3_K keeps the fp16 records, and steps on the pairs never ask for them."""
    monkeypatch.setattr(d, "MOE_GROUPED_A8", True)
    for kw, want in (({}, True), ({"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q5_K}, True),
                     ({"gate": Q.Q5_0, "up": Q.Q5_0, "down": Q.Q4_1}, True), ({"down": Q.IQ4_XS}, True),
                     ({"gate": Q.MXFP4, "up": Q.MXFP4, "down": Q.MXFP4}, True), ({"down": Q.IQ3_S}, False),
                     ({"gate": Q.Q3_K, "up": Q.Q3_K}, False)):
        groups, head = moe(**kw)
        disp = Dispatcher(groups, head, split16_kept=False)
        router, (gate, up, down) = groups[2][1][0], groups[3][1]
        choice = disp.experts(Step("mmq", 64), router, gate, up, down=down)
        assert choice.experts is Kernel.MOE_GROUPED and choice.a8 is want, kw
        assert not disp.experts(disp.decode_step(1), router, gate, up, down=down).a8
    monkeypatch.setattr(d, "MOE_GROUPED_A8", False)
    groups, head = moe()
    router, (gate, up, down) = groups[2][1][0], groups[3][1]
    assert not Dispatcher(groups, head, split16_kept=False).experts(Step("mmq", 64), router, gate, up, down=down).a8


def test_a_shared_expert_takes_the_dense_rule():
    """A shared expert (qwen35moe): its gate and up (one group) and its down projection take what
    linear() gives the step (the GEMVs at one row, the tensor-core tiles in an mmq step, split16 in a
    GEMM step), its gate logit a GEMV."""
    groups, head = moe()
    sg, su = mat(Q.Q4_K, 512, 2048, "shexp_gate"), mat(Q.Q4_K, 512, 2048, "shexp_up")
    sd, sr = mat(Q.Q6_K, 2048, 512, "shexp_down"), mat(Q.F32, 1, 2048, "shexp_router")
    groups += [("gated", (sg, su)), ("linear", (sd,)), ("router", (sr,))]
    disp = Dispatcher(groups, head, split16_kept=True)
    router, (gate, up, down) = groups[2][1][0], groups[3][1]
    steps = [disp.decode_step(1), disp.decode_step(8), disp.prompt_step(12), disp.prompt_step(512)]
    assert [s.family for s in steps] == ["gemv", "mmq", "mmq", "split16"]
    for step in steps:
        choice = disp.experts(step, router, gate, up, (sg, su, sd, sr), down)
        want = (*disp.linear(step, (sg, su)).kernels, disp.linear(step, (sd,)).kernels[0], Kernel.GEMV)
        assert choice.shared == want, step
    assert disp.experts(steps[0], router, gate, up, (sg, su, sd, sr), down).shared[:3] == (Kernel.MMVF,) * 3
    assert disp.experts(steps[3], router, gate, up, (sg, su, sd, sr), down).shared[:3] == (Kernel.SPLIT16,) * 3
    assert disp.experts(steps[3], router, gate, up, (), down).shared == ()


@pytest.mark.parametrize("T,k,E,bn", [(1, 8, 128, 8), (16, 8, 128, 8), (64, 8, 128, 8), (512, 8, 128, 32),
                                      (2048, 8, 128, 64), (7, 2, 6, 8), (40, 4, 8, 32)])
def test_grouped_plan_tile_height_and_bound(T, k, E, bn):
    """moe_grouped_plan: the smallest tile height holding the mean pairs per expert, and a token-tile
    bound no routing exceeds (one pair on each of min(E, P) - 1 experts and the rest on one; an even
    spread)."""
    got_bn, TB = d.moe_grouped_plan(T, k, E)
    assert got_bn == bn
    P = T * k
    n = min(E, P)
    for counts in ([1] * (n - 1) + [P - n + 1], [P // E + (i < P % E) for i in range(E)], [P]):
        assert sum(-(-c // bn) for c in counts) <= TB, counts
    assert TB <= -(-P // bn) + n        # and never more than one extra tile per expert with pairs


def test_the_chunked_delta_rule_threshold_holds_a_chunk():
    """DN_CHUNK_MIN_TOKENS (None: off) is at least a chunk of deltanet.cu's dn_chunk: ops.dn_delta
    refuses less in the middle of a prompt step."""
    from realizar_backend.backends.cuda.support import DN_CHUNK
    assert d.DN_CHUNK_MIN_TOKENS is None or d.DN_CHUNK_MIN_TOKENS >= DN_CHUNK


def test_one_row_experts_take_mmv8_where_every_stack_is_of_its_types(monkeypatch):
    """With the rule on (dispatch.MOE_PAIRS8): MOE_PAIRS8 at one-row steps only, where gate, up and down
    are all MMV8_TYPES (gpt-oss's MXFP4 too) and gate and up share type and shape; a stack of another
    type (Q8_0), gate and up apart, or wider steps keep the pairs (or the grouped tiles)."""
    monkeypatch.setattr(d, "MOE_PAIRS8", True)
    for kw, want in (({}, Kernel.MOE_PAIRS8), ({"down": Q.Q4_K}, Kernel.MOE_PAIRS8),
                     ({"gate": Q.IQ4_XS, "up": Q.IQ4_XS, "down": Q.Q5_K}, Kernel.MOE_PAIRS8),
                     ({"down": Q.Q8_0}, Kernel.MOE_PAIRS),
                     ({"gate": Q.MXFP4, "up": Q.MXFP4, "down": Q.MXFP4}, Kernel.MOE_PAIRS8),
                     ({"gate": Q.MXFP4, "up": Q.MXFP4, "down": Q.Q8_0}, Kernel.MOE_PAIRS),
                     ({"up": Q.Q6_K}, Kernel.MOE_PAIRS)):
        groups, head = moe(**kw)
        disp = Dispatcher(groups, head, split16_kept=False)
        router, (gate, up, down) = groups[2][1][0], groups[3][1]
        assert disp.experts(disp.decode_step(1), router, gate, up, down=down).experts is want, kw
        assert disp.experts(Step("gemv", 2), router, gate, up, down=down).experts is not Kernel.MOE_PAIRS8


# ---------------------------------------------------------------- the device's shared memory
def test_sm_80_and_sm_90_keep_the_full_plan_and_the_prebuilt_modules():
    """Where a block holds 163 KB or more, the staged kernels keep the catalog's limits: the Q4_K ring,
    100 KB staged rows, the same module options (so the shipped cubins serve them) and the same
    choices of kernel as the dispatcher without a device."""
    from realizar_backend.kernels import catalog
    from support.devices import SMEM_OPTIN
    shipped = set(catalog.variants())
    groups, head = dense(Q4_K_M, hidden=4096, q_dim=4096, kv_dim=1024, ffn=14336, vocab=128256)
    full = Dispatcher(groups, head, split16_kept=False)
    for arch in ("sm_80", "sm_90"):
        lim = d.smem_limits(SMEM_OPTIN[arch])
        assert (lim.mmv8_rows, lim.mmvf_rows, lim.attention, lim.mmv8_ring) == (100 * 1024,) * 3 + (True,)
        assert lim.reductions() == []
        for kind in (1, 2, 3):
            assert lim.mmv8_smem(kind) == catalog.MMV8_SMEM_MAX + catalog.mmv8_ring_smem(kind)
            assert lim.mmv8_smem(kind) + d.SMEM_STATIC_RESERVE <= SMEM_OPTIN[arch]
            opts = catalog.mmv8_options(kind, lim.mmv8_ring)
            assert opts == catalog.mmv8_options(kind) and ("mmv8.cu", opts) in shipped
        disp = Dispatcher(groups, head, split16_kept=False, smem=lim)
        for step in (disp.decode_step(1), disp.decode_step(2)):
            for kind, g in groups:
                pick = (lambda x: x.gated(step, *g)) if kind == "gated" else (lambda x: x.linear(step, g))
                assert pick(disp) == pick(full), (arch, step, g[0].name)
        assert disp.head(1) is full.head(1) is Kernel.MMV8


def test_a_99_kb_block_drops_the_mmv8_ring_and_never_asks_more_than_it_holds():
    """sm_86 / sm_89 (99 KB a block): mmv8.cu's kinds 1 and 2 built without the ring (their own
    options, compiled by NVRTC: none ships), every staged kernel's dynamic shared memory within the
    block beside the static reserve; the experts' moe8 module (no ring) keeps its shipped options."""
    from realizar_backend.kernels import catalog
    from support.devices import SMEM_OPTIN
    optin = SMEM_OPTIN["sm_86"]
    lim = d.smem_limits(optin)
    assert not lim.mmv8_ring and lim.optin == optin
    for kind in (1, 2, 3):
        assert lim.mmv8_smem(kind) + d.SMEM_STATIC_RESERVE <= optin
        assert lim.mmv8_smem(kind) == lim.mmv8_rows       # no ring after the row
    assert lim.mmvf_rows + d.SMEM_STATIC_RESERVE <= optin and lim.attention + d.SMEM_STATIC_RESERVE <= optin
    shipped = set(catalog.variants())
    for kind in (1, 2):
        opts = catalog.mmv8_options(kind, lim.mmv8_ring)
        assert "-DMMV8_RING=0" in opts and ("mmv8.cu", opts) not in shipped
    assert catalog.mmv8_options(3, lim.mmv8_ring) == catalog.mmv8_options(3)
    # attention.cu's prompt tile of the largest head (ops.attention) still fits
    assert 4 * (16 * 256 + 2 * 32 * (256 + 4)) <= lim.attention
    assert any("ring" in r for r in lim.reductions())


def test_on_a_99_kb_block_a_long_ffn_row_keeps_mmv8_and_an_over_long_row_goes_to_mmvf():
    """Llama-3-8B's down projection (4096 x 14336 Q4_K: 17,920 bytes of staged 8-bit row) takes mmv8.cu
    on every device; a row whose 8-bit form fills the full 100 KB takes it on sm_90 and mmvf.cu (the
    path of rows too long to stage) where a block holds 99 KB."""
    from support.devices import SMEM_OPTIN
    groups, head = dense(Q4_K_M)
    small, full = d.smem_limits(SMEM_OPTIN["sm_86"]), d.smem_limits(SMEM_OPTIN["sm_90"])
    down = mat(Q.Q4_K, 4096, 14336)
    longest = 100 * 1024 * 4 // 5                      # K + K / 4 bytes of shared memory: 100 KB
    too_long = mat(Q.Q4_K, 512, longest)
    assert d.mmv8_smem(longest) == d.MMV8_SMEM_MAX > small.mmv8_rows
    for lim, want in ((full, Kernel.MMV8), (small, Kernel.MMVF)):
        disp = Dispatcher(groups, head, split16_kept=False, smem=lim)
        one = disp.decode_step(1)
        assert disp.linear(one, (down,)).kernels == (Kernel.MMV8,)
        assert d.mmv8_ok(down, lim)
        assert disp.linear(one, (too_long,)).kernels == (want,)
        assert d.mmv8_ok(too_long, lim) is (want is Kernel.MMV8)


def test_on_a_99_kb_block_the_experts_combine_takes_only_the_rows_it_holds(monkeypatch):
    """moe8_down_combine stages a token's top_k 8-bit rows: 20 rows of 4096 values (100 KB) fit sm_90's
    block and not a 99 KB one (moe8_gemv_nb1 then moe_combine); the one-row pairs of 2048-value rows
    keep mmv8.cu there (MOE_PAIRS8)."""
    from support.devices import SMEM_OPTIN
    monkeypatch.setattr(d, "MOE_PAIRS8", True)
    small, full = d.smem_limits(SMEM_OPTIN["sm_86"]), d.smem_limits(SMEM_OPTIN["sm_90"])
    down = mat(Q.Q4_K, 1024, 4096)
    assert d.moe8_combine_ok(down, 20, full) and not d.moe8_combine_ok(down, 20, small)
    assert d.moe8_combine_ok(down, 8, small)
    groups, head = moe()
    router, (gate, up, dn) = groups[2][1][0], groups[3][1]
    disp = Dispatcher(groups, head, split16_kept=False, smem=small)
    assert disp.experts(disp.decode_step(1), router, gate, up, down=dn).experts is Kernel.MOE_PAIRS8


def test_mmq_tiles_take_the_widest_width_the_block_holds():
    """mmq.cu's token tiles: sm_80 and sm_90 hold every width on either kind of records (64, today's
    plan); a 99 KB block holds the 8-bit records' tiles at every width and the fp16 records' up to 32
    tokens (64 takes 110 KB), each within the block beside the static reserve; the loader logs the
    narrower fp16 tiles."""
    from realizar_backend.kernels import catalog
    from support.devices import SMEM_OPTIN
    assert (d.FULL_SMEM.mmq_bn_max(False), d.FULL_SMEM.mmq_bn_max(True)) == (64, 64)
    for arch, optin in SMEM_OPTIN.items():
        lim = d.smem_limits(optin)
        want = {False: 64 if optin > 110 * 1024 else 32, True: 64}
        for a8 in (False, True):
            bn = lim.mmq_bn_max(a8)
            assert bn == want[a8], (arch, a8)
            assert catalog.mmq_smem_bytes(bn, a8) + d.SMEM_STATIC_RESERVE <= optin
            wider = [b for b in catalog.MMQ_BN if b > bn]
            assert all(catalog.mmq_smem_bytes(b, a8) + d.SMEM_STATIC_RESERVE > optin for b in wider)
    assert catalog.mmq_smem_bytes(64) > SMEM_OPTIN["sm_86"]
    assert any("mmq.cu" in r and "fp16" in r for r in d.smem_limits(SMEM_OPTIN["sm_86"]).reductions())
    assert not any("mmq.cu" in r for r in d.smem_limits(SMEM_OPTIN["sm_80"]).reductions())


def test_grouped_experts_keep_their_tiles_within_the_block():
    """moe_grouped_plan under a device's limit: on sm_80 / sm_90 today's plan for every step; on a
    99 KB block the fp16 records' tiles at most 32 high (the steps whose mean pairs per expert take
    64 take 32, their bound over as many more tiles), the 8-bit records' as today; the bound holds
    for any routing either way."""
    from support.devices import SMEM_OPTIN
    for arch, optin in SMEM_OPTIN.items():
        lim = d.smem_limits(optin)
        for a8 in (False, True):
            bn_max = lim.mmq_bn_max(a8)
            for E, k in ((128, 8), (64, 8), (32, 4), (8, 2)):
                for T in (*range(1, 257), 512, 2048):
                    bn, TB = d.moe_grouped_plan(T, k, E, bn_max)
                    today = d.moe_grouped_plan(T, k, E)
                    assert bn <= bn_max
                    if bn_max == 64 or today[0] <= bn_max:
                        assert (bn, TB) == today, (arch, a8, E, k, T)
                    else:
                        assert bn == 32 and today[0] == 64
                    P, n = T * k, min(E, T * k)
                    assert sum(-(-c // bn) for c in [1] * (n - 1) + [P - n + 1]) <= TB
                    assert sum(-(-c // bn) for c in [P // E + (i < P % E) for i in range(E)]) <= TB
    assert d.moe_grouped_plan(2048, 8, 128, d.smem_limits(SMEM_OPTIN["sm_89"]).mmq_bn_max(False))[0] == 32
