"""CUDA-graph A/B: one decode step run eagerly and the same step replayed from the captured
graph must give identical logits (same kernels, same launch shapes, no atomics), on the shape
twins and the real SmolLM2; and greedy output of the real SmolLM2 with graphs off equals the CPU's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from support.paging import contiguous_tables
from support.steps import chained_steps, greedy_step

pytestmark = pytest.mark.gpu

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))


def _model(name):
    from realizar_backend.formats import open_model
    if name == "real":
        p = os.environ.get("REALIZAR_REAL_SMOL")
        if not (p and Path(p).exists()):
            pytest.skip("real SmolLM2 not on this machine")
        return open_model(p)
    path = TWINS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"twin {path} not expanded")
    return open_model(path)


@pytest.mark.parametrize("name", ["smol135", "qwen05", "gemma270", "qwen15", "real"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("programmatic", [True, False], ids=["pdl", "plain"])
def test_eager_equals_replay(name, batch, programmatic, rng):
    """The replayed graph links its kernels by programmatic dependent launch where the GPU has it
    (each kernel starts before the one before ends and must wait for its results): any kernel
    that reads an activation before its pdl_wait() shows here as a replay that differs."""
    import cupy
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model(name)
    gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=128, settings=Settings(self_check=False),
                                        programmatic_launch=programmatic))
    expect_pdl = programmatic and int(cupy.cuda.Device().compute_capability) >= 90
    V = model.config.vocab_size
    gpu.prefill([PrefillItem(s, rng.integers(0, V, 9 + s).astype(np.int32)) for s in range(batch)])
    slots = list(range(batch))
    toks = [int(t) for t in rng.integers(0, V, batch)]
    pos = [9 + s for s in slots]
    eager, replay = gpu.graph_ab_check(slots, toks, pos)
    st = gpu.stats()["graph_status"]
    used = gpu.stats()["programmatic_launch"]
    gpu.close()
    assert used == expect_pdl       # the capture kept the launches asked for (no silent fallback)
    assert np.all(np.isfinite(eager))
    assert np.array_equal(eager, replay), f"max diff {np.abs(eager - replay).max()}"
    assert "captured" in st.values()


def test_real_smollm2_greedy_graphs_off_equals_cpu():
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cpu import CPUBackend
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model("real")
    prompt = np.array([1, 9690, 314, 253, 2377, 30, 1073, 314, 260, 3575, 282, 4649, 47], np.int32)
    cpu = contiguous_tables(CPUBackend(model, max_slots=1, max_context=64))
    gpu = contiguous_tables(CUDABackend(model, max_slots=1, max_context=64,
                                        settings=Settings(self_check=False, cuda_graphs=False)))
    tc = [int(np.argmax(cpu.prefill([PrefillItem(0, prompt)])[0]))]
    tg = [int(np.argmax(gpu.prefill([PrefillItem(0, prompt)])[0]))]
    for i in range(31):
        p = len(prompt) + i
        tc.append(int(np.argmax(cpu.decode([0], [tc[-1]], [p])[0])))
        tg.append(int(greedy_step(gpu, [0], [tg[-1]], [p])[0]))
    st = gpu.stats()["graph_status"]
    gpu.close()
    print(f"greedy cpu {tc}\ngreedy gpu (graphs off) {tg}")
    assert st.get("1") == "disabled"
    assert tc == tg


@pytest.mark.parametrize("name", ["qwen05", "real"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_started_steps_equal_synchronous_steps(name, batch, graphs, rng):
    """Greedy steps chained on the device (a step executed without tokens reads the previous
    step's argmax and next positions, which that step wrote) give the tokens of the same steps fed
    from the host one at a time, with up to two steps in flight."""
    from realizar_backend.backends.base import PrefillItem, Step
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model(name)
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, 7 + 2 * s).astype(np.int32) for s in range(batch)]
    slots = list(range(batch))
    runs = []
    for chained in (False, True):
        gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=128,
                                            settings=Settings(self_check=False, cuda_graphs=graphs)))
        first = gpu.prefill([PrefillItem(s, p) for s, p in zip(slots, prompts)]).argmax(-1)
        toks, pos, out = [int(t) for t in first], [len(p) for p in prompts], []
        if chained:
            out = chained_steps(gpu, slots, toks, pos, 20)
            with pytest.raises(ValueError):
                gpu.execute(Step(slots=slots[::-1] + [3]))
        else:
            for i in range(20):
                toks = greedy_step(gpu, slots, toks, [p + i for p in pos]).tolist()
                out.append(toks)
        gpu.close()
        runs.append(out)
    assert runs[0] == runs[1]


def test_more_steps_in_flight_than_token_ring_rows(rng):
    """The host reads greedy tokens from a ring in mapped memory, a row per step: executing (and
    sampling) more steps than the ring has rows, then a step with new inputs, before reading any,
    still gives each handle its own step's tokens (older steps are read back before their rows are
    reused), also when a handle is asked again."""
    from realizar_backend.backends.base import GREEDY, PrefillItem, Step
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model("qwen05")
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, 9 + s).astype(np.int32) for s in range(2)]
    slots = [0, 1]
    gpu = contiguous_tables(CUDABackend(model, max_slots=2, max_context=128, settings=Settings(self_check=False)))
    first = [int(t) for t in gpu.prefill([PrefillItem(s, p) for s, p in zip(slots, prompts)]).argmax(-1)]
    pos = [len(p) for p in prompts]
    want, toks = [], first
    for i in range(10):
        toks = greedy_step(gpu, slots, toks, [p + i for p in pos]).tolist()
        want.append(toks)
    assert gpu.token_ring.length < 10

    def executed(step):
        h = gpu.execute(step)
        gpu.sample(h, [GREEDY, GREEDY])
        return h
    handles = [executed(Step(slots=slots, tokens=first, positions=pos))]
    handles += [executed(Step(slots=slots)) for _ in range(9)]
    again = executed(Step(slots=slots, tokens=first, positions=pos))    # new inputs: the first step once more
    assert [gpu.result(h).tokens.tolist() for h in handles] == want
    assert gpu.result(again).tokens.tolist() == want[0]
    assert gpu.result(handles[0]).tokens.tolist() == want[0]
    gpu.close()


def test_graph_counters_count(rng):
    """stats() reports the decode graphs' captures and replays as they happen (they feed the
    realizar_graph_captures_total / realizar_graph_replays_total counters): the first step of a
    bucket runs eager and captures, every later step of it replays."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model("smol135")
    V = model.config.vocab_size
    gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=64, settings=Settings(self_check=False)))
    assert (gpu.stats()["graph_captures"], gpu.stats()["graph_replays"]) == (0, 0)
    gpu.prefill([PrefillItem(s, rng.integers(0, V, 5).astype(np.int32)) for s in range(3)])
    toks = [int(t) for t in rng.integers(0, V, 3)]
    for i in range(6):                       # bucket 4: captured at step 0, replayed at 1..5
        toks = greedy_step(gpu, [0, 1, 2], toks, [5 + i] * 3).tolist()
    greedy_step(gpu, [0], toks[:1], [11])    # bucket 1: one capture, no replay yet
    st = gpu.stats()
    assert st["graph_status"] == {"1": "captured", "4": "captured"}      # short rows: attention.cu
    assert (st["graph_captures"], st["graph_replays"]) == (2, 5)
    gpu.close()


