"""One engine per GPU, on this machine's GPUs: `bentoml serve` with REALIZAR_WORKERS=n starts n
engine processes behind its front ends (one per GPU), each holds memory on its own GPU and no other (NVML),
all of them serve, and /metrics names each engine's GPU. n = 1 runs on any GPU machine (the same
code path); n = 2 needs two GPUs and is skipped with fewer."""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import httpx
import pytest

from support.server import start_server, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.server, pytest.mark.slow]

TWINS = Path(os.environ.get("REALIZAR_TWINS", "/tmp/twins"))


def _gpu_pids() -> dict[int, set[int]]:
    """{NVML GPU index: pids with memory on it}."""
    import pynvml
    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[i] = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        return out
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("n", [1, 2])
def test_one_engine_per_gpu(n):
    from realizar_backend.settings import visible_gpus
    gpus = visible_gpus(len(_gpu_pids()))        # BentoML's own choice, or CUDA_VISIBLE_DEVICES as set
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs")
    model = TWINS / "smol135.gguf"
    if not model.exists():
        pytest.skip("smol135 twin not expanded")
    # a small KV pool: this pytest process may hold memory on GPU 0 from the tests before
    server = start_server({"REALIZAR_BACKEND": "cuda", "REALIZAR_MODEL": str(model), "REALIZAR_WORKERS": str(n),
                           "REALIZAR_MODEL_NAME": "smol135", "REALIZAR_KV_CACHE_TOKENS": "16384"}, timeout=400)
    try:
        want = {str(e): (gpus[e - 1], "ready") for e in range(1, n + 1)}
        assert wait_for(lambda: server.engine_statuses() == want, 300), server.log_tail()

        def complete(i: int) -> int:
            r = httpx.post(server.url + "/v1/completions", headers={**server.auth},
                           json={"model": "smol135", "prompt": [1000 + i, 2000, 3000], "max_tokens": 16,
                                 "ignore_eos": True, "temperature": 0}, timeout=120)
            return r.status_code

        with cf.ThreadPoolExecutor(8) as pool:
            assert set(pool.map(complete, range(8 * n))) == {200}
        finished = sum(v for (name, k), v in server.metrics().items() if name == "realizar_requests_total")
        assert finished == 8 * n

        # engine i's process holds memory on its GPU and on no other (NVML numbers GPUs as
        # CUDA_VISIBLE_DEVICES does when that names them by index), and the front end on none
        pids, engines = _gpu_pids(), server.engines()
        assert len(engines) == n
        if not any(p.pid in ps for ps in pids.values() for p in engines) or not all(g.isdigit() for g in gpus):
            print(f"NVML process ids {pids}, GPUs {gpus}: GPU placement not checked")
            return
        for e, proc in enumerate(engines, 1):
            on = {gpu for gpu, ps in pids.items() if proc.pid in ps}
            assert on == {int(gpus[e - 1])}, f"engine {e} (pid {proc.pid}) holds memory on GPUs {sorted(on)}"
        fronts = server.workers()
        assert len(fronts) == n
        assert not any(w.pid in ps for w in fronts for ps in pids.values()), "a front end holds GPU memory"
    finally:
        server.stop()
