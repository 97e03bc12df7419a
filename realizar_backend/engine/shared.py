"""Engine cores shared by several front ends: `bentoml serve` with Settings.front_ends > 1.

With one front end, the engine processes are its children (engine/process.py: a socket pair
each, and an engine ends with its front end). With several, `bentoml serve`'s own process (the
serving process, BentoML's arbiter) starts them before its workers (the service's
`@bentoml.on_deployment` hook: `EngineHost`), and every front end connects to every engine.

NOTE on the design, the invariants:
- the serving process binds each engine's Unix socket (`engine-<i>.sock` in run_dir(its pid), a
  directory only its user can enter) before it starts the engine and before any worker starts,
  and hands the listening socket to the engine: a front end can always connect, and a connection
  made while the engine loads waits in the listen queue for its ("ready", info) or ("failed",
  error). The serving process keeps no copy of the listening socket, so an engine that dies
  closes it: a waiting front end sees the end of its connection, a later one is refused;
- an engine ends when the serving process does (its control socket closes: even after a
  SIGKILL), never when a front end does. A front end that dies (BentoML starts it again) loses
  its own streams only: the engine aborts that connection's sequences and serves the others;
  the new worker connects again;
- messages are engine/process.py's, per connection. The engine keys a sequence by its
  connection and request id (two front ends may use the same id), and sends a connection the
  outputs of its own sequences only. Its sends to a connection are written by a thread of their
  own, so a front end that reads slowly (or is stopped) never holds up the step loop for the
  others; one that leaves BACKLOG messages unread is hung up on, as if it had died;
- the load board: each engine writes, per connection (a slot, told in its "ready" info), the
  requests and prompt tokens in flight that came from it (counted from the submit's arrival to
  the stream's end, abort or the connection's end), in a small shared file beside its socket
  (`LoadBoard`). A front end routes by its own in-flight counts (exact, and at once) plus the
  other slots' (the engines' view of the other front ends): the least-work rule of group.py over
  the whole engine. The board also holds the engine's KV state as of its latest report (blocks
  used, in the pool, wanted by its waiting requests, and when: the host's monotonic clock, which
  every process reads alike), written under a sequence counter (odd while written: a reader that
  sees it odd or changed reads again, and after _BOARD_READS tries takes no report) so that a
  front end that is not the engine's reporter reads the same KV state as the one that is;
- prefix affinity is shared: a `PrefixTable` file in the same directory (the serving process
  makes it before any worker starts) maps a prompt head's hash to the engine it last went to,
  one 8-byte word an entry, direct-mapped (PREFIX_MEMORY entries; a head takes over its entry
  from whatever head hashed there). It is read and written without a lock: a word written
  by two front ends at once keeps one of the two, and a torn or overwritten entry names no
  engine or the wrong one, which costs a prefix-cache miss, never a wrong answer (the router
  checks the engine is live and within its slack, group.py). The last engine to end removes it
  with the directory;
- per-engine metrics are written once: an engine's reports (its gauges, cumulative step totals
  and the finished-sequence and token-interval events of every sequence) go to one connection,
  the reporter (the earliest connected that is still connected), which writes them as that
  engine's series; when the reporter goes, the next one gets ("baseline", last report) first
  and counts on from there. Each front end writes its own HTTP series and worker status; an
  engine's status is written by its reporter (an engine that failed at load: by worker 1);
- finish_all (a graceful shutdown's deadline) ends every sequence of the engine: all front ends
  drain together when the server stops (BentoML only restarts a worker that died, without
  SIGTERM), so a drain of one front end alone is not a case here;
- an engine that dies or is stuck stands aside in every front end (each sees its connection end,
  or pings go unanswered: EngineClient); every front end stands aside when none is left, and a
  server whose every engine failed at load stops with status 1 (worker 1 says why).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

from ..childproc import package_root
from ..settings import Settings, gpu_environ
from .outputs import ChannelSink, RelayObserver

log = logging.getLogger(__name__)

SLOTS = 64                     # connections an engine counts load for (front ends and their restarts)
BACKLOG = 8192                 # messages a front end may leave unread before the engine hangs up on it
PREFIX_MEMORY = 4096           # prompt heads the prefix table remembers (entries; a power of two)
_SLOT = struct.Struct("<qq")   # requests, prompt tokens in flight
# the engine's KV state after the slots: sequence counter (odd while written), blocks used, blocks
# in the pool, blocks its waiting requests' prompts want, when reported (time.monotonic())
_KV = struct.Struct("<qqqqd")
_KV_AT = SLOTS * _SLOT.size
_BOARD_BYTES = _KV_AT + _KV.size
_BOARD_READS = 8               # tries at a consistent KV state before a reader takes none
_ENTRY = struct.Struct("<Q")   # a prefix table entry: the head's 56-bit hash, then its engine + 1 (0: empty)
_STOP_TIMEOUT_S = 15.0

_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from realizar_backend.engine.shared import engine_main; "
         "engine_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))")


def run_dir(server_pid: int) -> str:
    """Where the engines of the server whose serving process is `server_pid` listen."""
    return os.path.join(tempfile.gettempdir(), f"realizar-engines-{server_pid}")


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"engine-{index}.sock")


def board_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"engine-{index}.load")


def prefix_path(directory: str) -> str:
    return os.path.join(directory, "prefixes")


class KVState(NamedTuple):
    """An engine's KV pool as of its latest report."""
    used_blocks: int
    total_blocks: int
    waiting_blocks: int        # blocks its waiting requests' prompts want (admitted as these free up)
    reported_at: float         # time.monotonic() when reported

    @classmethod
    def of(cls, stats: dict[str, Any], at: float) -> "KVState | None":
        if "kv_total_blocks" not in stats:
            return None
        return cls(stats.get("kv_used_blocks", 0), stats["kv_total_blocks"], stats.get("kv_waiting_blocks", 0), at)


