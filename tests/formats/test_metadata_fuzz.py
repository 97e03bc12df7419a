"""The metadata fuzzer in CI: a fixed seed and a few hundred mutants of the real SmolLM2 header
(tools/fuzz_metadata.py runs as many as you like). Every mutant either loads or fails with a
typed error; none hangs, crashes or raises anything else."""

from __future__ import annotations

import pytest

from support.metadata_fuzz import ACCEPTABLE, fuzz, summary
from support.real_models import smollm2_path

pytestmark = pytest.mark.slow

SEED = 20
MUTANTS = 300


def test_metadata_mutants_load_or_fail_typed(tmp_path):
    results = list(fuzz(smollm2_path(), SEED, MUTANTS, tmp_path, timeout_s=60))
    report = summary(results, 0)
    print(report)
    assert len(results) == MUTANTS
    assert all(r.outcome in ACCEPTABLE for r in results), report
    # the mutants reach the semantic checks, not only the parser, and some still load
    outcomes = {r.outcome for r in results}
    assert outcomes == {"ok", "typed"}, report
    assert sum("tokenizer.ggml." in r.detail for r in results) >= 20, report
