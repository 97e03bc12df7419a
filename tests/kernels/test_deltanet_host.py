"""kernels/deltanet.cu run on the CPU (tests/host/deltanet_emu.cpp over cuda_emu.h: every thread a
fiber, block barriers and warp shuffles real rendezvous) against its NumPy twin in float64
(backends/cuda/deltanet_twin.py, the NumPy backend's delta rule split as the kernels split it): the
causal conv and the gated delta rule over decode rows (one token of each of several slots), a prompt
chunk continuing a slot's state, a sequence's first chunk (position 0: the state there is ignored),
several segments in one step and padding rows on the scratch slot (which keep no state), at the
tiny and the real Qwen3.5/3.6 head sizes and odd ones, through the kernel the launcher picks for the
k_dim (support.dn_delta_kernel: the dn_delta_k<dk> instances, else the general dn_delta), and
through the general kernel at the instances' k_dims too. Outputs are poisoned before
each launch: every value past a row's width must stay so, and so must the states of the slots the step
does not run. A copy of the kernels with the decay left out of the delta term must fail, through the
general kernel and an instance. The chunked rule: dn_chunk_k<dk> then dn_delta_k<dk> (the prompt
step's pair) on segments long enough for it beside ones that are not, against the twin under the same
rule; copies with a slip of the chunked form (no triangular solve, no decay of the carried state) must
fail. Skipped where g++ is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from realizar_backend.backends.cuda import deltanet_twin as twin
from realizar_backend.backends.cuda.support import DN_CHUNK, DN_DELTA_K, dn_chunk_kernel, dn_delta_kernel
from support import host_emu
from support.host_emu import GXX, KERNELS
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

TOL = 2e-5          # float32 against float64, relative to the values' scale
SLOTS = 5
SCRATCH = SLOTS     # the scratch slot: the state arrays hold the live slots only


def build(out: Path, include_first: Path | None = None) -> Path:
    return host_emu.build("deltanet_emu.cpp", out, include_first=include_first)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return build(tmp_path_factory.mktemp("deltanet_emu") / "deltanet_emu")


def launch(emu: Path, tmp_path: Path, kernel: str, outputs: dict, arrays: dict, **params) -> dict:
    return host_emu.launch(emu, tmp_path / f"launch{len(list(tmp_path.iterdir()))}", {"kernel": kernel, **params},
                           arrays, {n: (np.float32, shape) for n, shape in outputs.items()}, label=kernel)


# the rows of a step: (slot, first position, tokens) per segment
STEPS = {
    "decode": [(0, 7, 1), (3, 2, 1), (1, 30, 1), (4, 1, 1)],
    "prompt": [(2, 5, 9)],
    "first-chunk": [(1, 0, 6)],
    "mixed": [(0, 0, 3), (2, 11, 4), (4, 3, 1)],
    "padded": [(3, 4, 2), (SCRATCH, 0, 1), (SCRATCH, 0, 1), (SCRATCH, 0, 2)],
}


def rows(step):
    slots = np.concatenate([np.full(n, s) for s, _, n in step]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in step]).astype(np.int32)
    return slots, pos


def untouched(step) -> list[int]:
    return [s for s in range(SLOTS) if s not in {seg[0] for seg in step}]


@pytest.mark.parametrize("step", STEPS, ids=list(STEPS))
@pytest.mark.parametrize("C,K", [(256, 4), (200, 3), (45, 2)], ids=["qwen35-tiny", "odd", "two-taps"])
def test_conv(emu, tmp_path, step, C, K):
    rng = np.random.default_rng(C + K + len(step))
    slots, pos = rows(STEPS[step])
    n = len(slots)
    xs, os = C + 3, C + 5
    x = rng.standard_normal((n, xs)).astype(np.float32)
    w = (rng.standard_normal((C, K)) / np.sqrt(K)).astype(np.float32)
    st = rng.standard_normal((SLOTS, K - 1, C)).astype(np.float32)
    out = launch(emu, tmp_path, "conv", {"out": (n, os), "conv_state": st.shape},
                 dict(x=x, w=w, conv_state=st, slots=slots, pos=pos, out=np.full((n, os), np.nan, np.float32)),
                 n=n, C=C, taps=K - 1, xs=xs, os=os, scratch=SCRATCH)
    ref, ref_st = twin.conv(x[:, :C], w, st, slots, pos, SCRATCH)
    assert np.max(np.abs(out["out"][:, :C] - ref)) < TOL * max(1.0, np.abs(ref).max())
    assert np.all(np.isnan(out["out"][:, C:])), "values past the rows were written"
    assert np.max(np.abs(out["conv_state"] - ref_st)) < TOL
    for s in untouched(STEPS[step]):
        assert np.array_equal(out["conv_state"][s], st[s])


def delta_inputs(rng, n, nk, dk, nv, dv):
    C = 2 * nk * dk + nv * dv
    return dict(cv=(rng.standard_normal((n, C + 2)) * 0.7).astype(np.float32),
                alpha=rng.standard_normal((n, nv + 1)).astype(np.float32),
                beta=rng.standard_normal((n, nv + 1)).astype(np.float32),
                z=rng.standard_normal((n, nv * dv + 4)).astype(np.float32),
                a_coef=(-np.exp(rng.uniform(-2, 1, nv))).astype(np.float32),
                dt_bias=rng.uniform(-1, 1, nv).astype(np.float32),
                out_norm=rng.uniform(0.5, 1.5, dv).astype(np.float32),
                state=(rng.standard_normal((SLOTS, nv, dk, dv)) * 0.3).astype(np.float32))


def run_delta(emu, tmp_path, step, nk, dk, nv, dv, seed=0, entry=None, chunk_min=0, steps=STEPS):
    """entry: the kernel (None: the launcher's pick for dk). chunk_min: the chunked rule's argument;
    where not 0, the chunked kernel for dk runs first (as ops.dn_delta launches them) and the twin
    takes the same rule."""
    rng = np.random.default_rng(seed + nk * 7 + dk + dv)
    slots, pos = rows(steps[step])
    n = len(slots)
    a = delta_inputs(rng, n, nk, dk, nv, dv)
    os = nv * dv + 3
    chunk = {"chunk": dn_chunk_kernel(dk, dv)} if chunk_min else {}
    got = launch(emu, tmp_path, "delta", {"out": (n, os), "state": a["state"].shape},
                 dict(a, slots=slots, pos=pos, out=np.full((n, os), np.nan, np.float32)),
                 n=n, nk=nk, dk=dk, nv=nv, dv=dv, cvs=a["cv"].shape[1], abs=nv + 1, zs=a["z"].shape[1], os=os,
                 eps=1e-6, scratch=SCRATCH, threads=-(-dv // 32) * 32, entry=entry or dn_delta_kernel(dk),
                 chunk_min=chunk_min, **chunk)
    ref, ref_st = twin.delta(a["cv"][:, :2 * nk * dk + nv * dv], a["alpha"][:, :nv], a["beta"][:, :nv],
                             a["z"][:, :nv * dv], a["a_coef"], a["dt_bias"], a["out_norm"], a["state"], slots, pos,
                             SCRATCH, nk, dk, nv, dv, 1e-6, chunk_min=chunk_min or None, chunk=DN_CHUNK)
    return got, ref, ref_st, a["state"], nv * dv


# (nk, dk, nv, dv, entry): entry None is the launcher's pick (dk 32, 64 and 128: their instances)
SHAPES = {
    "qwen35-tiny": (2, 32, 4, 32, None),
    "wide-v": (2, 32, 4, 64, None),
    "odd": (1, 16, 3, 40, None),
    "k64": (2, 64, 4, 64, None),
    "k64-odd-v": (1, 64, 3, 200, None),
    "qwen36-heads": (4, 128, 16, 128, None),
    "k128-widest": (1, 128, 2, 256, None),
    "general-k64": (2, 64, 4, 64, "dn_delta"),
    "general-k128": (2, 128, 4, 128, "dn_delta"),
}


def test_the_instances_are_the_launchers():
    """deltanet.cu's dn_delta_k<dk> instances are the k_dims support.DN_DELTA_K names, and the
    launcher runs them at those k_dims (the shapes above run each)."""
    src = (KERNELS / "deltanet.cu").read_text()
    listed = src.split("#define DN_DELTA_K_LIST(X)", 1)[1].split("\n", 1)[0]
    assert tuple(int(x) for x in listed.replace("X(", " ").replace(")", " ").split()) == DN_DELTA_K
    picked = {dn_delta_kernel(dk) for _, dk, *_ in SHAPES.values()}
    assert picked == {"dn_delta"} | {f"dn_delta_k{d}" for d in DN_DELTA_K}


@pytest.mark.parametrize("step", STEPS, ids=list(STEPS))
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_delta(emu, tmp_path, step, shape):
    nk, dk, nv, dv, entry = SHAPES[shape]
    got, ref, ref_st, st, w = run_delta(emu, tmp_path, step, nk, dk, nv, dv, entry=entry)
    assert np.max(np.abs(got["out"][:, :w] - ref)) < TOL * max(1.0, np.abs(ref).max())
    assert np.all(np.isnan(got["out"][:, w:])), "values past the rows were written"
    assert np.max(np.abs(got["state"] - ref_st)) < TOL * max(1.0, np.abs(ref_st).max())
    for s in untouched(STEPS[step]):
        assert np.array_equal(got["state"][s], st[s])


# steps with segments long enough for the chunked rule at chunk_min = 2 DN_CHUNK (the twin's chunks
# and rows as deltanet.cu's): whole chunks and a tail, whole chunks only, a first segment; chunked
# segments starting off dn_chunk's row blocks (rows 1 and 129) beside a decode row, one a row short
# of the rule, and long padding on the scratch slot (never chunked)
LONG = 2 * DN_CHUNK
CHUNKED = {
    "chunks-and-tail": [(2, 5, LONG + DN_CHUNK + 7)],
    "whole-chunks": [(1, 0, LONG)],
    "mixed": [(4, 3, 1), (0, 0, LONG + 1), (2, 11, LONG - 1), (3, 2, LONG + 3), (SCRATCH, 0, LONG)],
}
# (nk, dk, nv, dv): the chunked kernel's instances at the real heads' sizes and narrower value heads
CHUNK_SHAPES = {"k64": (2, 64, 4, 64), "k64-narrow-v": (1, 64, 3, 40), "qwen36-heads": (4, 128, 16, 128),
                "qwen35-tiny": (2, 32, 4, 32)}
# every step at the small shapes; the real heads (slow to emulate) at chunks with a tail
CHUNK_CASES = [(sh, st) for sh in ("k64", "k64-narrow-v", "qwen35-tiny") for st in CHUNKED] \
    + [("qwen36-heads", "chunks-and-tail")]


@pytest.mark.parametrize("shape,step", CHUNK_CASES, ids=[f"{sh}-{st}" for sh, st in CHUNK_CASES])
def test_chunked_delta(emu, tmp_path, step, shape):
    """dn_chunk_k<dk> then dn_delta_k<dk> under chunk_min = LONG against the twin under the same rule
    (itself the rule token by token: test_deltanet_chunk_twin.py): outputs, states, untouched slots."""
    nk, dk, nv, dv = CHUNK_SHAPES[shape]
    got, ref, ref_st, st, w = run_delta(emu, tmp_path, step, nk, dk, nv, dv, chunk_min=LONG, steps=CHUNKED)
    assert np.max(np.abs(got["out"][:, :w] - ref)) < TOL * max(1.0, np.abs(ref).max())
    assert np.all(np.isnan(got["out"][:, w:])), "values past the rows were written"
    assert np.max(np.abs(got["state"] - ref_st)) < TOL * max(1.0, np.abs(ref_st).max())
    for s in untouched(CHUNKED[step]):
        assert np.array_equal(got["state"][s], st[s])


def test_chunk_kernels_are_the_instances():
    """A chunked kernel for each dn_delta_k<dk> instance; none for the general k_dims or value heads
    past DN_CHUNK_MAX_V (those run dn_delta token by token)."""
    src = (KERNELS / "deltanet.cu").read_text()
    assert "DN_DELTA_K_LIST(DN_CHUNK_K_INSTANCE)" in src
    assert [dn_chunk_kernel(dk, 128) for dk in DN_DELTA_K] == [f"dn_chunk_k{dk}" for dk in DN_DELTA_K]
    assert dn_chunk_kernel(96, 128) is None and dn_chunk_kernel(128, 256) is None


# plausible slips of the chunked form: the u without the intra-chunk triangular solve; the state
# carried to the next chunk without the chunk's decay
CHUNK_SLIPS = {"no-solve": [("for (int m = 0; m < r; ++m) u -=", "for (int m = 0; m < 0; ++m) u -=")],
               "undecayed-state": [("for (int i = 0; i < KH; ++i) s[i] *= eg;", "")]}


@pytest.fixture(scope="module", params=list(CHUNK_SLIPS))
def chunk_slip_emu(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(f"deltanet_{request.param}")
    slip = (KERNELS / "deltanet.cu").read_text()
    for old, new in CHUNK_SLIPS[request.param]:
        assert slip.count(old) == 1, old
        slip = slip.replace(old, new)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "deltanet.cu").write_text(slip)
    return build(tmp_path / "broken_emu", tmp_path / "broken")


def test_a_chunked_kernel_with_a_slip_fails(chunk_slip_emu, tmp_path):
    nk, dk, nv, dv = CHUNK_SHAPES["k64"]
    got, ref, *_, w = run_delta(chunk_slip_emu, tmp_path, "chunks-and-tail", nk, dk, nv, dv, chunk_min=LONG,
                                steps=CHUNKED)
    assert np.max(np.abs(got["out"][:, :w] - ref)) > 100 * TOL


@pytest.fixture(scope="module")
def broken_emu(tmp_path_factory):
    """The emulator over a copy of the kernels with the delta term read against the undecayed state
    (S^T k instead of (g S)^T k): a plausible slip the tests must catch."""
    tmp_path = tmp_path_factory.mktemp("deltanet_broken")
    src = (KERNELS / "deltanet.cu").read_text()
    slip = src.replace("- g * kv * rk)", "- kv * rk)")
    assert slip != src
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    (broken_dir / "deltanet.cu").write_text(slip)
    return build(tmp_path / "broken_emu", broken_dir)


@pytest.mark.parametrize("shape", ["qwen35-tiny", "qwen36-heads"])
def test_a_kernel_without_the_decay_in_the_delta_fails(broken_emu, tmp_path, shape):
    nk, dk, nv, dv, entry = SHAPES[shape]
    got, ref, *_ , w = run_delta(broken_emu, tmp_path, "prompt", nk, dk, nv, dv, entry=entry)
    assert np.max(np.abs(got["out"][:, :w] - ref)) > 100 * TOL


def test_the_twin_is_the_numpy_backends_delta_rule():
    """The twin (conv, then delta) gives the NumPy backend's DeltaNet core (backends/cpu.py
    CpuOps.delta_rule, the oracle transformers checks) on a continued segment and a first one."""
    from types import SimpleNamespace
    from realizar_backend.backends.cpu import CpuOps
    rng = np.random.default_rng(7)
    nk, dk, nv, dv, K = 2, 16, 4, 8, 4
    C = 2 * nk * dk + nv * dv
    conv_state = rng.standard_normal((3, K - 1, C)).astype(np.float32)
    states = (rng.standard_normal((3, nv, dk, dv)) * 0.3).astype(np.float32)
    conv0, states0 = conv_state.copy(), states.copy()
    segs = [(0, 5, 3), (2, 0, 4)]                     # (slot, start, tokens)
    backend = SimpleNamespace(config=SimpleNamespace(rms_eps=1e-6), recurrent_state=lambda *_: (conv_state, states))
    bounds = np.cumsum([0] + [n for *_, n in segs])
    ops = CpuOps(backend, None, None, bounds, None, None, None, [s for s, _, _ in segs], [p for _, p, _ in segs])
    net = SimpleNamespace(k_heads=nk, k_dim=dk, v_heads=nv, v_dim=dv, layer=0,
                          conv=(rng.standard_normal((C, K)) / 2).astype(np.float32),
                          a_coef=(-np.exp(rng.uniform(-2, 1, nv))).astype(np.float32),
                          dt_bias=rng.uniform(-1, 1, nv).astype(np.float32),
                          out_norm=rng.uniform(0.5, 1.5, dv).astype(np.float32))
    T = int(bounds[-1])
    mixed, z = rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((T, nv * dv)).astype(np.float32)
    beta, alpha = rng.standard_normal((2, T, nv)).astype(np.float32)
    out = ops.delta_rule(mixed, z, beta, alpha, net)
    slots = np.concatenate([np.full(n, s) for s, _, n in segs])
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in segs])
    cv, conv_ref = twin.conv(mixed, net.conv, conv0, slots, pos, SCRATCH)
    ref, states_ref = twin.delta(cv, alpha, beta, z, net.a_coef, net.dt_bias, net.out_norm, states0, slots, pos,
                                 SCRATCH, nk, dk, nv, dv, 1e-6)
    assert np.max(np.abs(out - ref)) < 1e-5
    assert np.max(np.abs(states - states_ref)) < 1e-5 and np.max(np.abs(conv_state - conv_ref)) < 1e-6