class LoadBoard:
    """One engine's load per connection slot, in a shared file: the engine adds, front ends read."""

    def __init__(self, path: str, writable: bool = False):
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, _BOARD_BYTES, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._lock = threading.Lock()

    @staticmethod
    def create(path: str) -> None:
        with open(path, "wb") as f:
            f.write(bytes(_BOARD_BYTES))

    def add(self, slot: int, requests: int, tokens: int) -> None:
        with self._lock:
            r, t = _SLOT.unpack_from(self._map, slot * _SLOT.size)
            _SLOT.pack_into(self._map, slot * _SLOT.size, r + requests, t + tokens)

    def clear(self, slot: int) -> None:
        with self._lock:
            _SLOT.pack_into(self._map, slot * _SLOT.size, 0, 0)

    def set_kv(self, stats: dict[str, Any]) -> None:
        """The engine's: its KV state, from a report (KVState.of), now."""
        state = KVState.of(stats, time.monotonic())
        if state is None:
            return
        with self._lock:
            seq = struct.unpack_from("<q", self._map, _KV_AT)[0] + 1
            struct.pack_into("<q", self._map, _KV_AT, seq)                    # odd: being written
            _KV.pack_into(self._map, _KV_AT, seq, *state)
            struct.pack_into("<q", self._map, _KV_AT, seq + 1)

    def kv(self) -> KVState | None:
        """The engine's KV state as of its latest report (None: none yet, or no consistent read)."""
        for _ in range(_BOARD_READS):
            seq, *state = _KV.unpack_from(self._map, _KV_AT)
            if seq % 2 or struct.unpack_from("<q", self._map, _KV_AT)[0] != seq:
                continue
            return KVState(*state) if seq else None
        return None

    def others(self, slot: int | None) -> tuple[int, int]:
        """Requests and prompt tokens in flight from every slot but `slot`."""
        values = struct.unpack_from(f"<{2 * SLOTS}q", self._map, 0)
        r, t = sum(values[0::2]), sum(values[1::2])
        if slot is not None:
            r -= values[2 * slot]
            t -= values[2 * slot + 1]
        return max(0, r), max(0, t)

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass


