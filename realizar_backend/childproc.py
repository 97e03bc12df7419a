"""A Python child process spoken to in length-prefixed JSON frames over its stdin and stdout: the
server's sandboxed workers (chat-template renders, model/chat_template.py; grammar checks,
engine/grammar_check.py) are each one of these, lent out by a ChildPool.

The parent never blocks on a child: every read has a deadline and may watch a cancel event, so a
child that hangs, or a caller whose client left, costs at most the limit. The child imports only
what its `worker_main` imports. It ignores SIGINT and SIGTERM (the server's process group may be
signalled as a whole; the server decides when its workers end) and ends quietly at the end of its
input, when a reply finds its parent gone, or (busy on a request) within PARENT_CHECK_S of its
parent's end: a server killed outright leaves no worker behind. A reply that carries RESTART retires its child
(after a MemoryError there nothing in it is trusted).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

log = logging.getLogger(__name__)

FRAME = struct.Struct("<Q")        # a frame: its length, then that many bytes of UTF-8 JSON
POLL_S = 0.05                      # how often a read looks at its cancel event
_END_WAIT_S = 2.0                  # a child given the end of its input exits within this, or is killed
RESTART = "restart"                # a reply with this key true: its child is killed and replaced
PARENT_CHECK_S = 1.0               # how often a child looks whether its parent is still there
_WATCH_STACK_BYTES = 256 << 10     # the parent watch's thread stack (it counts in a child's RLIMIT_AS)


def package_root() -> str:
    """The directory that holds the realizar_backend package (a child puts it on sys.path)."""
    return str(Path(__file__).resolve().parents[1])


def _encode(obj: Any) -> bytes:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return FRAME.pack(len(data)) + data


class ChildGone(Exception):
    """The child exited (or closed its output); status: its exit status, None if it has not exited."""

    def __init__(self, proc: subprocess.Popen):
        try:
            self.status = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.status = None
        super().__init__(f"status {self.status}")


class ChildCancelled(Exception):
    """The caller's cancel event was set while it waited for the child."""


