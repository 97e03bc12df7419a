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
