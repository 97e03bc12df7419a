"""Launch plans of the fp32-activation GEMVs (backends/cuda/ops.py): which launches stream their
weights through mmvf.cu's shared-memory ring. Host arithmetic only, but ops.py needs CuPy: with
the GPU tests."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ring", ["block32", "all", "off"])
def test_ring_plan(monkeypatch, ring):
    """Which launches take the ring: one-warp-per-group launches of 32-weight block types under
    "block32" (qwen05's Q5_0 gate+up, not qwen15's Q4_K one), every one-warp-per-group launch that
    fits under "all", never rows whose slots pass the shared-memory limit or two warps per group
    (qwen15 down), nothing when off."""
    from realizar_backend.backends.cuda import ops
    monkeypatch.setattr(ops, "MMVF_RING", ring)

    def plan(K, rows, rb, M, qts):
        x = ops.mmvf_stride(K) * 4
        wpr, slot, smem = ops._gemv_plan(K, rows, rb, M, qts, True, x, 132)
        assert (slot > 0) == (smem > x) and (slot == 0 or wpr == 1)
        return slot > 0
    assert plan(896, 4864, 616, 2, [Q.Q5_0]) == (ring != "off")                  # qwen05 gate+up
    assert plan(896, 1152, 952, 1, [Q.Q5_0, Q.Q5_0, Q.Q8_0]) == (ring != "off")  # qwen05 QKV (mixed)
    assert plan(1536, 8960, 864, 2, [Q.Q4_K]) == (ring == "all")                 # qwen15 gate+up
    assert plan(1536, 151936, 1260, 1, [Q.Q6_K]) == (ring == "all")              # qwen15 head
    assert not plan(8960, 1536, 7350, 1, [Q.Q6_K])                              # qwen15 down
    assert not plan(2048, 8960, 2176, 2, [Q.Q8_0])                               # slots past the limit