def test_long_rows_replay_their_own_graph(rng):
    """Rows deep in their context take the long-row attention (flash-decoding): a graph of its own
    per bucket ("N-long"), whose replay gives the eager step's logits bit for bit."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.backends.cuda.backend import LONG_ATTENTION_POS
    from realizar_backend.settings import Settings
    model = _model("qwen05")
    V = model.config.vocab_size
    n = LONG_ATTENTION_POS + 100
    gpu = contiguous_tables(CUDABackend(model, max_slots=2, max_context=n + 8, settings=Settings(self_check=False)))
    gpu.prefill([PrefillItem(s, rng.integers(0, V, n).astype(np.int32)) for s in range(2)])
    eager, replay = gpu.graph_ab_check([0, 1], [int(t) for t in rng.integers(0, V, 2)], [n, n])
    st = gpu.stats()["graph_status"]
    gpu.close()
    assert st.get("2-long") == "captured", st
    assert np.array_equal(eager, replay), f"max diff {np.abs(eager - replay).max()}"


@pytest.mark.parametrize("name", ["smol135", "qwen15", "gemma270"])
@pytest.mark.parametrize("tokens", [3, 8, 16, 40])
def test_prompt_step_replay_equals_eager(name, tokens, rng):
    """The few tokens after a cached prefix run as one prompt step on the GEMVs (3) or the
    tensor-core projections (8 and up: a token bucket, padded rows on the scratch slot) that is
    captured (after an eager run) and replayed: the replay writes the same K/V and gives the same
    logits as the eager step."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model(name)
    gpu = contiguous_tables(CUDABackend(model, max_slots=2, max_context=768, settings=Settings(self_check=False)))
    V = model.config.vocab_size
    prompt = rng.integers(0, V, 600 + tokens).astype(np.int32)
    gpu.prefill([PrefillItem(0, prompt[:600])])
    tail = [PrefillItem(0, prompt[600:], 600)]
    if gpu.fwd.prompt_step(tokens).family == "split16":
        gpu.close()
        pytest.skip(f"{name}: {tokens} tokens run on the GEMMs here (a projection without tensor-core kernels)")
    eager = gpu.prefill(tail)                  # eager, then captured
    replay = gpu.prefill(tail)
    captured = gpu.prefill_graphs.captures
    gpu.close()
    assert captured == 1
    assert np.all(np.isfinite(eager))
    assert np.array_equal(eager, replay), f"max diff {np.abs(eager - replay).max()}"


