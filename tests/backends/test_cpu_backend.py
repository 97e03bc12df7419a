"""The NumPy backend's batching and paging: several sequences in one step give what each gives
alone; K/V read and written through block tables (scattered blocks, chunks, shared prefixes)."""

import numpy as np
import pytest

from support.paging import contiguous_tables
from realizar_backend.backends import cpu_memory_bytes
from realizar_backend.backends import GREEDY, PrefillItem, Step
from realizar_backend.backends.cpu import CPUBackend, apply_rope, attention, rope_angles


@pytest.fixture(scope="module")
def backend(smol_model):
    return contiguous_tables(CPUBackend(smol_model, max_slots=9, max_context=128))


def assert_same_logits(actual, desired):
    """Equal up to float32 summation order, measured against the logits' own scale.

    Different batch shapes take different BLAS kernels (and different ones on different CPUs), so
    30 layers of float32 drift by ~1e-5 of the largest logit; a slot that read another sequence's
    cache or rows is off by the size of the logits themselves.
    """
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape
    err = float(np.abs(actual - desired).max())
    scale = float(np.abs(desired).max())
    assert err <= 1e-4 * scale, f"max |diff| {err:.3g} against max |logit| {scale:.3g}"


def test_eight_sequences_decode_in_one_batch_like_alone(backend):
    rng = np.random.default_rng()
    vocab = backend.config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(n), dtype=np.int32) for n in rng.integers(3, 20, size=8)]
    steps = 6
    # batched: prefill all eight together, then decode all eight per step
    first = backend.prefill([PrefillItem(i, p, 0) for i, p in enumerate(prompts)])
    toks = list(np.argmax(first, axis=-1))
    batched, fed = [], []
    for s in range(steps):
        fed.append(toks)
        logits = backend.decode(list(range(8)), toks, [len(p) + s for p in prompts])
        batched.append(logits)
        toks = list(np.argmax(logits, axis=-1))
    # alone: slot 8, one sequence at a time
    for i, p in enumerate(prompts):
        alone_first = backend.prefill([PrefillItem(8, p, 0)])
        assert_same_logits(alone_first[0], first[i])
        # feed the batched run's tokens: a near-tie may flip an argmax between BLAS shapes
        for s in range(steps):
            logits = backend.decode([8], [fed[s][i]], [len(p) + s])
            assert_same_logits(logits[0], batched[s][i])


def test_prefill_in_two_chunks_equals_one(backend):
    rng = np.random.default_rng()
    ids = rng.integers(0, backend.config.vocab_size, size=30, dtype=np.int32)
    whole = backend.prefill([PrefillItem(0, ids, 0)])
    backend.prefill([PrefillItem(0, ids[:17], 0)])
    chunked = backend.prefill([PrefillItem(0, ids[17:], 17)])
    assert_same_logits(chunked, whole)


@pytest.fixture(scope="module")
def paged(smol_model):
    """Small blocks, so that short prompts span many of them."""
    return CPUBackend(smol_model, max_slots=3, max_context=96, block_size=4, num_blocks=40)


def test_scattered_blocks_and_chunks_give_the_contiguous_logits(paged, backend):
    """A prompt in blocks scattered over the pool (in no order), prefilled in uneven chunks that
    start and end inside blocks, then decoded: the logits of one contiguous one-shot run."""
    rng = np.random.default_rng()
    ids = rng.integers(0, paged.config.vocab_size, size=37, dtype=np.int32)
    table = rng.permutation(paged.num_blocks)[:12]
    paged.set_block_table(0, table)
    ref = backend.prefill([PrefillItem(0, ids, 0)])[0]
    got = None
    for a, b in ((0, 5), (5, 6), (6, 19), (19, 37)):
        got = paged.prefill([PrefillItem(0, ids[a:b], a)])[0]
    assert_same_logits(got, ref)
    tok = int(np.argmax(ref))
    for i in range(4):
        ref = backend.decode([0], [tok], [37 + i])[0]
        got = paged.decode([0], [tok], [37 + i])[0]
        assert_same_logits(got, ref)
        tok = int(np.argmax(ref))


def test_a_slot_sharing_cached_prefix_blocks_prefills_only_the_rest(paged, backend):
    """Slot 1's table starts with slot 0's first blocks (a cached prefix); its prompt's suffix,
    prefilled from start_pos, gives the logits of the whole prompt computed alone, and slot 0's
    own sequence is untouched by it."""
    rng = np.random.default_rng()
    V = paged.config.vocab_size
    prefix = rng.integers(0, V, size=16, dtype=np.int32)
    a = np.concatenate([prefix, rng.integers(0, V, size=7, dtype=np.int32)])
    b = np.concatenate([prefix, rng.integers(0, V, size=5, dtype=np.int32)])
    blocks = rng.permutation(paged.num_blocks)
    paged.set_block_table(0, blocks[:6])                             # 23 positions
    paged.set_block_table(1, np.concatenate([blocks[:4], blocks[6:8]]))   # shares 4 blocks = 16 positions
    la = paged.prefill([PrefillItem(0, a, 0)])[0]
    lb = paged.prefill([PrefillItem(1, b[16:], 16)])[0]
    ref_a = backend.prefill([PrefillItem(0, a, 0)])[0]
    assert_same_logits(la, ref_a)
    assert_same_logits(lb, backend.prefill([PrefillItem(1, b, 0)])[0])
    # both go on together as if each ran alone
    toks = [int(np.argmax(la)), int(np.argmax(lb))]
    got = paged.decode([0, 1], toks, [23, 21])
    assert_same_logits(got[0], backend.decode([0], toks[:1], [23])[0])
    assert_same_logits(got[1], backend.decode([1], toks[1:], [21])[0])


