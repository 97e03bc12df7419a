"""How the CUDA backend runs a prompt step of T tokens (backends/cuda/forward.py prompt_step): the
GEMVs for a few tokens, the tensor-core projections padded to a token bucket up to
Settings.prompt_mmq_tokens, the prefill GEMMs beyond; and the keys of the prompt-step graphs.
Pure arithmetic: runs wherever CuPy imports, GPU or not."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy")
from realizar_backend.backends.cuda import forward  # noqa: E402
from realizar_backend.backends.cuda.graphs import PrefillGraphs  # noqa: E402
from realizar_backend.settings import Settings  # noqa: E402

GEMM_MIN = forward.GEMM_MIN_TOKENS_KEPT


def test_default_buckets():
    assert Settings().prompt_mmq_tokens == 64
    assert forward.prompt_buckets(64) == (8, 16, 32, 48, 64)
    assert forward.prompt_buckets(0) == ()
    assert forward.prompt_buckets(8) == (8,)
    assert forward.prompt_buckets(40) == (8, 16, 32, 40)


@pytest.mark.parametrize("limit", range(8, 257, 8))
def test_every_step_fits_its_bucket_with_under_a_block_of_padding(limit):
    """Each step up to the limit has a bucket that holds it with fewer than 16 rows to spare: the
    padding fits one KV block of the scratch slot (default block size 16) as one run of rows."""
    buckets = forward.prompt_buckets(limit)
    assert buckets[-1] == limit and list(buckets) == sorted(set(buckets))
    for T in range(forward.SMALL_MIN_ROWS, limit + 1):
        kind, rows = forward.prompt_step(T, forward.SMALL_MIN_ROWS, buckets, GEMM_MIN)
        assert kind == "mmq" and T <= rows < T + 16 and rows in buckets


def test_a_16_token_tail_is_one_tensor_core_bucket():
    b = forward.prompt_buckets(64)
    assert forward.prompt_step(16, forward.SMALL_MIN_ROWS, b, GEMM_MIN) == ("mmq", 16)
    assert forward.prompt_step(17, forward.SMALL_MIN_ROWS, b, GEMM_MIN) == ("mmq", 32)
    assert forward.prompt_step(64, forward.SMALL_MIN_ROWS, b, GEMM_MIN) == ("mmq", 64)


def test_below_the_tensor_core_rows_the_gemvs_and_past_the_limit_the_gemms():
    b = forward.prompt_buckets(64)
    for T in range(1, forward.SMALL_MIN_ROWS):
        assert forward.prompt_step(T, forward.SMALL_MIN_ROWS, b, GEMM_MIN) == ("gemv", T)
    # a model whose matrices only mmq.cu's tiles take: from MMQ_MIN_ROWS
    assert forward.prompt_step(5, forward.MMQ_MIN_ROWS, b, GEMM_MIN) == ("gemv", 5)
    assert forward.prompt_step(8, forward.MMQ_MIN_ROWS, b, GEMM_MIN) == ("mmq", 8)
    for T, rows in ((65, 128), (100, 128), (512, 512), (513, 576), (4096, 4096)):
        assert forward.prompt_step(T, forward.SMALL_MIN_ROWS, b, GEMM_MIN) == ("gemm", rows)


def test_without_tensor_core_prompt_steps_the_old_split_holds():
    """prompt_mmq_tokens 0, or a model with a projection the tensor cores do not take: GEMVs below
    gemm_min_tokens at the exact token count, GEMMs from there on a multiple of GEMM_ROW_STEP rows
    (fewer than that of padding: the keys of their graphs recur)."""
    step = forward.GEMM_ROW_STEP
    for T in range(1, 300):
        kind, rows = forward.prompt_step(T, forward.SMALL_MIN_ROWS, (), GEMM_MIN)
        if T < GEMM_MIN:
            assert (kind, rows) == ("gemv", T)
        else:
            assert kind == "gemm" and rows % step == 0 and T <= rows < T + step


def test_prompt_graph_labels_name_the_key():
    assert PrefillGraphs.label((16, 1, 1, "mmq")) == "16 rows, 1 sequence, 1 splits, MMQ"
    assert PrefillGraphs.label((3, 2, 4, "gemv")) == "3 rows, 2 sequences, 4 splits, GEMV"