class Child:
    """One child process running `module.worker_main(args)`, and the pipes to it. Not thread-safe:
    a pool lends it to one caller at a time."""

    def __init__(self, module: str, args: Sequence[str] = ()):
        boot = (f"import sys; sys.path.insert(0, sys.argv[1]); "
                f"from {module} import worker_main; worker_main(sys.argv[2:])")
        self.proc = subprocess.Popen([sys.executable, "-c", boot, package_root(), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._buf = b""

    def send(self, obj: Any) -> None:
        try:
            self.proc.stdin.write(_encode(obj))
            self.proc.stdin.flush()
        except OSError:
            raise ChildGone(self.proc) from None

    def read(self, timeout_s: float, cancel: threading.Event | None = None) -> Any:
        """The child's next frame; TimeoutError past timeout_s, ChildCancelled once `cancel` is
        set, ChildGone if the child ends first."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        n = None
        while True:
            if n is None and len(self._buf) >= FRAME.size:
                (n,) = FRAME.unpack_from(self._buf)
                self._buf = self._buf[FRAME.size:]
            if n is not None and len(self._buf) >= n:
                msg, self._buf = self._buf[:n], self._buf[n:]
                return json.loads(msg.decode("utf-8", "surrogatepass"))
            if cancel is not None and cancel.is_set():
                raise ChildCancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            if select.select([fd], [], [], min(left, POLL_S) if cancel is not None else left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise ChildGone(self.proc)
                self._buf += chunk

    def kill(self) -> None:
        """Stop it now (cut off mid-answer: nothing it says later is trusted)."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def end_input(self) -> None:
        """Close its input: the child's loop ends there."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def wait_end(self) -> None:
        """After end_input: wait for the child to exit (_END_WAIT_S at most, then stop it)."""
        try:
            self.proc.wait(timeout=_END_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def close(self) -> None:
        self.end_input()
        self.wait_end()


# ------------------------------------------------------------------------------ a pool of children
# NOTE (ChildPool's invariants):
# - At most `size` children: each of the pool's slots holds an idle child, a child lent to one
#   caller, a child being started, or nothing yet; a child exists only in a slot.
# - A request never waits on a dead child: an idle child found dead is dropped at acquire, and
#   its slot is started afresh. A request waits only for a child in use or one being started.
# - A child whose request timed out, was cancelled, failed in any way, or whose reply says
#   "restart" is killed (SIGKILL, reaped) before the request's error or reply returns: nothing it
#   says later is trusted. Its replacement starts on a thread, off the request's path.
# - close() ends every child: idle ones are told to end (and killed if they do not within
#   _END_WAIT_S), those in use are killed (their callers get the pool's closed error), those
#   being started are ended when their start returns. No child outlives the server: every pool is
#   closed at interpreter exit, and a child whose parent is gone ends at the end of its input or,
#   busy, within PARENT_CHECK_S (ParentChannel).
class ChildPool:
    """Up to `size` children running `module.worker_main(args)`, lent one caller at a time.

    Parameters are where the pools of the server differ:
    - init: a frame sent to each fresh child before its handshake (None: nothing), e.g. the
      vocabulary a grammar checker builds from;
    - start_timeout_s: how long a fresh child may take to answer {"ready": true};
    - unavailable(why): the caller's error for a child that did not start or a closed pool;
    - per call, cancel: an event that abandons the call (the child is killed) once set.
    `call` raises TimeoutError, ChildGone or ChildCancelled from the child, the unavailable error,
    or whatever the request's frame could not be encoded with; the caller names them."""

    def __init__(self, module: str, size: int, *, args: Sequence[str] = (), init: Any = None,
                 start_timeout_s: float, unavailable: Callable[[str], BaseException], name: str):
        self.module, self.args, self.init, self.name = module, tuple(args), init, name
        self.start_timeout_s = start_timeout_s
        self._unavailable = unavailable
        self._idle: list[Child | None] = [None] * size     # None: a slot with no child yet
        self._busy: set[Child] = set()
        self._starting = 0           # slots whose child a thread is starting (in neither list)
        self._cond = threading.Condition()
        self._closed = False
        _pools.add(self)

    # ------------------------------------------------------------------ the caller's side
    def call(self, request: Any, timeout_s: float, cancel: threading.Event | None = None) -> Any:
        """The child's reply to `request`, within timeout_s and while `cancel` is not set."""
        child = self._acquire(cancel)
        if child is None:
            try:
                child = self._start(cancel)
            except BaseException:
                self._release(None)
                raise
        with self._cond:
            closed = self._closed
            if not closed:
                self._busy.add(child)
        if closed:                # closed while this child started: close() did not see it
            child.close()
            raise self._unavailable("closed")
        try:
            child.send(request)
            reply = child.read(timeout_s, cancel)
        except BaseException:
            self._replace(child)
            if self._closed:
                raise self._unavailable("closed") from None
            raise
        if isinstance(reply, dict) and reply.get(RESTART):
            self._replace(child)
        else:
            self._release(child)
        return reply

    def prestart(self, n: int | None = None) -> None:
        """Start children on a thread until `n` of them (None: all) are up or coming up, so that
        the first requests do not wait for a start (one that comes first waits for them)."""
        with self._cond:
            slots = [i for i, c in enumerate(self._idle) if c is None]
            if n is not None:
                up = len(self._busy) + self._starting + len(self._idle) - len(slots)
                slots = slots[:max(0, n - up)]
            if self._closed or not slots:
                return
            for i in reversed(slots):
                del self._idle[i]
            self._starting += len(slots)
        threading.Thread(target=self._start_slots, args=(len(slots),), name=f"{self.name}-start",
                         daemon=True).start()

    def pids(self) -> list[int]:
        """The process ids of the children up now, idle (last the one lent next) or in use."""
        with self._cond:
            return [c.proc.pid for c in self._busy] + [c.proc.pid for c in self._idle if c is not None]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = [c for c in self._idle if c is not None], []
            busy = list(self._busy)
            self._cond.notify_all()
        for c in busy:                # their callers own the pipes: signal only, and reap
            c.proc.kill()
            c.proc.wait()
        for c in idle:                # all told first, so that they exit together (an exit waits)
            c.end_input()
        for c in idle:
            c.wait_end()

    # ------------------------------------------------------------------ the slots
    def _start(self, cancel: threading.Event | None) -> Child:
        """A fresh child past its handshake; the unavailable error if it does not get there."""
        child = Child(self.module, self.args)
        try:
            if self.init is not None:
                child.send(self.init)
            hello = child.read(self.start_timeout_s, cancel)
        except (TimeoutError, ChildGone) as e:
            child.kill()
            raise self._unavailable(f"did not start ({e or 'timeout'})") from None
        except BaseException:
            child.kill()
            raise
        if hello != {"ready": True}:
            child.kill()
            raise self._unavailable(f"said {hello!r} at start")
        return child

    def _start_slots(self, n: int) -> None:
        for _ in range(n):
            try:
                child = self._start(None)
            except Exception as e:      # the request that takes the slot tries again and says why
                log.warning("a %s child did not start: %s", self.name, e)
                child = None
            self._release(child, started=True)

    def _acquire(self, cancel: threading.Event | None) -> Child | None:
        """An idle child if one is up; else a slot to start one in (None), unless a thread is
        starting one: that one is nearer than a new one."""
        with self._cond:
            while True:
                if self._closed:
                    raise self._unavailable("closed")
                if cancel is not None and cancel.is_set():
                    raise ChildCancelled()
                for i in reversed(range(len(self._idle))):
                    c = self._idle[i]
                    if c is not None and c.proc.poll() is not None:
                        c.kill()                 # it died idle: its slot starts afresh
                        self._idle[i] = c = None
                    if c is not None:
                        return self._idle.pop(i)
                if self._idle and not self._starting:
                    return self._idle.pop()
                self._cond.wait(POLL_S if cancel is not None else None)

    def _release(self, child: Child | None, started: bool = False) -> None:
        with self._cond:
            self._busy.discard(child)
            if started:
                self._starting -= 1
            if not self._closed:
                self._idle.append(child)
                self._cond.notify_all()   # waiters it does not serve may take a free slot
                return
        if child is not None:
            child.close()

    def _replace(self, child: Child) -> None:
        """Kill a child cut off mid-answer; a fresh one starts in its slot on a thread."""
        child.kill()
        with self._cond:
            self._busy.discard(child)
            if self._closed:
                return
            self._starting += 1
        threading.Thread(target=self._start_slots, args=(1,), name=f"{self.name}-restart", daemon=True).start()


_pools: weakref.WeakSet[ChildPool] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    for pool in list(_pools):
        pool.close()


# ------------------------------------------------------------------------------ the child's side
class ParentChannel:
    """The child's end: frames from the parent until the end of its input, replies back."""

    def __init__(self) -> None:
        # the server's process group may be signalled as a whole; the server decides when we end
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        self._in, self._out = sys.stdin.buffer, sys.stdout.buffer
        # a parent killed outright does not close() us: a request that runs away would run on alone
        parent = os.getppid()
        stack = threading.stack_size(_WATCH_STACK_BYTES)
        threading.Thread(target=self._watch, args=(parent,), name="parent-watch", daemon=True).start()
        threading.stack_size(stack)

    @staticmethod
    def _watch(parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    def read(self) -> Any | None:
        """The parent's next frame, or None at the end of its input."""
        head = self._in.read(FRAME.size)
        if len(head) < FRAME.size:
            return None
        (n,) = FRAME.unpack(head)
        body = self._in.read(n)
        return json.loads(body.decode("utf-8", "surrogatepass")) if len(body) == n else None

    def requests(self) -> Iterator[Any]:
        while (req := self.read()) is not None:
            yield req

    def reply(self, obj: Any) -> None:
        """Send a frame; a parent that is gone (it closed the pipe at shutdown) ends this process
        quietly: no one is left to read an error."""
        try:
            self._out.write(_encode(obj))
            self._out.flush()
        except (BrokenPipeError, OSError):
            os._exit(0)
