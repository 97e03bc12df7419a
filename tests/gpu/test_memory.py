"""No per-token allocation: device memory stays flat across many sequential short completions."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from support.paging import contiguous_table, contiguous_tables
from support.steps import greedy_step

pytestmark = pytest.mark.gpu

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))
N_COMPLETIONS = int(os.environ.get("REALIZAR_TEST_COMPLETIONS", "1000"))


def test_memory_flat_over_sequential_completions(rng):
    path = TWINS / "smol135.gguf"
    if not path.exists():
        pytest.skip("smol135 twin not expanded")
    import cupy

    from realizar_backend.backends.base import PrefillItem
    from realizar_backend.backends.cuda import CUDABackend
    from realizar_backend.formats import open_model
    from realizar_backend.settings import Settings
    model = open_model(path)
    gpu = contiguous_tables(CUDABackend(model, max_slots=4, max_context=256, settings=Settings(self_check=False)))
    pool = cupy.get_default_memory_pool()
    V = model.config.vocab_size

    def completion(i: int) -> None:
        slot = i % 4
        n = 1 + i % 16                      # every prompt path: GEMV graphs (< 4 tokens), tensor-core
        prompt = rng.integers(0, V, n if i % 5 else 80).astype(np.int32)   # graphs (<= 64), cuBLAS (80)
        tok = int(np.argmax(gpu.prefill([PrefillItem(slot, prompt)])[0]))
        for s in range(8):
            tok = int(greedy_step(gpu, [slot], [tok], [len(prompt) + s])[0])
        gpu.release(slot)
        contiguous_table(gpu, slot)

    def measure() -> tuple[int, int]:
        cupy.cuda.Device().synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        return pool.used_bytes(), total - free

    for i in range(20):                     # warm-up: graphs captured, cuBLAS handle made
        completion(i)
    used0, dev0 = measure()
    for i in range(N_COMPLETIONS):
        completion(i)
    used1, dev1 = measure()
    st = gpu.stats()
    print(f"{N_COMPLETIONS} completions: pool used {used0} -> {used1} bytes, "
          f"device used {dev0} -> {dev1} bytes; stats {st}")
    assert abs(used1 - used0) <= 0.01 * used0
    assert abs(dev1 - dev0) <= 0.01 * dev0
    assert st["graph_status"].get("1") in ("captured", "eager-fallback")
    gpu.close()
