"""`realizar bench` on the CPU backend: the table and the JSON a user reads, with and without a
prompt to prefill (tg alone is what llama-bench's tg128 measures)."""

from __future__ import annotations

import json

import pytest

from realizar_backend.cli import main


@pytest.mark.parametrize("prompt", [0, 12])
def test_bench_cpu_table_and_json(smol_path, prompt, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(smol_path), "--backend", "cpu", "--prompt-tokens", str(prompt),
               "--gen-tokens", "3", "--repetitions", "2", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["backend"] == "cpu" and r["gen_tokens"] == 3 and r["repetitions"] == 2
    assert r["tg_tok_s"]["min"] > 0 and r["tg_tok_s"]["min"] <= r["tg_tok_s"]["median"] <= r["tg_tok_s"]["max"]
    assert r["ms_per_token"] == pytest.approx(1000.0 / r["tg_tok_s"]["median"])
    assert "| tg3 |" in table
    if prompt:
        assert r["pp_tok_s"]["median"] > 0 and f"| pp{prompt} |" in table
    else:
        assert r["pp_tok_s"] is None and "| pp" not in table


def test_bench_decodes_at_the_depth_asked(smol_path, tmp_path, capsys):
    """--depth N: the timed decode starts with N tokens in every sequence's context (llama-bench -d),
    prefilled in chunks; two sequences at once."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(smol_path), "--backend", "cpu", "--prompt-tokens", "0", "--gen-tokens", "2",
               "--repetitions", "1", "--depth", "70", "--batch", "2", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["depth"] == 70 and r["batch"] == 2 and r["tg_tok_s"]["median"] > 0
    assert "| tg2 @ d70 |" in capsys.readouterr().out


def test_bench_constrained_rows(smol_path, tmp_path, capsys):
    """--constrained half: the same batch decoded on the sampled path without and with a JSON
    schema (--schema) on every other row, held to it as in serving; the table and JSON say how
    it compares."""
    mode = "half"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                                  "additionalProperties": False}))
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(smol_path), "--backend", "cpu", "--prompt-tokens", "0", "--batch", "4",
               "--gen-tokens", "12", "--repetitions", "1", "--constrained", mode, "--schema", str(schema),
               "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["constrained"], r["constrained_rows"], r["schema"]) == (mode, 2, str(schema))
    for key in ("tg_tok_s", "tg_sampled_tok_s", "tg_constrained_tok_s"):
        assert r[key]["median"] > 0
    assert r["constrained_vs_plain"] == pytest.approx(r["tg_constrained_tok_s"]["median"] / r["tg_tok_s"]["median"])
    assert r["mask_ms_per_step"]["median"] > 0
    # {"a": true} is a few tokens: the rows finish it within 12 steps and start over
    assert r["grammar_restarts_per_run"] >= 1
    assert f"| tg12 json schema ({mode} rows) |" in table and "constrained / plain decode" in table
