"""The start-up timeline a cold start is read from (realizar_backend/timeline.py), and the start
work moved after the first token: `realizar generate` builds no llguidance vocabulary, and an
engine that was not prewarmed still serves a constrained request."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from realizar_backend.engine.engine import Engine
from realizar_backend.engine.guidance import Constraint
from realizar_backend.engine.sampling import SamplingParams
from realizar_backend.settings import Settings

LINE = re.compile(r"startup (\d+\.\d\d) s \((\d\d:\d\d:\d\d\.\d{3})\): (.*)")


def test_generate_logs_each_phase_of_its_start_in_order():
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "realizar_backend.cli", "-v", "generate", "The capital of France is",
                        "--max-tokens", "3", "--backend", "cpu"], capture_output=True, text=True, timeout=120)
    took = time.time() - t0
    assert r.returncode == 0, r.stderr
    marks = [(float(m[1]), m[3]) for m in map(LINE.search, r.stderr.splitlines()) if m]
    phases = [p for _, p in marks]
    want = ["generate: imports done", "model file opened", "cpu backend ready", "engine ready",
            "first prefill step done", "first token drawn", "generate: done", "generate: engine shut down",
            "exit hooks done"]
    assert [p for p in phases if p in want] == want, r.stderr
    assert "tokenizer ready (chat template checked)" in phases
    seconds = [s for s, p in marks if p in want]
    assert seconds == sorted(seconds)
    # counted from the process's start (the interpreter's own start included), within the run
    assert 0.0 < seconds[0] and seconds[-1] <= took + 0.05
    assert "guidance" not in r.stderr          # no llguidance vocabulary built for a plain prompt


def test_an_engine_without_the_prewarm_builds_the_grammar_vocabulary_on_first_use():
    eng = Engine.from_settings(Settings(backend="cpu", max_num_seqs=1, context_length=256), prewarm_guidance=False)
    try:
        assert eng.guidance._ll is None
        params = SamplingParams(max_tokens=40, temperature=0, constraint=Constraint("json_object"))
        text = "".join(o.text for o in eng.generate_sync(eng.prepare("A JSON object:", params), params))
        assert isinstance(json.loads(text), dict)
    finally:
        eng.shutdown()
