"""Which backend a start takes and why, said in one line; the CPU backend's memory checked before
it loads, and its BLAS threads set."""

from __future__ import annotations

import logging

import pytest

from realizar_backend.backends import check_cpu_memory, choose_backend, cpu_memory_bytes, create_backend, host
from realizar_backend.errors import BackendError
from realizar_backend.settings import Settings


def _no_cupy() -> bool:
    try:
        import cupy  # noqa: F401
        return False
    except ImportError:
        return True


def test_the_cpu_backend_asked_for_says_so(smol_model, caplog):
    with caplog.at_level(logging.INFO, logger="realizar_backend.backends"):
        backend = create_backend(smol_model, Settings(backend="cpu", max_num_seqs=1, context_length=64))
    backend.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend: ")]
    assert len(lines) == 1 and lines[0].startswith("backend: cpu (REALIZAR_BACKEND=cpu)"), lines


@pytest.mark.skipif(not _no_cupy(), reason="CuPy is installed here")
def test_auto_without_cupy_says_why_and_cuda_names_the_real_cause():
    name, why = choose_backend(Settings(backend="auto"))
    assert name == "cpu"
    if host.nvidia_driver() is None:
        assert why == "no NVIDIA GPU driver on this machine"
    else:
        assert "CuPy is not installed" in why and "pip install 'cupy-cuda1" in why
    with pytest.raises(BackendError) as e:
        choose_backend(Settings(backend="cuda"))
    assert str(e.value) == f"REALIZAR_BACKEND=cuda, but {why}"
    assert "no CUDA GPU is visible to CuPy" not in str(e.value)


def test_a_model_that_cannot_fit_in_memory_is_refused_with_the_figures(smol_model):
    avail = host.available_memory()
    assert avail is not None and avail > 0            # Linux: /proc/meminfo
    per_token = cpu_memory_bytes(smol_model, 1)[1]
    too_many = 2 * avail // per_token // 16 * 16       # whole KV blocks
    with pytest.raises(BackendError) as e:
        create_backend(smol_model, Settings(backend="cpu", kv_cache_tokens=too_many, max_num_seqs=1))
    msg = str(e.value)
    assert "the CPU backend needs" in msg and "GiB is available" in msg and f"for {too_many} tokens" in msg
    weights, _ = cpu_memory_bytes(smol_model, 0)
    assert 400e6 < weights < 700e6                     # SmolLM2-135M: ~135M float32 weights (+ tied embedding)
    check_cpu_memory(smol_model, 1024)                 # a small pool fits


def test_cpu_threads_set_the_blas_pool(smol_model):
    from threadpoolctl import threadpool_info

    backend = create_backend(smol_model, Settings(backend="cpu", cpu_threads=1, max_num_seqs=1, context_length=64))
    backend.close()
    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    assert blas and all(p["num_threads"] == 1 for p in blas)


def test_the_cupy_install_hint_matches_the_package_extras():
    import tomllib
    from pathlib import Path
    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for extra, wheel in host.CUPY_EXTRAS.values():
        assert extras[extra] == [wheel]


def test_a_hybrids_gpu_slots_leave_the_kv_pool_room_for_64_long_conversations(tmp_path):
    """Qwen3.6-27B (its real header): each sequence keeps ~157 MB of recurrent state, allocated per
    slot before the KV pool. On an 80 GB GPU the default max_num_seqs (256) would take 40 GB of it;
    the GPU backend takes as many slots as half the memory left after the weights holds, so 64
    conversations of 4,000 tokens still fit in the KV pool beside them."""
    from support import gguf_kv
    from realizar_backend.backends.cuda.support import RECURRENT_STATE_SHARE, recurrent_slots
    from realizar_backend.formats import open_model
    path = gguf_kv.header_twin("qwen36", tmp_path)
    if path is None:
        pytest.skip("shared/models/qwen36.head.gz is not here")
    c = open_model(path).config
    per = c.recurrent_state_bytes
    assert 100e6 < per < 200e6
    budget = int(0.9 * 80e9) - path.stat().st_size                  # gpu_memory_utilization 0.9, the weights
    n = recurrent_slots(per, Settings().max_num_seqs, budget)
    assert 64 <= n < Settings().max_num_seqs
    assert n * per <= RECURRENT_STATE_SHARE * budget < (n + 1) * per
    assert budget - n * per >= 64 * 4000 * c.kv_bytes_per_token(2)  # fp16 K/V of the attention layers
    assert recurrent_slots(per, 8, budget) == 8                      # fewer asked for: all of them
    assert recurrent_slots(per, 256, per) == 0                       # not one: the backend refuses
    assert recurrent_slots(0, 256, 1) == 256                         # no recurrent state: max_num_seqs