class PrefixTable:
    """Prompt head -> the engine it last went to, PREFIX_MEMORY entries of one word each: in a
    shared file (several front ends: `open`) or in this process (one front end: `private`).
    Lock-free, direct-mapped (the NOTE above): a lookup or an update is one word's read or write."""

    def __init__(self, buffer):
        self._map = buffer

    @classmethod
    def private(cls) -> "PrefixTable":
        return cls(bytearray(PREFIX_MEMORY * _ENTRY.size))

    @classmethod
    def open(cls, path: str) -> "PrefixTable":
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(mmap.mmap(fd, PREFIX_MEMORY * _ENTRY.size))
        finally:
            os.close(fd)

    @staticmethod
    def create(path: str) -> None:
        with open(path, "wb") as f:
            f.write(bytes(PREFIX_MEMORY * _ENTRY.size))

    @staticmethod
    def _hash(head: tuple[int, ...]) -> int:
        data = struct.pack(f"<{len(head)}q", *head)
        return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")

    def get(self, head: tuple[int, ...]) -> int | None:
        """The engine (0-based) this head last went to, or None."""
        h = self._hash(head)
        word = _ENTRY.unpack_from(self._map, (h % PREFIX_MEMORY) * _ENTRY.size)[0]
        if word >> 8 != h or not word & 0xFF:
            return None
        return (word & 0xFF) - 1

    def put(self, head: tuple[int, ...], engine: int) -> None:
        if not 0 <= engine < 0xFF:
            return
        h = self._hash(head)
        _ENTRY.pack_into(self._map, (h % PREFIX_MEMORY) * _ENTRY.size, (h << 8) | (engine + 1))

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            try:
                self._map.close()
            except (BufferError, ValueError):
                pass


# ------------------------------------------------------------------------------ the serving process's side
class EngineHost:
    """The engine processes of a server with several front ends, in its serving process."""

    def __init__(self, directory: str):
        self.directory = directory
        self.procs: list[subprocess.Popen] = []
        self.controls: list[Connection] = []

    @classmethod
    def start(cls, settings: Settings, devices: list[str | None]) -> "EngineHost":
        """Start one engine per entry of devices (a GPU's CUDA_VISIBLE_DEVICES entry, or None);
        returns at once (the engines load meanwhile; front ends wait for them)."""
        import shutil
        host = cls(run_dir(os.getpid()))
        shutil.rmtree(host.directory, ignore_errors=True)
        os.makedirs(host.directory, mode=0o700)
        PrefixTable.create(prefix_path(host.directory))
        for i, gpu in enumerate(devices, 1):
            path = socket_path(host.directory, i)
            LoadBoard.create(board_path(host.directory, i))
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(SLOTS)
            mine, theirs = socket.socketpair()
            env, engine_settings = None, settings
            if gpu is not None:
                env = gpu_environ(gpu)
                engine_settings = settings.replace(device=0)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, package_root(), str(theirs.fileno()), str(listener.fileno()),
                     board_path(host.directory, i), str(i)],
                    pass_fds=(theirs.fileno(), listener.fileno()), stdin=subprocess.DEVNULL, close_fds=True,
                    env=env)
            finally:
                theirs.close()
                listener.close()          # the engine's alone: it closes when the engine ends
            control = Connection(mine.detach())
            control.send(engine_settings)
            host.procs.append(proc)
            host.controls.append(control)
        log.info("%d engine process(es) started for the front ends (%s)", len(devices), host.directory)
        return host

    def stop(self) -> None:
        """Stop the engines (each shuts its engine down when its control socket closes)."""
        import shutil
        for c in self.controls:
            try:
                c.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


# ------------------------------------------------------------------------------ the engine's side
class _Peer:
    """One front end's connection to this engine."""

    def __init__(self, hub: "_Hub", conn: Connection, slot: int, serial: int):
        self.hub, self.conn, self.slot, self.serial = hub, conn, slot, serial
        self.channel = _PeerChannel(conn, self)
        self.live: dict[str, tuple[str, int]] = {}       # engine key -> (request id, prompt tokens)
        self.lock = threading.Lock()


def _key(peer: _Peer, rid: str) -> str:
    return f"{peer.serial}/{rid}"


