"""The `realizar` command line: help for every option with its default, the model given the same
way to every command, -v on either side of the command, --version; and the served model id of a
model given by path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from realizar_backend.cli import build_parser, main, parse_args
from realizar_backend.engine.engine import served_name

MODEL_COMMANDS = ["inspect", "check", "bench", "serve"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_command_has_help_and_shows_its_default():
    for name, p in _commands().items():
        text = p.format_help()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
            if action.option_strings and action.default not in (None, argparse.SUPPRESS) \
                    and action.default is not False:
                assert "default" in p._get_formatter()._get_help_string(action), (name, action.dest)
        assert "(default: None)" not in text, name


def test_bench_depth_help_states_its_default():
    helptext = _commands()["bench"].format_help()
    assert "a few" not in helptext and "(default: 0)" in " ".join(helptext.split())


@pytest.mark.parametrize("command", MODEL_COMMANDS + ["generate"])
def test_the_model_is_positional_or_an_option_for_every_command(command):
    lead = ["hello"] if command == "generate" else []
    a = parse_args([command, *lead, "m.gguf"])
    b = parse_args([command, *lead, "--model", "m.gguf"])
    assert a.model == b.model == "m.gguf"
    assert parse_args([command, *lead]).model is None


def test_two_different_models_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["inspect", "a.gguf", "--model", "b.gguf"])
    assert e.value.code == 2 and "two models given" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-v", "pull"], ["pull", "-v"], ["pull", "--verbose"]])
def test_verbose_before_or_after_the_command(argv):
    assert parse_args(argv).verbose is True
    assert parse_args(["pull"]).verbose is False


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("realizar ")


def test_serve_listens_on_localhost_unless_asked():
    assert parse_args(["serve"]).host == "127.0.0.1"
    assert parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"


@pytest.mark.slow
def test_inspect_takes_the_model_either_way(smol_path, capsys):
    assert main(["inspect", str(smol_path), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["inspect", "--model", str(smol_path), "--json", "-v"]) == 0
    assert json.loads(capsys.readouterr().out) == a and a["architecture"] == "llama"


def test_a_model_given_by_path_is_served_under_its_file_name():
    assert served_name(Path("/models/qwen2.5-1.5b-instruct-q4_k_m.gguf")) == "qwen2.5-1.5b-instruct-q4_k_m"
    assert served_name(Path("/models/Qwen2.5-0.5B-Instruct")) == "Qwen2.5-0.5B-Instruct"      # a directory
    assert served_name(Path("/models/M.GGUF")) == "M"


@pytest.mark.slow
def test_the_engine_reports_the_file_name_and_the_setting_overrides_it(smol_path):
    from realizar_backend.engine.engine import Engine
    from realizar_backend.settings import Settings

    settings = Settings(model=str(smol_path), backend="cpu", max_num_seqs=1, context_length=64)
    for s, want in ((settings, smol_path.name.removesuffix(".gguf")),
                    (settings.replace(model_name="my-model"), "my-model")):
        engine = Engine.from_settings(s, prewarm_guidance=False)
        try:
            assert engine.model_name == want and " " not in engine.model_name
        finally:
            engine.shutdown()


def test_inspect_says_which_backend_runs_each_type_and_what_the_gpu_refuses(tmp_path, capsys):
    """A file with a tensor of a type the GPU has no kernel for (IQ1_S, which the NumPy backend
    decodes): inspect says which backend runs each type, and why the GPU refuses the model."""
    from support import synth
    from gguf import GGMLQuantizationType as Q
    m = synth.write_gguf(tmp_path / "m.gguf", arch="llama", qtype=Q.Q4_K)
    assert main(["inspect", str(m.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] == "runs"
    bad = synth.corrupt(m.path, tmp_path / "iq1.gguf", "tensor_type_cpu_only")
    assert main(["inspect", str(bad), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends_by_type"]["IQ1_S"] == ["cpu"] and info["backends_by_type"]["Q4_K"] == ["cpu", "cuda"]
    assert info["gpu"] == "tensor blk.0.ffn_up.weight: type IQ1_S has no GPU kernel yet"


@pytest.mark.slow
@pytest.mark.parametrize("arch,overrides,gpu", [
    ("qwen3_moe", dict(head_dim=32), "runs"),
    ("gpt_oss", dict(head_dim=64), "runs"),
    ("qwen3_5_moe", {}, "runs"),
    ("qwen3_moe", {}, "head_dim 16: the GPU attention kernels need a multiple of 32 up to 256")],
    ids=["qwen3_moe", "gpt_oss", "qwen3_5_moe", "qwen3_moe-head16"])
def test_inspect_says_which_mixtures_of_experts_the_gpu_runs(capsys, arch, overrides, gpu):
    """The tiny random models of tests/support/hf_oracle.py (transformers' own, converted by llama.cpp),
    at head sizes the GPU's attention takes, and one it does not."""
    pytest.importorskip("transformers")
    from support.hf_oracle import available, tiny_gguf
    if not available(arch):
        pytest.skip(f"this transformers has no {arch}")
    assert main(["inspect", str(tiny_gguf(arch, **overrides)), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gpu"] == gpu and info["experts"].startswith("2 of ")


@pytest.mark.slow
def test_inspect_says_the_gpu_runs_the_linear_attention_hybrid(capsys):
    """The tiny qwen35 (tests/support/hf_oracle.py): three Gated DeltaNet layers, each with a state per
    sequence the GPU keeps."""
    pytest.importorskip("transformers")
    from support.hf_oracle import available, tiny_gguf
    if not available("qwen3_5"):
        pytest.skip("this transformers has no qwen3_5")
    assert main(["inspect", str(tiny_gguf("qwen3_5")), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gpu"] == "runs" and info["recurrent_layers"] == 3
    # per layer: the conv's last 3 inputs of 2 * 2 * 32 + 4 * 32 channels, 4 heads' 32 x 32 states
    assert info["state_bytes_per_sequence"] == 3 * 4 * (3 * 256 + 4 * 32 * 32)
