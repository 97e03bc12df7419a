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
    "max_request_bytes": ["10", "big"], "max_stop_chars": ["0"], "responses_store_size": ["-1", "lots"], "request_timeout_s": ["0", "-1", "nan", "100000"], "chat_template_timeout_s": ["0", "-1", "inf"],
    "max_request_tokens": ["-1", "lots"], "grammar_timeout_s": ["0", "-2", "nan"], "grammar_workers": ["0", "65"],
    "chat_template_max_chars": ["5"], "chat_template_memory_mb": ["16"], "chat_template_workers": ["0", "1000"],
    "shutdown_grace_s": ["-1", "nan"], "cuda_graphs": ["perhaps"], "step_trace": [" x", "/no/such/dir/steps.jsonl"],
    "prefill_weight_cache": ["always"], "gemm_precision": ["fp32", "FP16"], "self_check": ["si"], "log_level": ["LOUD"], "model_cache": ["", " ~/models"],
    "prebuilt_kernels": ["sometimes"], "workers": ["-1", "257", "all"], "front_ends": ["-1", "65", "two"],
    "engine_stall_timeout_s": ["0", "-1", "inf"], "read_timeout_s": ["0", "nan"],
    "max_header_bytes": ["100", "huge"], "max_connections": ["-1"], "cpu_threads": ["-2", "many"],
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


@pytest.mark.parametrize("typo, meant", [("REALIZAR_MAX_NUM_SEQ", "REALIZAR_MAX_NUM_SEQS"),
                                         ("REALIZAR_CONTEXTLENGTH", "REALIZAR_CONTEXT_LENGTH"),
                                         ("REALIZAR_BACKEN", "REALIZAR_BACKEND")])
def test_a_misspelt_variable_stops_the_start_with_the_nearest_name(typo, meant):
    with pytest.raises(SettingsError) as e:
        Settings.from_env({typo: "4", "REALIZAR_BACKEND": "cpu"})
    assert str(e.value) == f"{typo}: no such setting; did you mean {meant}?"


def test_an_unknown_variable_with_no_near_name_is_refused_too():
    with pytest.raises(SettingsError, match="REALIZAR_ZZZ: no such setting"):
        Settings.from_env({"REALIZAR_ZZZ": "1"})


def test_the_test_suite_and_tools_variables_are_not_settings_and_pass():
    env = {"REALIZAR_TEST_SEED": "7", "REALIZAR_TEST_MODEL_CACHE": "/tmp", "REALIZAR_TWINS": "/tmp/twins",
           "REALIZAR_REAL_SMOL": "/tmp/smol.gguf", "REALIZAR_BACKEND": "cpu"}
    assert Settings.from_env(env).backend == "cpu"


def test_every_realizar_variable_the_repository_uses_is_known():
    """Whatever the package, the tests, the tool scripts and the user docs name is a setting or
    allowed, so that nothing of ours trips the typo check (kernel macros in .cu files are not
    environment; docs/perf-notes.md is history and names settings since removed)."""
    import re
    from pathlib import Path
    from realizar_backend.settings import NOT_SETTINGS, NOT_SETTINGS_PREFIXES
    root = Path(__file__).resolve().parents[2]
    known = {Settings.env_name(f.name) for f in fields(Settings)} | NOT_SETTINGS
    used = set()
    for path in [*root.glob("realizar_backend/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("tools/**/*.sh"),
                 root / "docs" / "serving.md", root / "README.md", root / "bentofile.yaml"]:
        if path.is_file():
            used |= set(re.findall(r"REALIZAR_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    # names a comment or doc gives as placeholders, and this test's own examples
    used -= {"REALIZAR_X", "REALIZAR_Y", "REALIZAR_KIT_VERSION", "REALIZAR_ZZZ", "REALIZAR_MAX_NUM_SEQ",
             "REALIZAR_CONTEXTLENGTH", "REALIZAR_BACKEN", "REALIZAR_CC", "REALIZAR_QMASK", "REALIZAR_HOST_TEST",
             "REALIZAR_TEST_FALLBACK"}
    unknown = {u for u in used - known if not (u + "_").startswith(NOT_SETTINGS_PREFIXES)}
    assert not unknown, unknown
