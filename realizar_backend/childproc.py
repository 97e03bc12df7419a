"""A Python child process spoken to in length-prefixed JSON frames over its stdin and stdout: the
server's sandboxed workers (chat-template renders, model/chat_template.py; grammar checks,
engine/grammar_check.py) are each one of these.

The parent never blocks on a child: every read has a deadline and may watch a cancel event, so a
child that hangs, or a caller whose client left, costs at most the limit. The child imports only
what its `worker_main` imports. It ignores SIGINT and SIGTERM (the server's process group may be
signalled as a whole; the server decides when its workers end) and ends quietly at the end of its
input, or when a reply finds its parent gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

FRAME = struct.Struct("<Q")        # a frame: its length, then that many bytes of UTF-8 JSON
POLL_S = 0.05                      # how often a read looks at its cancel event
_END_WAIT_S = 2.0                  # a child given the end of its input exits within this, or is killed


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


# ------------------------------------------------------------------------------ the child's side
class ParentChannel:
    """The child's end: frames from the parent until the end of its input, replies back."""

    def __init__(self) -> None:
        # the server's process group may be signalled as a whole; the server decides when we end
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        self._in, self._out = sys.stdin.buffer, sys.stdout.buffer

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
