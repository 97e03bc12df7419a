"""Settings: the one place the environment is read."""

import pytest

from realizar_backend.settings import Settings


def test_environment_fills_fields_by_type():
    s = Settings.from_env({"REALIZAR_BACKEND": "cpu", "REALIZAR_CONTEXT_LENGTH": "512",
                           "REALIZAR_CUDA_GRAPHS": "off", "REALIZAR_API_KEY": "k", "UNRELATED": "x"})
    assert (s.backend, s.context_length, s.cuda_graphs, s.api_key) == ("cpu", 512, False, "k")


def test_explicit_values_win_over_the_environment():
    assert Settings.from_env({"REALIZAR_BACKEND": "cuda"}, backend="cpu").backend == "cpu"


@pytest.mark.parametrize("env", [{"REALIZAR_BACKEND": "tpu"}, {"REALIZAR_CONTEXT_LENGTH": "many"},
                                 {"REALIZAR_CUDA_GRAPHS": "perhaps"}, {"REALIZAR_MAX_NUM_SEQS": "0"},
                                 {"REALIZAR_DECODE_ACTIVATIONS": "int4"}, {"REALIZAR_PREFILL_PRECISION": "fp8"},
                                 {"REALIZAR_KV_CACHE_TOKENS": "8"}, {"REALIZAR_PREFILL_WEIGHT_CACHE": "always"}])
def test_bad_values_are_refused_with_their_name(env):
    with pytest.raises(ValueError) as e:
        Settings.from_env(env)
    field = next(iter(env))[len("REALIZAR_"):].lower()
    assert field in str(e.value).lower()


def test_kv_cache_settings():
    s = Settings.from_env({"REALIZAR_BLOCK_SIZE": "32", "REALIZAR_KV_CACHE_TOKENS": "4096",
                           "REALIZAR_PREFILL_CHUNK_TOKENS": "256", "REALIZAR_ENABLE_PREFIX_CACHING": "off",
                           "REALIZAR_GPU_MEMORY_UTILIZATION": "0.5"})
    assert (s.block_size, s.kv_cache_tokens, s.prefill_chunk_tokens, s.enable_prefix_caching,
            s.gpu_memory_utilization) == (32, 4096, 256, False, 0.5)
    assert Settings().context_length == 0          # the model's own
    for env in ({"REALIZAR_BLOCK_SIZE": "24"}, {"REALIZAR_BLOCK_SIZE": "0"},
                {"REALIZAR_PREFILL_CHUNK_TOKENS": "0"}, {"REALIZAR_GPU_MEMORY_UTILIZATION": "1.5"},
                {"REALIZAR_KV_CACHE_TOKENS": "8", "REALIZAR_BLOCK_SIZE": "16"}):
        with pytest.raises(ValueError):
            Settings.from_env(env)