class _PeerChannel:
    """A connection's sends, counting its sequences' ends on the board. Written by a thread of
    its own: the step thread only queues (a front end that reads slowly never holds up the
    engine for the others); one that leaves BACKLOG messages unread is hung up on (its
    sequences are aborted, as if it had died)."""

    def __init__(self, conn: Connection, peer: _Peer):
        self.conn, self.peer = conn, peer
        self._cond = threading.Condition()
        self._queue: collections.deque[bytes] = collections.deque()
        self._closed = False
        self._writer = threading.Thread(target=self._write, name="realizar-front-end-send", daemon=True)
        self._writer.start()

    def send(self, msg: tuple) -> None:
        data = bytes(ForkingPickler.dumps(msg))
        with self._cond:
            if self._closed:
                return
            if len(self._queue) < BACKLOG:
                self._queue.append(data)
                self._cond.notify()
                return
            self._closed = True
            self._queue.clear()
            self._cond.notify()
        log.error("a front end has left %d messages unread: hanging up on it (its requests end)", BACKLOG)
        self.hang_up()

    def hang_up(self) -> None:
        """End the connection both ways: its reader (serve) sees the end and the front end leaves."""
        try:
            dup = socket.socket(fileno=os.dup(self.conn.fileno()))
        except (OSError, ValueError):
            return
        try:
            dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            dup.close()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                data = self._queue.popleft()
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):      # the front end is gone: its reader thread ends it
                with self._cond:
                    self._closed = True
                    self._queue.clear()
                return

    def close(self, timeout: float = 1.0) -> None:
        """Write what is queued (for up to `timeout`), then stop the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._writer.join(timeout)

    def put(self, records: list[tuple[str, Any]]) -> None:
        from .outputs import RequestOutput     # the engine's side only (the serving process never puts)
        peer, ended = self.peer, []
        for rid, item in records:
            if type(item) is not RequestOutput or item.finish_reason is not None:
                ended.append(rid)
        if ended:
            peer.hub.ended(peer, ended)
        events = peer.hub.take_events(peer)
        self.send(("out", records, events))


class _Hub:
    """The engine's connections: their slots, the load board, and which one reports."""

    def __init__(self, board: LoadBoard):
        self.board = board
        self.lock = threading.Lock()
        self.peers: list[_Peer] = []          # in the order they connected
        self.serial = 0
        self.events: list[tuple] = []
        self.last_report: dict[str, Any] | None = None
        self.reported_to: _Peer | None = None  # the reporter that got the last report

    def join(self, conn: Connection) -> _Peer:
        with self.lock:
            used = {p.slot for p in self.peers}
            slot = next((s for s in range(SLOTS) if s not in used), None)
            if slot is None:
                raise OSError(f"more than {SLOTS} front ends")
            self.serial += 1
            self.board.clear(slot)
            peer = _Peer(self, conn, slot, self.serial)
            self.peers.append(peer)
            return peer

    @property
    def reporter(self) -> _Peer | None:
        return self.peers[0] if self.peers else None

    def leave(self, peer: _Peer, engine) -> None:
        with peer.lock:
            keys, peer.live = list(peer.live), {}
        for key in keys:
            engine.abort(key)
        with self.lock:
            if peer in self.peers:
                self.peers.remove(peer)
            self.board.clear(peer.slot)

    def started(self, peer: _Peer, key: str, rid: str, tokens: int) -> None:
        with peer.lock:
            peer.live[key] = (rid, tokens)
        self.board.add(peer.slot, 1, tokens)

    def ended(self, peer: _Peer, rids: list[str]) -> None:
        for rid in rids:
            self.forget(peer, _key(peer, rid))

    def forget(self, peer: _Peer, key: str) -> None:
        with peer.lock:
            entry = peer.live.pop(key, None)
        if entry is not None:
            self.board.add(peer.slot, -1, -entry[1])

    def event(self, ev: tuple) -> None:
        with self.lock:
            if self.peers:
                self.events.append(ev)

    def take_events(self, peer: _Peer) -> list[tuple]:
        with self.lock:
            if self.reporter is not peer or not self.events:
                return []
            events, self.events = self.events, []
            return events

    def report(self, stats: dict[str, Any], to: _Peer | None = None) -> None:
        """The engine's report: to the reporter (its series), or, asked by another, to it alone;
        its KV state to the board, for every front end."""
        self.board.set_kv(stats)
        with self.lock:
            reporter = self.reporter
            if to is not None and to is not reporter:
                baseline = None
            else:
                to = reporter
                if to is None:
                    return
                baseline = self.last_report if self.reported_to is not to else None
                self.last_report, self.reported_to = stats, to
                events, self.events = self.events, []
        if to is None:
            return
        if baseline is not None:
            to.channel.send(("baseline", baseline))
        to.channel.send(("stats", stats, to is reporter))
        if to is reporter and events:
            to.channel.send(("out", [], events))


