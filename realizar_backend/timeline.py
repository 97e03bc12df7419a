"""The start-up timeline: one INFO line per phase of a start, "startup 1.23 s (12:00:01.234): <phase>",
with the seconds since the process started and the wall clock (to line up the processes of a
server) (from /proc on Linux; elsewhere since this module was imported),
on the logger `realizar_backend.startup`. A cold start's lines show where its seconds go
(tools/cold_start.sh prints them); `once` marks the first occurrence of a per-request event (the
first prefill, the first token) and stays silent afterwards."""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("realizar_backend.startup")


def _process_age() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time against the boot
    clock, 10 ms resolution), or 0 where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")       # field 22: start time, clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start
        return age if 0.0 <= age < 3600.0 else 0.0
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


_T0 = time.perf_counter() - _process_age()
_seen: set[str] = set()
_lock = threading.Lock()


def elapsed() -> float:
    """Seconds since the process started."""
    return time.perf_counter() - _T0


def mark(phase: str, *args) -> None:
    """Log that a phase of the start is done (phase: a %-format with args)."""
    if log.isEnabledFor(logging.INFO):
        now = time.time()
        clock = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        log.info("startup %.2f s (%s): " + phase, elapsed(), clock, *args)


def once(phase: str, *args) -> None:
    """mark() the first time this phase is reached in the process; nothing after."""
    if phase in _seen:
        return
    with _lock:
        if phase in _seen:
            return
        _seen.add(phase)
    mark(phase, *args)
