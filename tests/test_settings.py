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
                                 {"REALIZAR_KV_CACHE_TOKENS": "100"}, {"REALIZAR_PREFILL_WEIGHT_CACHE": "always"}])
def test_bad_values_are_refused_with_their_name(env):
    with pytest.raises(ValueError) as e:
        Settings.from_env(env)
    field = next(iter(env))[len("REALIZAR_"):].lower()
    assert field in str(e.value).lower()


def test_kv_budget_caps_concurrent_sequences():
    base = {"REALIZAR_CONTEXT_LENGTH": "1024", "REALIZAR_MAX_NUM_SEQS": "16"}
    assert Settings.from_env(base).kv_slots == 16
    assert Settings.from_env({**base, "REALIZAR_KV_CACHE_TOKENS": "4096"}).kv_slots == 4
    assert Settings.from_env({**base, "REALIZAR_KV_CACHE_TOKENS": "1000000"}).kv_slots == 16