def test_a_position_without_a_block_is_refused(paged):
    paged.set_block_table(2, [1, 2])
    with pytest.raises(ValueError, match="no KV block"):
        paged.prefill([PrefillItem(2, np.arange(9, dtype=np.int32), 0)])
    paged.release(2)
    with pytest.raises(ValueError, match="no KV block"):
        paged.decode([2], [5], [0])
    with pytest.raises(ValueError):
        paged.set_block_table(2, [paged.num_blocks])


def test_rope_styles_rotate_the_pairs_they_name():
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    cos, sin = rope_angles(np.arange(5), 8, 10000.0)
    normal = apply_rope(x, cos, sin, "normal")
    neox = apply_rope(x, cos, sin, "neox")
    # a rotation keeps each pair's length: (0,1) for normal, (0,4) for neox
    np.testing.assert_allclose(np.hypot(normal[..., 0], normal[..., 1]), np.hypot(x[..., 0], x[..., 1]), rtol=1e-5)
    np.testing.assert_allclose(np.hypot(neox[..., 0], neox[..., 4]), np.hypot(x[..., 0], x[..., 4]), rtol=1e-5)
    # position 0 is the identity
    np.testing.assert_allclose(normal[0], x[0])
    assert not np.allclose(normal[1:], neox[1:])


def test_attention_is_causal_and_windowed():
    rng = np.random.default_rng()
    q = rng.standard_normal((4, 4, 8)).astype(np.float32)
    k = rng.standard_normal((4, 2, 8)).astype(np.float32)
    v = rng.standard_normal((4, 2, 8)).astype(np.float32)
    out = attention(q, k, v, np.arange(4), 8 ** -0.5)
    # the first query sees only the first key: its output is that key's value (per KV group)
    np.testing.assert_allclose(out[0].reshape(4, 8)[0], v[0, 0], rtol=1e-5)
    np.testing.assert_allclose(out[0].reshape(4, 8)[3], v[0, 1], rtol=1e-5)
    # window 1: every query sees only itself
    w1 = attention(q, k, v, np.arange(4), 8 ** -0.5, window=1)
    np.testing.assert_allclose(w1[3].reshape(4, 8)[0], v[3, 0], rtol=1e-5)


def test_a_dense_model_holds_kv_for_every_layer(backend, smol_model):
    """Every layer of a dense model keeps K and V (a hybrid's recurrent layers keep none:
    test_cpu_hybrid_kv.py), and no recurrent state."""
    md = smol_model.metadata
    per_token = 2 * md["llama.block_count"] * md["llama.attention.head_count_kv"] * backend.config.head_dim * 4
    st = backend.stats()
    assert st["kv_pool_bytes"] == backend.num_blocks * backend.block_size * per_token
    assert st["recurrent_state_bytes"] == 0
    assert cpu_memory_bytes(smol_model, 1)[1] == per_token


def test_fp16_kv_cache_stays_close_to_fp32(smol_model):
    rng = np.random.default_rng()
    ids = rng.integers(0, smol_model.config.vocab_size, size=40, dtype=np.int32)
    ref = contiguous_tables(CPUBackend(smol_model, max_slots=1, max_context=64))
    half = contiguous_tables(CPUBackend(smol_model, max_slots=1, max_context=64, kv_dtype=np.float16))
    assert half.k_pool[0].dtype == np.float16 and half.k_pool[0].nbytes * 2 == ref.k_pool[0].nbytes
    a, b = ref.prefill([PrefillItem(0, ids, 0)])[0], half.prefill([PrefillItem(0, ids, 0)])[0]
    for i in range(4):
        t = int(np.argmax(a))
        a, b = ref.decode([0], [t], [40 + i])[0], half.decode([0], [t], [40 + i])[0]
        cos = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
        assert 0.9999 < cos and not np.array_equal(a, b)


def test_started_greedy_steps_continue_on_their_own_tokens(backend):
    """A step without tokens continues the previous step's sequences with its tokens at the next
    positions: greedy, the argmax of the logits the caller feeding them gets; other slots than
    the previous step's are refused."""
    rng = np.random.default_rng()
    vocab = backend.config.vocab_size
    prompts = [rng.integers(0, vocab, size=5 + i, dtype=np.int32) for i in range(2)]
    runs = []
    for chained in (False, True):
        first = backend.prefill([PrefillItem(s, p, 0) for s, p in enumerate(prompts)]).argmax(-1)
        toks, pos = [int(t) for t in first], [len(p) for p in prompts]
        out = []
        if chained:
            h = backend.execute(Step(slots=[0, 1], tokens=toks, positions=pos))
            for _ in range(5):
                backend.sample(h, [GREEDY, GREEDY])
                nxt = backend.execute(Step(slots=[0, 1]))
                out.append(backend.result(h).tokens.tolist())
                h = nxt
            backend.sample(h, [GREEDY, GREEDY])
            out.append(backend.result(h).tokens.tolist())
            with pytest.raises(ValueError):
                backend.execute(Step(slots=[1, 0]))
        else:
            for i in range(6):
                logits = backend.decode([0, 1], toks, [p + i for p in pos])[:, :vocab]
                toks = logits.argmax(-1).tolist()
                out.append(toks)
        runs.append(out)
    assert runs[0] == runs[1]
