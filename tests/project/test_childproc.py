"""The pool of sandboxed child processes (realizar_backend/childproc.py's ChildPool) that chat
template renders and grammar checks run in: a child that hangs or whose caller leaves is killed and
replaced, a request never meets a dead child, the pool never runs more than its size, and close()
leaves no child running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from realizar_backend.childproc import ChildCancelled, ChildPool

CHILD = "tests.support.pool_child"     # imported by the child from the repository's root
ROOT = Path(__file__).resolve().parents[2]


class Unavailable(Exception):
    pass


def _pool(size: int) -> ChildPool:
    return ChildPool(CHILD, size, start_timeout_s=60.0, unavailable=Unavailable, name="test-pool")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pool_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if CHILD in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_child_that_hangs_is_killed_at_its_time_limit_and_a_fresh_one_serves_the_next():
    pool = _pool(1)
    try:
        first = pool.call({}, 30.0)["pid"]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            pool.call({"sleep": 600}, 0.5)
        assert time.monotonic() - t0 < 5, "the call went on past its time limit"
        assert not _running(first), "the hung child is still running"
        second = pool.call({}, 30.0)["pid"]
        assert second != first and _running(second)
    finally:
        pool.close()


def test_a_cancel_mid_request_kills_the_child_and_a_fresh_one_serves_the_next():
    pool = _pool(1)
    try:
        first = pool.call({}, 30.0)["pid"]
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        t0 = time.monotonic()
        with pytest.raises(ChildCancelled):
            pool.call({"sleep": 600}, 600.0, cancel)
        assert time.monotonic() - t0 < 5, "the call went on after its cancel"
        assert not _running(first), "the cancelled child is still running"
        assert pool.call({}, 30.0)["pid"] != first
    finally:
        pool.close()


def test_a_request_never_meets_a_child_that_died_idle():
    pool = _pool(1)
    try:
        first = pool.call({}, 30.0)["pid"]
        os.kill(first, signal.SIGKILL)
        psutil.Process(first).wait(10)
        assert pool.call({}, 30.0)["pid"] != first
    finally:
        pool.close()


def test_a_reply_that_asks_for_a_restart_retires_its_child():
    pool = _pool(1)
    try:
        first = pool.call({"restart": True}, 30.0)["pid"]
        assert not _running(first)
        assert pool.call({}, 30.0)["pid"] != first
    finally:
        pool.close()


def test_concurrent_requests_share_at_most_size_children():
    pool = _pool(2)
    try:
        pool.prestart(1)
        with ThreadPoolExecutor(6) as ex:
            pids = list(ex.map(lambda _: pool.call({"sleep": 0.1}, 30.0)["pid"], range(12)))
        assert len(set(pids)) <= 2 and len(pool.pids()) <= 2
    finally:
        pool.close()


def test_close_ends_every_child_also_one_in_use():
    pool = _pool(2)
    pool.prestart()
    deadline = time.monotonic() + 60
    while len(pool.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pool.pids()) == 2
    errors = []

    def hang() -> None:
        try:
            pool.call({"sleep": 600}, 600.0)
        except Exception as e:
            errors.append(e)

    caller = threading.Thread(target=hang)
    caller.start()
    time.sleep(0.3)                        # the call is under way: one child in use, one idle
    pids = pool.pids()
    t0 = time.monotonic()
    pool.close()
    caller.join(10)
    assert not caller.is_alive() and time.monotonic() - t0 < 10
    assert len(errors) == 1 and isinstance(errors[0], Unavailable)
    assert not [pid for pid in pids if _running(pid)] and not _pool_children()
    with pytest.raises(Unavailable):
        pool.call({}, 30.0)


SERVER = f"""
import sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
from realizar_backend.childproc import ChildPool
pool = ChildPool({CHILD!r}, 2, start_timeout_s=60.0, unavailable=RuntimeError, name="test-pool")
pool.prestart()
deadline = time.monotonic() + 60
while len(pool.pids()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
threading.Thread(target=pool.call, args=({{"sleep": 600}}, 600.0), daemon=True).start()
time.sleep(0.3)                                # one child hangs on its request, the other is idle
print(" ".join(map(str, pool.pids())), flush=True)
time.sleep(60)
"""


def test_no_child_outlives_a_server_killed_outright():
    # a server killed by SIGKILL closes nothing: its idle child ends at the end of its input, the
    # one hung on a request within a second or two of noticing its parent gone
    server = psutil.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in server.stdout.readline().split()]
        assert len(pids) == 2 and all(_running(pid) for pid in pids)
    finally:
        server.kill()
        server.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if _running(pid)], "a child outlived its server"
