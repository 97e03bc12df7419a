"""The engine in a process of its own, and the client a server process talks to it through.

In one process the engine's step thread and the server's event loop share the GIL: while a wave
of requests is parsed, streamed and answered, the step's kernel launches wait for it,
and the loop's work per token waits for the step. Here the child process owns the backend
and the step loop (`Engine` unchanged), and the server process keeps what a request needs before
it is queued (tokenizer, chat template, grammar check: `RequestPrep`) and the streams.

The pipe between them carries pickled messages (multiprocessing.connection over a socket pair):
- server -> engine: ("submit", request_id, prompt_ids, params), ("abort", request_id),
  ("finish_all", reason), ("stats",), ("prewarm", delay_s), ("ping", n), ("stop",);
- engine -> server: ("ready", info) or ("failed", error) once; then ("out", records) once per
  step with every stream's outputs of that step and the metrics events they came with,
  ("stats", dict) when the engine reports its gauges, and ("pong", n, busy_s) for each ping.
An output is the `RequestOutput` (or the exception) that `Engine.generate` would have yielded.
The child ignores SIGINT and SIGTERM (the server drains first, then says stop) and exits when the
pipe closes, so a server that dies takes its engine with it.

The server never blocks on the pipe: its messages are pickled where they are made and, when
nothing waits ahead of them, sent there as far as the socket takes them at once (a send that
cannot block); the rest are written by a thread of their own, so a stalled engine (stopped,
swapping, stuck in a step) cannot hold up the event loop. (Handing every message to the thread would make
each one wait for the thread to wake and take the GIL from a busy event loop before the engine
sees it: under a burst of requests that wait is in every request's time to first token.) Submits
that the engine has not taken are bounded (Settings.max_waiting of them beyond what the pipe
holds); past that a new request gets a retryable CapacityError (503). The same
thread pings the engine every HEARTBEAT_S; an engine that does not answer, or whose step runs on,
for Settings.engine_stall_timeout_s is reported stuck (`stall()`: /livez and /readyz turn 503).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import struct
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, AsyncIterator

from ..errors import BackendError, CapacityError
from ..childproc import package_root
from ..settings import Settings, gpu_environ
from .outputs import ChannelSink, RelayObserver, RequestOutput, _put_all, queue_outputs
from .prep import RequestPrep

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0     # a large model's upload and kernel builds, on a slow disk
_STOP_TIMEOUT_S = 15.0
HEARTBEAT_S = 1.0            # between pings of the engine process (one unanswered at a time)
# the gauges of an engine process that is gone: nothing runs, waits or holds memory
_GONE_GAUGES = {"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_used_blocks": 0, "kv_used_tokens": 0,
                "decode_tokens_per_s": 0.0, "pool_bytes": 0, "recurrent_state_bytes": 0, "device_memory_bytes": 0}

_LENGTH = struct.Struct("!i")    # multiprocessing.connection's frame: its length, then the bytes
_LONG = struct.Struct("!Q")      # (a length past 2**31 - 1: -1, then the length in 8 bytes)

_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from realizar_backend.engine.process import child_main; child_main(int(sys.argv[2]))")


# ------------------------------------------------------------------------------ the engine's side
class Channel:
    """The child's end of the pipe, shared by the step thread (outputs, events) and the command
    thread (replies): one lock around each send. Metrics events wait for the step's outputs and
    leave with them, in one message."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self._events: list[tuple] = []

    def send(self, msg: tuple) -> None:
        with self._lock:
            self.conn.send(msg)

    def event(self, ev: tuple) -> None:
        with self._lock:
            self._events.append(ev)

    def put(self, records: list[tuple[str, Any]]) -> None:
        """A step's outputs, (request_id, output) in order (outputs.Outbox.flush); the command
        thread also puts a refused request's error, so the events are taken under the lock."""
        with self._lock:
            events, self._events = self._events, []
            self.conn.send(("out", records, events))


