"""The server's processes at their start and end: `bentoml serve`'s own process (BentoML's
arbiter, "the serving process") and its workers.

- A worker ends when the serving process ends, even by SIGKILL (`end_with_the_server`).
- The serving process says a bad setting or a port in use in one line, not a traceback
  (`one_line_errors`), and exits with status 1 when its workers could not load the model
  (`fail_the_server` in a worker, `at_exit` in the serving process).
Nothing here imports BentoML or the engine: service.py calls these at its import.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from ..errors import SettingsError

log = logging.getLogger("realizar_backend.service")

_PR_SET_PDEATHSIG = 1            # linux/prctl.h
_PARENT_POLL_S = 1.0
_FAILED = "failed"               # the mark a worker leaves in server_dir: exit with status 1


def end_with_the_server() -> None:
    """A worker ends when the server's main process (BentoML's arbiter, its parent) ends, even
    by SIGKILL: BentoML starts each worker in a session of its own, so nothing else would stop it,
    and it would keep serving on (and holding) the port. Linux: the kernel sends SIGKILL at the
    parent's death (PR_SET_PDEATHSIG; the engine process then ends when its pipe closes);
    elsewhere a thread watches the parent's pid."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:         # it died before the request took effect
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        log.error("the server's main process is gone; this worker ends")
        os._exit(1)

    threading.Thread(target=watch, name="realizar-parent-watch", daemon=True).start()


def one_line_errors() -> None:
    """From now on, this process's uncaught errors that a user can fix (a bad setting, a port in
    use) print as one line, not BentoML's 50-70 lines of traceback; Python then exits with 1."""
    previous = sys.excepthook

    def hook(kind, error, tb) -> None:
        if isinstance(error, SettingsError):
            print(f"realizar: {error}", file=sys.stderr)
        elif isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            where = ""
            while tb is not None:     # circus's socket, in the frame that bound it, knows the address
                owner = tb.tb_frame.f_locals.get("self")
                if hasattr(owner, "host") and hasattr(owner, "port"):
                    where = f" {owner.host}:{owner.port}"
                tb = tb.tb_next
            print(f"realizar: cannot listen on{where}: the address is in use (another server? choose another "
                  f"with --port)", file=sys.stderr)
        else:
            previous(kind, error, tb)

    sys.excepthook = hook


def server_dir(pid: int) -> str:
    """The directory of the server whose main process is `pid`: its workers' metric files
    (service.py), and the mark a worker leaves when the server must exit with an error."""
    return os.path.join(tempfile.gettempdir(), f"realizar-metrics-{pid}")


def fail_the_server(why: str) -> None:
    """In a worker: mark its server as failed and ask it to stop (SIGTERM to the
    arbiter, its parent); the serving process then exits with status 1 (at_exit). OSError when
    there is no such server to stop."""
    with open(os.path.join(server_dir(os.getppid()), _FAILED), "w") as f:
        f.write(why)
    os.kill(os.getppid(), signal.SIGTERM)


def at_exit(path: str) -> None:
    """The serving process's last act: remove its directory, and exit with status 1 where its
    workers could not load the model (worker 1 said why, in one line, and stopped it)."""
    failed = os.path.exists(os.path.join(path, _FAILED))
    shutil.rmtree(path, True)
    if failed:
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)
