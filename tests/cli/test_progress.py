"""realizar_backend/progress.py: a progress bar on stderr when it is a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import os
import pty
import subprocess
import sys
from pathlib import Path

from realizar_backend.progress import progress

REPO = Path(__file__).resolve().parents[2]


def test_not_a_terminal_gives_a_start_and_an_end_log_line(caplog):
    log = logging.getLogger("realizar_backend.test_progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        with progress("reading weights", total=3_000_000, log=log) as advance:
            for _ in range(3):
                advance(1_000_000)
        with progress("bench", total=4, unit="repetitions", log=log) as advance:
            for _ in range(4):
                advance(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "reading weights: 3.0 MB"
    assert lines[1].startswith("reading weights: 3.0 MB in ") and lines[1].endswith(" MB/s")
    assert lines[2] == "bench: 4 repetitions"
    assert lines[3].startswith("bench: 4 repetitions in ")


def test_a_terminal_gets_a_bar_on_stderr_and_nothing_on_stdout():
    code = ("import time\nfrom realizar_backend.progress import progress\n"
            "with progress('uploading weights', total=8_000_000) as advance:\n"
            "    for _ in range(8):\n        advance(1_000_000); time.sleep(0.12)\n"
            "print('result')\n")
    master, slave = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=slave,
                           env={**os.environ, "TERM": "xterm", "COLUMNS": "120"}, timeout=60)
        os.close(slave)
        slave = None
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:        # the other end is closed: everything is read
                break
            if not chunk:
                break
            out += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert p.returncode == 0
    assert p.stdout == b"result\n"
    text = out.decode(errors="replace")
    assert "uploading weights" in text
    assert "8.0/8.0 MB" in text           # rich's DownloadColumn at the end
    assert "\x1b[" in text                # drawn with terminal control sequences