def child_main(fd: int) -> None:
    """The engine process: settings arrive first, then commands until "stop" or end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    settings: Settings = conn.recv()
    logging.basicConfig(format="%(asctime)s %(levelname)s [engine %(process)d] %(name)s: %(message)s")
    logging.getLogger("realizar_backend").setLevel(settings.log_level.upper())
    channel = Channel(conn)
    from .engine import Engine

    try:
        # grammars reach it checked: the server's side tried them (EngineClient.prepare)
        engine = Engine.from_settings(settings, observer=RelayObserver(channel.event, lambda stats: channel.send(("stats", stats))), prewarm_guidance=False,
                                      check_grammars=False)
    except BaseException as e:      # the server names it and stands aside
        channel.send(("failed", e))
        return
    channel.send(("ready", {
        "model_name": engine.model_name, "max_context": engine.max_context, "kv_capacity": engine.kv_capacity,
        "max_slots": engine.backend.max_slots, "stats": engine.stats()}))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            op = msg[0]
            if op == "submit":
                _, rid, ids, params = msg
                try:
                    engine.submit(ids, params, rid, ChannelSink(channel, rid))
                except Exception as e:      # closing, or no longer fits: the request's own error
                    channel.put([(rid, e)])
            elif op == "abort":
                engine.abort(msg[1])
            elif op == "finish_all":
                engine.finish_all(msg[1])
            elif op == "stats":
                channel.send(("stats", engine.stats()))
            elif op == "prewarm":
                engine.prewarm_guidance(delay_s=msg[1])
            elif op == "ping":       # answered here, on the command thread, with the step's age
                channel.send(("pong", msg[1], engine.busy_s()))
            elif op == "stop":
                break
    finally:
        engine.shutdown()
        try:
            conn.close()
        except OSError:
            pass


# ------------------------------------------------------------------------------ the server's side
class EngineClient(RequestPrep):
    """What the server's routes call, with `Engine`'s request-side API (prepare, generate, abort,
    stats, finish_all, prewarm_guidance, shutdown), over an engine running in a child process."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, info: dict, tokenizer, guidance, config,
                 settings: Settings, observer, on_exit=None):
        from .engine import NullObserver
        self.settings = settings
        self.tokenizer = tokenizer
        self.guidance = guidance
        self.config = config
        self.model_name = info["model_name"]
        self.max_context = info["max_context"]
        self.kv_capacity = info["kv_capacity"]
        self.observer = observer or NullObserver()
        self._proc = proc                   # None: a shared engine (engine/shared.py), not this side's child
        self._conn = conn
        self.slot: int | None = None        # a shared engine's: this side's slot on its load board
        self.board = None
        self.reports = True                 # this side writes the engine's series (a shared engine's reporter)
        self._stats = info["stats"]
        self._stats_at = time.monotonic()   # when the latest report came
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._closing = False
        self._on_exit = on_exit             # called once with the error when the process dies unasked
        # what goes to the engine: (framed pickled message, is a submit), written by the writer
        # thread; a message with nothing ahead of it (none queued, none being written) is sent
        # where it is made, as far as the socket takes it at once (_send). Both write through
        # _direct, a second descriptor of the pipe's socket (blocking; _send's sends never wait)
        self._out: collections.deque[tuple[bytes, bool]] = collections.deque()
        self._out_cond = threading.Condition()
        self._writing = False               # the writer thread is writing a message now
        self._direct = socket.socket(fileno=os.dup(conn.fileno()))
        self._direct.settimeout(None)
        self._unsent_submits = 0
        self._max_unsent = settings.max_waiting
        self._stats_asked = False           # a ("stats",) not yet written
        self._pings = 0                     # pings written / the last one answered
        self._pong = 0
        self._pong_at = time.monotonic()    # when the engine last answered
        self._busy_s = 0.0                  # the age of its step then
        self._reader = threading.Thread(target=self._read, name="realizar-engine-pipe", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="realizar-engine-send", daemon=True)
        self._writer.start()

    @classmethod
    def start(cls, settings: Settings, observer=None, on_exit=None, gpu: str | None = None, index: int = 1,
              tokenizer=None) -> "EngineClient":
        """Start the engine process and, meanwhile, this side's tokenizer and grammar compiler;
        returns once the engine is ready. Raises what the engine's start raised (a bad model file,
        no GPU) or BackendError when the process died. on_exit(error): called (on the pipe's
        reader thread) if the process later dies without being asked to stop. gpu: the one GPU the
        process sees (a CUDA_VISIBLE_DEVICES entry; None: as this process); index: its number in
        the log; tokenizer: this side's, made elsewhere (a Tokenizer or a future of one)."""
        mine, theirs = socket.socketpair()
        env = None
        if gpu is not None:
            env = gpu_environ(gpu)
            settings = settings.replace(device=0)
        try:
            proc = subprocess.Popen([sys.executable, "-c", _BOOT, package_root(), str(theirs.fileno()), str(index)],
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True, env=env)
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        try:
            conn.send(settings)
            info, tokenizer, guidance, config = cls._handshake(conn, settings, tokenizer, proc.poll)
        except BaseException:
            conn.close()
            proc.kill()
            proc.wait()
            raise
        log.info("engine process %d (engine %d%s) ready (%s)", proc.pid, index, f", GPU {gpu}" if gpu else "",
                 info["stats"].get("backend"))
        return cls(proc, conn, info, tokenizer, guidance, config, settings, observer, on_exit)

    @classmethod
    def connect(cls, settings: Settings, directory: str, index: int, observer=None, on_exit=None,
                tokenizer=None) -> "EngineClient":
        """Connect to engine `index` of a server with several front ends (engine/shared.py: the
        serving process started it, and it listens in `directory`); returns once it is ready.
        Raises what the engine's start raised, or BackendError when it is gone."""
        from .shared import LoadBoard, board_path, socket_path

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path(directory, index))
        except OSError as e:
            sock.close()
            raise BackendError(f"engine {index} is gone (its socket: {e.strerror or e})") from None
        conn = Connection(sock.detach())
        try:
            info, tokenizer, guidance, config = cls._handshake(conn, settings, tokenizer, lambda: None)
            board = LoadBoard(board_path(directory, index))
        except BaseException:
            conn.close()
            raise
        log.info("connected to engine %d (%s; %s)", index, info["stats"].get("backend"),
                 "this front end writes its series" if info.get("reports") else "another front end writes its series")
        client = cls(None, conn, info, tokenizer, guidance, config, settings, observer, on_exit)
        client.slot, client.reports, client.board = info["slot"], bool(info.get("reports")), board
        return client

    @staticmethod
    def _handshake(conn: Connection, settings: Settings, tokenizer, exited):
        """Meanwhile this side's tokenizer and grammar compiler; then the engine's ("ready", info)
        or its error. exited(): the engine process's status once it is gone (None: running, or
        not ours to ask)."""
        from ..formats import open_model
        from ..model.chat_template import TemplateLimits
        from ..model.default import default_model_path
        from ..model.tokenizer import Tokenizer
        from .guidance import Guidance

        path = Path(settings.model) if settings.model else default_model_path(settings)
        model = open_model(path)
        if tokenizer is None:
            tokenizer = Tokenizer.from_model_file(model, TemplateLimits.from_settings(settings))
        elif hasattr(tokenizer, "result"):
            tokenizer = tokenizer.result()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not conn.poll(1.0):
            code = exited()
            if code is not None:
                raise BackendError(f"the engine process exited with status {code} while loading")
            if time.monotonic() > deadline:
                raise BackendError(f"the engine process was not ready after {_START_TIMEOUT_S:.0f} s")
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            code = exited()
            raise BackendError("the engine process exited" + (f" with status {code}" if code is not None else "")
                               + " while loading") from None
        if msg[0] == "failed":
            raise msg[1]
        info = msg[1]
        guidance = Guidance(tokenizer, model.config.vocab_size, pool_size=info["max_slots"],
                            check_timeout_s=settings.grammar_timeout_s, check_workers=settings.grammar_workers)
        return info, tokenizer, guidance, model.config

    # ---------------------------------------------------------------- request side (prepare: RequestPrep)
    def _send(self, msg: tuple) -> None:
        """Send a message to the engine, as far as the pipe takes it at once, the rest queued for the
        writer thread; never waits for the pipe. A submit is refused with a retryable CapacityError
        when max_waiting of them are already waiting to be written."""
        submit = msg[0] == "submit"
        data = _frame(ForkingPickler.dumps(msg))
        with self._out_cond:
            if self._dead is not None:
                raise OSError("the engine process is gone")
            if not self._out and not self._writing:
                try:
                    sent = self._direct.send(data, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:             # closed: the writer and the reader see the end
                    sent = 0
                if sent == len(data):
                    return
                if sent:                    # its head is in the pipe: the rest must follow, first
                    self._out.append((data[sent:], submit))
                    if submit:
                        self._unsent_submits += 1
                    self._out_cond.notify()
                    return
            if submit:
                if self._unsent_submits >= self._max_unsent:
                    raise CapacityError(f"the engine is not keeping up: {self._unsent_submits} requests wait to "
                                        "reach it; retry later", retry_after_s=5)
                self._unsent_submits += 1
            self._out.append((data, submit))
            self._out_cond.notify()

    def _write(self) -> None:
        """The writer thread: every queued message to the pipe in order, and a ping each
        HEARTBEAT_S while the last one has been answered. Ends with the pipe."""
        next_ping = time.monotonic()
        while True:
            with self._out_cond:
                while not self._out and self._dead is None and time.monotonic() < next_ping:
                    self._out_cond.wait(max(0.0, next_ping - time.monotonic()))
                if self._dead is not None:
                    return
                if self._out:
                    data, submit = self._out.popleft()
                else:
                    next_ping = time.monotonic() + HEARTBEAT_S
                    if self._pong < self._pings:      # the last one is unanswered: no pile of pings
                        continue
                    self._pings += 1
                    data, submit = _frame(ForkingPickler.dumps(("ping", self._pings))), False
                self._writing = True
            try:
                self._direct.sendall(data)
            except (OSError, ValueError):        # the pipe is closed: the reader sees the end
                return
            finally:
                with self._out_cond:
                    self._writing = False
                    if submit:
                        self._unsent_submits -= 1

    def stall(self) -> str | None:
        """Why the engine process is stuck, or None: no answer to a ping, or one step running, for
        longer than Settings.engine_stall_timeout_s. A process that is gone is not stuck (dead)."""
        if self._dead is not None or self._closing:
            return None
        limit = self.settings.engine_stall_timeout_s
        silent = time.monotonic() - self._pong_at
        if silent > limit:
            return f"the engine process has not answered for {silent:.0f} s"
        if self._busy_s + silent > limit:
            return f"the engine's current step has run for {self._busy_s + silent:.0f} s"
        return None

    def generate(self, prompt_ids: list[int], params, request_id: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        rid = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()

        def start() -> None:
            if self._dead is not None:
                raise CapacityError(f"the engine process is gone ({self._dead}); retry on another replica",
                                    retry_after_s=5)
            stuck = self.stall()
            if stuck is not None:
                raise CapacityError(f"the engine is stuck ({stuck}); retry on another replica", retry_after_s=5)
            with self._streams_lock:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already running")
                self._streams[rid] = _Stream(asyncio.get_running_loop(), q, len(prompt_ids))
            try:
                self._send(("submit", rid, list(prompt_ids), params))
            except OSError:
                leave(True)
                raise CapacityError("the engine process is gone; retry on another replica", retry_after_s=5) from None
            except BaseException:
                leave(True)
                raise

        def leave(done: bool) -> None:
            with self._streams_lock:
                self._streams.pop(rid, None)
            if not done and self._dead is None:
                try:
                    self._send(("abort", rid))
                except OSError:
                    pass

        return queue_outputs(q, start, leave)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        """The engine's latest report, and a fresh one asked for (it arrives on its own)."""
        if self._dead is None and not self._stats_asked:
            self._stats_asked = True
            try:
                self._send(("stats",))
            except OSError:
                pass
        return dict(self._stats)

    def kv_state(self):
        """The engine's KV pool as of its latest report (shared.KVState; None: not known): a shared
        engine's from its load board (every front end reads the same), else from its reports here."""
        from .shared import KVState
        if self.board is not None:
            return self.board.kv()
        return KVState.of(self._stats, self._stats_at)

    def finish_all(self, reason: str = "shutdown") -> None:
        self._send(("finish_all", reason))

    def prewarm_guidance(self, delay_s: float = 0.0, here: bool = True) -> None:
        """The engine's grammar vocabulary, and (here) this side's: prepare's check compiles
        grammars too, from the same vocabulary."""
        self._send(("prewarm", delay_s))
        if not here:
            return

        def run() -> None:
            time.sleep(delay_s)
            try:
                self.guidance.prewarm()
            except Exception:
                log.warning("constrained decoding (llguidance) could not read this tokenizer", exc_info=True)
        threading.Thread(target=run, name="realizar-guidance", daemon=True).start()

    def shutdown(self) -> None:
        self._closing = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        # a shared engine serves on: this side only leaves (the engine ends the connection)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("engine process %d did not stop in %g s; killing it", self._proc.pid, _STOP_TIMEOUT_S)
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=5)
        with self._out_cond:
            self._dead = self._dead or BackendError("the engine process was stopped")
            self._out_cond.notify()
        self._writer.join(timeout=5)
        self._conn.close()
        self._direct.close()
        if self.board is not None:
            self.board.close()

    # ---------------------------------------------------------------- the pipe's reader thread
    def _read(self) -> None:
        obs = self.observer
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError) as e:
                self._gone(e)
                return
            op = msg[0]
            if op == "out":
                self._deliver(msg[1])
                for kind, value in msg[2]:
                    if kind == "interval":
                        obs.on_token_interval(value)
                    else:
                        obs.on_request_finished(*value)
            elif op == "stats":
                self._stats_asked = False
                self._stats, self._stats_at = msg[1], time.monotonic()
                if len(msg) > 2:        # a shared engine's: whether this side writes its series
                    self.reports = msg[2]
                if self.reports:
                    obs.on_step(msg[1])
            elif op == "baseline":      # a shared engine's last report to the writer before this side
                prime = getattr(obs, "prime", None)
                if prime is not None:
                    prime(msg[1])
            elif op == "pong":
                self._pong, self._busy_s, self._pong_at = msg[1], msg[2], time.monotonic()

    def _deliver(self, records: list[tuple[str, Any]]) -> None:
        """A step's outputs to their streams."""
        with self._streams_lock:
            pairs = []
            for rid, item in records:
                s = self._streams.get(rid)
                if s is None:            # it left, its abort is on the way
                    continue
                if type(item) is RequestOutput:
                    s.completion_tokens = item.completion_tokens
                    s.ended = item.finish_reason is not None
                else:                    # an error ends it
                    s.ended = True
                pairs.append((s.where, item))
        _wake(pairs)

    @property
    def alive(self) -> bool:
        return self._dead is None

    def _gone(self, why: BaseException) -> None:
        if self._proc is None:                 # a shared engine: its connection ended
            code = "unknown: another process's child"
        else:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:      # the pipe broke, the process lingers: end it
                self._proc.kill()
                code = self._proc.wait()
        with self._out_cond:
            self._dead = BackendError(f"the engine process exited (status {code})")
            self._out.clear()
            self._out_cond.notify()
        err = CapacityError("the engine process exited; retry on another replica", retry_after_s=5)
        with self._streams_lock:
            lost = [s for s in self._streams.values() if not s.ended]
            for s in lost:
                s.ended = True
        if not self._closing:
            log.error("the engine process exited (status %s); failing its %d requests", code, len(lost))
        # its sequences end here, counted as errors, and its gauges read what now runs: nothing
        now = time.perf_counter()
        for s in lost:
            self.observer.on_request_finished("error", s.prompt_tokens, s.completion_tokens, now - s.arrival, None)
        self._stats = {**self._stats, **_GONE_GAUGES}
        if self.reports:
            self.observer.on_step(dict(self._stats))
        _wake([(s.where, err) for s in lost])
        if not self._closing and self._on_exit is not None:
            self._on_exit(self._dead)


def _frame(data) -> bytes:
    """A pickled message as multiprocessing.connection frames it (Connection.recv reads it)."""
    n = len(data)
    head = _LENGTH.pack(n) if n <= 0x7FFFFFFF else _LENGTH.pack(-1) + _LONG.pack(n)
    return head + data


class _Stream:
    """A request the engine process runs for this side: where its outputs go, and what the
    metrics need should the process die under it."""
    __slots__ = ("where", "prompt_tokens", "arrival", "completion_tokens", "ended")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, prompt_tokens: int):
        self.where = (loop, q)
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self.completion_tokens = 0
        self.ended = False


def _wake(pairs: list[tuple[tuple[asyncio.AbstractEventLoop, asyncio.Queue], Any]]) -> None:
    """Items to their streams' queues: one wakeup per event loop (as outputs.Outbox does)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for (loop, q), item in pairs:
        by_loop.setdefault(loop, []).append((q, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:      # that loop is closed: its callers are gone
            pass