def engine_main(control_fd: int, listen_fd: int, board: str, index: int = 1) -> None:
    """An engine process shared by the front ends: settings arrive on the control socket, front
    ends connect on the listening one; it ends when the control socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    control = Connection(control_fd)
    settings: Settings = control.recv()
    logging.basicConfig(format="%(asctime)s %(levelname)s [engine %(process)d] %(name)s: %(message)s")
    logging.getLogger("realizar_backend").setLevel(settings.log_level.upper())
    listener = socket.socket(fileno=listen_fd)
    hub = _Hub(LoadBoard(board, writable=True))
    from .engine import Engine

    engine, failed = None, None
    try:
        engine = Engine.from_settings(settings, observer=RelayObserver(hub.event, hub.report), prewarm_guidance=False,
                                      check_grammars=False)
    except BaseException as e:      # every front end is told, and stands aside
        failed = e
    info = None if engine is None else {
        "model_name": engine.model_name, "max_context": engine.max_context, "kv_capacity": engine.kv_capacity,
        "max_slots": engine.backend.max_slots}
    prewarmed = threading.Event()

    def serve(sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        if failed is not None:
            try:
                try:
                    conn.send(("failed", failed))
                except (TypeError, AttributeError, ValueError):     # not picklable: its words then
                    conn.send(("failed", RuntimeError(f"{type(failed).__name__}: {failed}")))
            except OSError:                 # that front end left already (it failed too)
                pass
            conn.close()
            return
        try:
            peer = hub.join(conn)
        except OSError as e:
            try:
                conn.send(("failed", e))
            except OSError:
                pass
            conn.close()
            return
        peer.channel.send(("ready", {**info, "slot": peer.slot, "stats": engine.stats(),
                                     "reports": peer is hub.reporter}))
        hub.report(engine.stats(), to=peer)
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                op = msg[0]
                if op == "submit":
                    _, rid, ids, params = msg
                    key = _key(peer, rid)
                    hub.started(peer, key, rid, len(ids))
                    try:
                        engine.submit(ids, params, key, ChannelSink(peer.channel, rid))
                    except Exception as e:      # closing, or no longer fits: the request's own error
                        peer.channel.put([(rid, e)])
                elif op == "abort":
                    key = _key(peer, msg[1])
                    engine.abort(key)
                    hub.forget(peer, key)
                elif op == "finish_all":
                    engine.finish_all(msg[1])
                elif op == "stats":
                    hub.report(engine.stats(), to=peer)
                elif op == "prewarm":
                    if not prewarmed.is_set():
                        prewarmed.set()
                        engine.prewarm_guidance(delay_s=msg[1])
                elif op == "ping":
                    peer.channel.send(("pong", msg[1], engine.busy_s()))
                elif op == "stop":      # a front end's own end: the engine serves on
                    break
        finally:
            hub.leave(peer, engine)
            peer.channel.close()
            try:
                conn.close()
            except OSError:
                pass
            log.debug("engine %d: a front end left (%d connected)", index, len(hub.peers))

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(sock,), name="realizar-front-end", daemon=True).start()

    threading.Thread(target=accept, name="realizar-accept", daemon=True).start()
    try:
        while True:
            control.recv()          # nothing is sent after the settings: this waits for the end
    except (EOFError, OSError):
        pass
    finally:
        listener.close()
        if engine is not None:
            engine.shutdown()
        # the server's run directory, gone with its last engine (even when the server was killed)
        # (each engine lists the directory after removing its own files: the last of them to
        # remove its files sees the prefix table alone, and removes it too)
        directory = os.path.dirname(board)
        for path in (board, socket_path(directory, index)):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            if os.listdir(directory) == [os.path.basename(prefix_path(directory))]:
                os.unlink(prefix_path(directory))
            os.rmdir(directory)
        except OSError:          # another engine's files are still there (or another removed it)
            pass