@pytest.mark.parametrize("name", ["qwen15", "gemma270"])
@pytest.mark.parametrize("lengths", [(100,), (150, 170), (40, 50, 61)], ids=lambda t: "+".join(map(str, t)))
def test_gemm_prompt_step_is_captured_when_it_recurs(name, lengths, rng):
    """Prompt steps on the GEMMs run on a multiple of 64 rows and a power of two of head rows
    (padding on the scratch slot): the first step of a key runs eagerly, the second eagerly and is
    captured, the third replays the graph, all with the same logits and the same K/V (the next
    decode step reads it)."""
    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.settings import Settings
    model = _model(name)
    gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=512, settings=Settings(self_check=False)))
    gpu.fwd.dispatcher.buckets = ()            # no tensor-core prompt steps: 100 tokens on the GEMMs too
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, n).astype(np.int32) for n in lengths]
    step = gpu.fwd.prompt_step(sum(lengths))
    assert step.family == "split16" and step.rows % 64 == 0 and step.rows >= sum(lengths)
    items = [PrefillItem(i, p) for i, p in enumerate(prompts)]
    runs, steps = [], []
    for _ in range(3):
        runs.append(gpu.prefill(items))
        steps.append(gpu.decode(list(range(len(items))), [int(t) for t in np.argmax(runs[-1], axis=1)],
                                list(lengths)))
    captures, replays = gpu.prefill_graphs.captures, gpu.prefill_graphs.replays
    gpu.close()
    assert (captures, replays) == (1, 1)
    assert all(np.all(np.isfinite(r)) for r in runs + steps)
    for r in runs[1:]:
        assert np.array_equal(r, runs[0]), f"max diff {np.abs(r - runs[0]).max()}"
    for s in steps[1:]:
        assert np.array_equal(s, steps[0]), f"next step: max diff {np.abs(s - steps[0]).max()}"
