"""Settings: the one place the environment is read, and every value checked at start."""

from dataclasses import fields

import pytest

from realizar_backend.errors import SettingsError
from realizar_backend.settings import Settings


def test_environment_fills_fields_by_type():
    s = Settings.from_env({"REALIZAR_BACKEND": "cpu", "REALIZAR_CONTEXT_LENGTH": "512",
                           "REALIZAR_CUDA_GRAPHS": "off", "REALIZAR_API_KEY": "k", "UNRELATED": "x",
                           "REALIZAR_SHUTDOWN_GRACE_S": "2.5"})
    assert (s.backend, s.context_length, s.cuda_graphs, s.api_key, s.shutdown_grace_s) == ("cpu", 512, False, "k", 2.5)


def test_explicit_values_win_over_the_environment():
    assert Settings.from_env({"REALIZAR_BACKEND": "cuda"}, backend="cpu").backend == "cpu"


# at least one bad value for every field
BAD = {
    "model": ["  "], "model_name": [" x"], "backend": ["tpu"], "device": ["-1", "gpu0"],
    "context_length": ["-1", "many", str(1 << 30)], "max_num_seqs": ["0", "-3"],
    "kv_cache_tokens": ["-1", "8"], "block_size": ["0", "24", "2048"],
    "gpu_memory_utilization": ["0", "1.5", "nan"], "prefill_chunk_tokens": ["0"],
    "enable_prefix_caching": ["maybe"], "max_waiting": ["0", "-5"], "api_key": [" secret "],
    "max_request_bytes": ["10", "big"], "max_stop_chars": ["0"], "chat_template_timeout_s": ["0", "-1", "inf"],
    "max_request_tokens": ["-1", "lots"], "grammar_timeout_s": ["0", "-2", "nan"], "grammar_workers": ["0", "65"],
    "chat_template_max_chars": ["5"], "chat_template_memory_mb": ["16"], "chat_template_workers": ["0", "1000"],
    "shutdown_grace_s": ["-1", "nan"], "cuda_graphs": ["perhaps"], "programmatic_launch": ["2"], "pipelined_decode": ["sure"], "step_trace": [" x", "/no/such/dir/steps.jsonl"], "guidance_mask_parts": ["-1", "65", "two"],
    "decode_activations": ["int4", "fp32-gemv"], "prefill_precision": ["fp8"], "prefill_weight_cache": ["always"],
    "self_check": ["si"], "log_level": ["LOUD"], "model_cache": ["", " ~/models"], "attention": ["sdpa"],
    "batched_decode": ["cublas"], "prompt_mmq_tokens": ["-8", "12", "264"],
    "prebuilt_kernels": ["sometimes"], "workers": ["-1", "257", "all"], "engine_process": ["maybe"],
}
CASES = [(name, value) for name, values in BAD.items() for value in values]


def test_every_field_has_a_bad_case():
    assert set(BAD) == {f.name for f in fields(Settings)}


@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_bad_values_are_refused_with_their_variable(name, value):
    var = "REALIZAR_" + name.upper()
    with pytest.raises(SettingsError) as e:
        Settings.from_env({var: value})
    assert str(e.value).startswith(var + "="), e.value
    assert isinstance(e.value, ValueError)          # the CLI reports it as a usage error


def test_the_api_key_is_not_repeated_in_the_error():
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"REALIZAR_API_KEY": " hunter2"})
    assert "hunter2" not in str(e.value)


def test_settings_made_in_code_are_checked_too():
    with pytest.raises(SettingsError, match="REALIZAR_MAX_WAITING=0"):
        Settings(max_waiting=0)
    with pytest.raises(SettingsError, match="REALIZAR_MAX_NUM_SEQS='8': expected int"):
        Settings(max_num_seqs="8")
    with pytest.raises(SettingsError, match="REALIZAR_CUDA_GRAPHS=1: expected bool"):
        Settings(cuda_graphs=1)
    assert Settings().replace(max_waiting=3).max_waiting == 3


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
        with pytest.raises(SettingsError):
            Settings.from_env(env)
