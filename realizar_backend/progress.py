"""Progress of the long steps a person waits for (fetching the default model, reading or uploading
weights, benchmark repetitions): a rich progress bar on stderr when stderr is a terminal, and
otherwise one log line when the step starts and one when it ends.

    with progress("cuda: uploading weights", total=n_bytes, unit="bytes", log=log) as advance:
        for chunk in chunks:
            ...
            advance(len(chunk))

Any layer may use it (it depends on nothing in the package); stdout stays free for results.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_log = logging.getLogger(__name__)


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # replaced or closed stream
        return False


def _amount(n: float, unit: str) -> str:
    if unit == "bytes":
        return f"{n / 1e6:,.1f} MB"
    return f"{n:,.0f} {unit}"


@contextmanager
def progress(description: str, total: float | None = None, unit: str = "bytes",
             log: logging.Logger | None = None) -> Iterator[Callable[[float], None]]:
    """Yields advance(n): n more units (bytes, or repetitions, requests...) of `total` are done.
    unit="bytes" shows sizes and a transfer rate; any other unit shows "done/total unit"."""
    log = log or _log
    t0 = time.perf_counter()
    done = [0.0]
    if not stderr_is_terminal():
        log.info("%s%s", description, f": {_amount(total, unit)}" if total else "")

        def advance(n: float) -> None:
            done[0] += n

        try:
            yield advance
        finally:
            dt = time.perf_counter() - t0
            rate = f", {_amount(done[0] / dt, unit)}/s" if dt > 0 and unit == "bytes" else ""
            log.info("%s: %s in %.2f s%s", description, _amount(done[0], unit), dt, rate)
        return

    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

    if unit == "bytes":
        columns = (DownloadColumn(), TransferSpeedColumn())
    else:
        columns = (MofNCompleteColumn(), TextColumn(unit))
    # redrawn by advance() (at most 10 times a second), not by a thread of its own: a refresh thread
    # would compete for the GIL with what is being measured or loaded
    bar = Progress(TextColumn("{task.description}"), BarColumn(), *columns, TimeElapsedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), auto_refresh=False,
                   redirect_stdout=False, redirect_stderr=False)
    task = bar.add_task(description, total=total)
    last = [0.0]

    def advance(n: float) -> None:
        done[0] += n
        now = time.perf_counter()
        redraw = now - last[0] >= 0.1 or (total is not None and done[0] >= total)
        if redraw:
            last[0] = now
        bar.update(task, advance=n, refresh=redraw)

    with bar:
        yield advance
