"""The CUDA weight upload's copy plan (weights._runs): the host bytes go up in a few long copies,
and every matrix must be found whole at its place in the copy that carries it. Runs on the CPU
(wherever CuPy imports): the copies are read here from host memory, as the device would."""

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from realizar_backend.formats import open_model
from support.synth import write_gguf

weights = pytest.importorskip("realizar_backend.backends.cuda.weights")


def _hosts(model):
    return [(t, i, np.ascontiguousarray(t.data).reshape(-1).view(np.uint8))
            for i, t in enumerate(t for t in model.tensors.values() if len(t.shape) == 2)]


def _check(runs, hosts):
    placed = set()
    for start, end, members in runs:
        copy = ctypes.string_at(start, end - start)      # what the run's one copy carries
        assert len(members) == 1 or end - start <= weights.RUN_BYTES
        for t, i, host in members:
            at = host.ctypes.data - start
            assert copy[at:at + host.size] == host.tobytes(), t.name
            placed.add(i)
    assert placed == {i for _, i, _ in hosts}


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.F16])
def test_runs_cover_every_matrix_in_few_copies(tmp_path, qtype):
    m = write_gguf(tmp_path / "m.gguf", arch="qwen2", qtype=qtype, seed=1)
    model = open_model(m.path)
    hosts = _hosts(model)
    runs = weights._runs(hosts)
    _check(runs, hosts)
    # one file, matrices a few norm vectors apart: a single copy carries them all
    assert len(runs) == 1 < len(hosts)


def test_runs_split_at_the_size_limit_and_never_bridge_separate_buffers(tmp_path, monkeypatch):
    m = write_gguf(tmp_path / "m.gguf", arch="llama", qtype=Q.Q8_0, seed=2)
    model = open_model(m.path)
    hosts = _hosts(model)
    biggest = max(h.size for _, _, h in hosts)
    monkeypatch.setattr(weights, "RUN_BYTES", 2 * biggest)
    runs = weights._runs(hosts)
    _check(runs, hosts)
    assert len(runs) > 1
    # matrices that are copies in memory of their own (not views of the file) are never joined
    # across the unrelated memory between them
    own = [(t, i, h.copy()) for t, i, h in hosts]
    runs = weights._runs(own)
    _check(runs, own)
    for _, _, members in runs:
        assert len(members) == 1 or all(
            b[2].ctypes.data == a[2].ctypes.data + a[2].size for a, b in zip(members, members[1:]))
