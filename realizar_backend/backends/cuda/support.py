"""What the GPU backend runs, decided before anything touches the GPU (no CuPy): `realizar inspect`
reports it, and CUDABackend refuses at load, by name, a model it cannot run instead of failing at its
first step or running a tensor a slow way."""

from __future__ import annotations

from ...formats import ModelFile
from .matrices import QTYPES

# tensors the GPU's kernels have no operation for yet (the NumPy backend runs them)
UNSUPPORTED_TENSORS = ("attn_sinks.weight", "attn_output.bias")


def gpu_types(mf: ModelFile) -> dict[str, bool]:
    """Each storage type of the file's matrices: whether the GPU backend has kernels for it."""
    return {t.type_name: t.qtype in QTYPES for t in mf.tensors.values() if len(t.shape) >= 2}


def refusal(mf: ModelFile) -> str | None:
    """Why the GPU backend cannot run this model (None: it can)."""
    c = mf.config
    if c.n_experts:
        return f"{c.arch}: the GPU backend does not run mixture-of-experts models yet"
    if c.has_recurrent_state:
        return f"{c.arch}: the GPU backend does not run linear-attention hybrids yet"
    for name, t in mf.tensors.items():
        if name.startswith("blk.") and name.split(".", 2)[2] in UNSUPPORTED_TENSORS:
            return f"tensor {name}: the GPU backend has no kernel for it yet"
        if len(t.shape) >= 2 and t.qtype not in QTYPES:
            return f"tensor {name}: type {t.type_name} has no GPU kernel yet"
    return None
