"""The BentoML service: OpenAI-compatible routes in front of one engine core per GPU.

    bentoml serve                      # from the repo root: the default SmolLM2-135M, best backend here
    REALIZAR_MODEL=/models/x.gguf REALIZAR_BACKEND=cuda bentoml serve --port 3000
    realizar serve /models/x.gguf      # the same from anywhere the package is installed

The class lives in the package (not in the repo's service.py, which re-exports it) so that an
installed package can serve without a checkout.

Configuration is Settings.from_env() (REALIZAR_* variables; see realizar_backend/settings.py).
BentoML runs Settings.front_ends worker processes (one per GPU by default), the front
ends, on one port: each tokenizes, renders templates, checks grammars and streams its own
requests, and sends each to one of Settings.workers engine processes, one per GPU, each with its
own copy of the model (see "engines" below; the router is engine/group.py, engines shared by
several front ends engine/shared.py). The OpenAI routes are a Starlette app mounted with
`bentoml.asgi_app`, so their paths, status codes and SSE framing are exactly OpenAI's; BentoML
itself serves /livez, /readyz and /metrics (ours included: see realizar_backend/serving/metrics.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import threading
import time

import bentoml

from realizar_backend import timeline
from realizar_backend.errors import RealizarError
from realizar_backend.serving import lifecycle
from realizar_backend.serving.state import ServerState
from realizar_backend.settings import Settings, serve_engines, serve_front_ends, visible_gpus

log = logging.getLogger("realizar_backend.service")

if bentoml.server_context.worker_index is not None:
    lifecycle.end_with_the_server()
else:
    lifecycle.one_line_errors()

SETTINGS = Settings.from_env()       # a bad REALIZAR_* value stops `bentoml serve` here, naming it
logging.getLogger("realizar_backend").setLevel(SETTINGS.log_level.upper())


def _own_metrics_dir() -> None:
    """Give this server its own Prometheus multiprocess directory. BentoML's default is one
    directory under BENTOML_HOME, which every `bentoml serve` empties at start: a second server
    on the host (one per GPU, as the docs advise) would wipe the first one's counters and then
    share its files. `bentoml serve` imports this module before it prepares that directory, so
    the path set here is the one its workers get; a worker's own value is never used."""
    from bentoml._internal.configuration.containers import BentoMLContainer

    path = lifecycle.server_dir(os.getpid())
    BentoMLContainer.prometheus_multiproc_dir.set(path)
    atexit.register(lifecycle.at_exit, path)


_own_metrics_dir()


def _tracing_config() -> dict:
    """BentoML's tracing settings for this service: without a tracing exporter, the OpenAI routes
    are left out of its OpenTelemetry middleware. The middleware opens a span for every `send`, so
    a stream pays one per token (a large share of the event loop's time with many streams),
    and without an exporter those spans go nowhere. With `tracing.exporter_type` or
    `tracing.excluded_urls` in BentoML's configuration, nothing is added. (A service's config is
    the default under the user's configuration, merged in when BentoML builds the app.)"""
    from bentoml._internal.configuration.containers import BentoMLContainer

    tracing = BentoMLContainer.tracing
    if tracing.exporter_type.get() is None and not tracing.excluded_urls.get():
        return {"excluded_urls": [r"/v1/"]}
    return {}


def _driver_gpus() -> int:
    """How many NVIDIA GPUs the driver reports, asked through NVML (a BentoML dependency) so that
    no process here starts CUDA (only the engine processes do, each on its own GPU). Through BentoML's own count
    where it has one: `bentoml serve` asks it anyway (to hand the GPUs to its worker) and keeps
    the answer, so its process starts NVML once, not twice."""
    try:
        from bentoml._internal.resource import NvidiaGpuResource
        return len(NvidiaGpuResource.from_system())
    except Exception:  # another BentoML, or NVML failed in a way it does not catch: ask NVML here
        pass
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver or no library: no GPU to ask for
        return 0


# ------------------------------------------------------------------------------ engines
# FRONT_ENDS front ends (this module's BentoML workers) and an engine core per GPU behind them.
# This module is read by `bentoml serve`'s own process (which gives the workers the GPUs
# RESOURCES asks for, all of them in one CUDA_VISIBLE_DEVICES), by `bentoml build` (the Bento
# records the same resources and workers), and by the workers. One front end starts one engine
# process per GPU, each seeing only its own (engine/group.py); with several, the serving process
# starts them before its workers (Realizar.start_engines) and every front end connects to each
# (engine/shared.py). NVML only where CUDA_VISIBLE_DEVICES does not already say (the CPU backend
# asks for none: no NVML start).
GPUS = visible_gpus(_driver_gpus) if SETTINGS.backend != "cpu" else []
timeline.mark("GPUs visible: %d", len(GPUS))
USE_GPU = SETTINGS.backend == "cuda" or (SETTINGS.backend == "auto" and bool(GPUS))
ENGINES = serve_engines(SETTINGS, GPUS, USE_GPU)       # too many for the GPUs stops the start here
RESOURCES = {"gpu": ENGINES} if USE_GPU else {}
FRONT_ENDS = serve_front_ends(SETTINGS, ENGINES, USE_GPU)   # BentoML's workers
SHARED = FRONT_ENDS > 1                                # engines the serving process starts (engine/shared.py)
WORKER = bentoml.server_context.worker_index or 1      # this front end's index, from 1
DEVICE = "cuda" if USE_GPU else "cpu"
# each engine's GPU (a CUDA_VISIBLE_DEVICES entry), or None for the CPU
ENGINE_DEVICES: list[str | None] = GPUS[:ENGINES] if USE_GPU and GPUS else [None] * ENGINES

# The container image (`bentoml build` + `bentoml containerize`): a CUDA runtime base (the kernels
# come prebuilt for common GPUs, and CuPy's NVRTC compiles any other at start-up: no toolkit, no C
# compiler), Python 3.11 in the venv BentoML's template makes with uv (the base has no Python, so
# pip comes first to install uv), this package installed from the Bento's own source with its
# `cuda12` extra, and the default model fetched at build time into the model cache that
# bentofile.yaml's REALIZAR_MODEL_CACHE names, so a container starts without network.
CUDA_BASE_IMAGE = "nvidia/cuda:12.8.1-runtime-ubuntu22.04"
# where BentoML's Dockerfile puts the Bento's src/ (its BENTO_PATH default); a PEP 508 direct
# reference because BentoML rewrites a bare `.[cuda12]` into `. [cuda12]`, which uv rejects
BENTO_SRC = "/home/bentoml/bento/src"
IMAGE = (
    # distro "ubuntu" (the base's own) is one BentoML has no install command for: for its known
    # distros it installs build-essential and git first, which this image does not need
    bentoml.images.Image(base_image=CUDA_BASE_IMAGE, distro="ubuntu", python_version="3.11",
                         lock_python_packages=False)   # builds offline; versions come from pyproject.toml
    .run("apt-get update && apt-get install -q -y --no-install-recommends python3-pip "
         "&& rm -rf /var/lib/apt/lists/*")
    .build_include("pyproject.toml", "README.md", "realizar_backend")
    .python_packages(f"realizar-backend[cuda12] @ file://{BENTO_SRC}")
    .run("realizar pull")
)

LOCAL_HOST = "127.0.0.1"
REFRESH_S = 2.0
BENTOML_TIMEOUT_MARGIN_S = 60.0
GUIDANCE_PREWARM_DELAY_S = 1.0
STATE = ServerState(settings=SETTINGS)


class _Routes:
    """The OpenAI routes as an ASGI app, made on first use. The worker makes them at import (below);
    `bentoml serve`'s own process and `bentoml build` read this module only to find the service
    and never serve, so they skip importing the routes and the engine, NumPy and llguidance
    behind them (the serving process starts the worker sooner)."""

    def __init__(self) -> None:
        self.app = None

    def build(self):
        if self.app is None:
            from realizar_backend.serving.app import create_app
            self.app = create_app(STATE)
        return self.app

    async def __call__(self, scope, receive, send) -> None:
        await (self.app or self.build())(scope, receive, send)


app = _Routes()
if bentoml.server_context.worker_index is not None:
    app.build()
timeline.mark("service module imported (%s)", "the worker" if bentoml.server_context.worker_index else
              "the serving process")


@bentoml.service(
    name="realizar",
    image=IMAGE,
    resources=RESOURCES,
    workers=FRONT_ENDS,
    # BentoML's own limit runs until a response starts; the routes end a request at
    # request_timeout_s with a 504 in the API's shape (serving/handlers.py), so this one is a backstop
    traffic={"timeout": SETTINGS.request_timeout_s + BENTOML_TIMEOUT_MARGIN_S},
    tracing=_tracing_config(),
    # this machine only, unless `--host` (or BENTOML_HOST) says otherwise: there is no API key
    # unless REALIZAR_API_KEY sets one. The container image sets BENTOML_HOST=0.0.0.0
    # (bentofile.yaml): inside a container, the published port is the boundary
    http={"host": LOCAL_HOST},
)
@bentoml.asgi_app(app, path="/")
class Realizar:
    def __init__(self) -> None:
        from realizar_backend.serving.metrics import get_metrics

        # created here, not at import: BentoML sets the multiprocess metrics dir before this runs
        STATE.metrics = get_metrics(worker=str(WORKER), device=DEVICE)
        STATE.metrics.set_worker_status("loading")
        STATE.started = time.time()
        timeline.mark("service created, loading the model")
        _drain_on_sigterm()
        _guard_connections()
        # load in the background so /livez answers at once and /readyz turns ready when done
        self._loader = threading.Thread(target=self._load, name="realizar-load", daemon=True)
        self._loader.start()

    @bentoml.on_deployment
    def start_engines() -> None:
        """In `bentoml serve`'s own process, before it starts the workers: with several front
        ends, the engine processes they share (engine/shared.py); they load while the workers
        start, and end with this process."""
        if SHARED:
            from realizar_backend.engine.shared import EngineHost

            host = EngineHost.start(SETTINGS, ENGINE_DEVICES)
            atexit.register(host.stop)

    def _load(self) -> None:
        from realizar_backend.engine.group import EngineGroup

        t0 = time.perf_counter()
        if WORKER == 1:
            log.info("loading %s on %d engine(s) (%s; backend=%s, context=%d, max_num_seqs=%d each) "
                     "behind %d front end(s)", SETTINGS.model or "the default model", ENGINES, _devices(),
                     SETTINGS.backend, SETTINGS.context_length, SETTINGS.max_num_seqs, FRONT_ENDS)
        shared = None
        if SHARED:
            from realizar_backend.engine.shared import run_dir
            shared = run_dir(os.getppid())
        try:
            # llguidance's vocabulary is built once the server is ready (below), not before
            engine = EngineGroup.start(SETTINGS, ENGINE_DEVICES, observer_of=STATE.metrics.engine,
                                       on_exit=self._engine_died, shared=shared, quiet=WORKER != 1)
        except Exception as e:
            _stop_the_server(e)
            return
        _set_engine_statuses(engine)
        STATE.engine = engine
        STATE.metrics.set_worker_status("ready")
        serving = sum(1 for _, status in engine.engine_statuses() if status == "ready")
        log.log(logging.INFO if WORKER == 1 else logging.DEBUG, "ready: serving %s on %d of %d engine(s) (%s) in %.1f s", engine.model_name, serving, ENGINES,
                 engine.stats().get("backend"), time.perf_counter() - t0)
        timeline.mark("server ready")
        _say_where()
        # llguidance holds the GIL for 0.2-3 s while it builds its vocabulary: done after ready (and
        # after the readiness probes have had a moment to see it), a constrained request before then
        # builds it itself
        engine.prewarm_guidance(delay_s=GUIDANCE_PREWARM_DELAY_S)
        # the engines update their gauges after each step; an idle engine takes no steps, so ask
        # for their reports now and then (decode tokens/s must fall to 0 when traffic stops)
        said_stuck, said = None, engine.engine_statuses()
        while STATE.engine is engine:
            time.sleep(REFRESH_S)
            if STATE.engine is engine:
                engine.stats()                       # each engine's report reaches its observer
                statuses = _set_engine_statuses(engine)
                for i, ((device, status), (_, before)) in enumerate(zip(statuses, said), 1):
                    if status != before and ENGINES > 1 and WORKER == 1:
                        log.warning("engine %d of %d (%s): %s, was %s", i, ENGINES, device, status, before)
                said = statuses
                stuck = engine.stall()
                if stuck and not said_stuck:
                    log.error("every engine is stuck (%s): /livez and /readyz answer 503 until one moves", stuck)
                elif said_stuck and not stuck:
                    log.warning("an engine moves again")
                said_stuck = stuck

    def _engine_died(self, error: Exception) -> None:
        """The last engine process died (a crash, the OOM killer): its requests have failed with a
        retryable 503. The server then stands aside (_stand_aside)."""
        engine, STATE.engine = STATE.engine, None
        if engine is not None:
            _set_engine_statuses(engine)
            _stand_aside(error)

    # async, so that the probes never wait for a worker thread (nor for an engine: stall() reads
    # the time of each engine's last heartbeat, engine/process.py)
    async def __is_ready__(self) -> bool:
        engine = STATE.engine
        return engine is not None and not STATE.draining and engine.stall() is None

    async def __is_alive__(self) -> bool:
        # with every engine stuck (no heartbeat, or a step that never ends, for
        # engine_stall_timeout_s) the server is dead until one moves again; so it is once no
        # engine is left
        engine = STATE.engine
        if engine is not None and engine.stall() is not None:
            return False
        return STATE.load_error is None or not _NO_ENGINE_CAN_SERVE.is_set()

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        engine, STATE.engine = STATE.engine, None
        if engine is not None:
            engine.shutdown()


# ------------------------------------------------------------------------------ a server without engines
_NO_ENGINE_CAN_SERVE = threading.Event()
_uvicorn = None               # this worker's uvicorn.Server and event loop (set by _drain_on_sigterm)
_loop: asyncio.AbstractEventLoop | None = None


def _set_engine_statuses(engine) -> list[tuple[str, str]]:
    """Each engine's status on /metrics, as this front end sees it; with several front ends, only
    those of the engines that report to this one (one that failed at load: worker 1's)."""
    statuses = engine.engine_statuses()
    mine = None
    if SHARED:
        mine = [r or (WORKER == 1 and status == "failed") for r, (_, status) in zip(engine.reports(), statuses)]
    STATE.metrics.set_engine_statuses(statuses, mine)
    return statuses


def _devices() -> str:
    return ", ".join(f"GPU {d}" for d in ENGINE_DEVICES if d is not None) or "cpu"


def _stand_aside(error: Exception) -> None:
    """Every engine process died after the server was ready. The server does not exit (BentoML
    would start it again, outside a container without end, each time loading and failing anew):
    it stays up without an engine, answers requests 503 with the error, /readyz says not ready
    and /livez dead, so that an orchestrator restarts it."""
    log.error("no engine can serve the model: %s: %s", type(error).__name__, error)
    STATE.metrics.set_worker_status("failed")
    STATE.load_error = f"{type(error).__name__}: {error}"
    _NO_ENGINE_CAN_SERVE.set()


# errors whose message says it all: no traceback for them when the server stops
_PLAIN_ERRORS = (RealizarError, OSError, MemoryError)


def _stop_the_server(error: Exception) -> None:
    """A server none of whose engines could load the model has nothing to serve: say why in one
    line and stop it with a non-zero status (the serving process's _at_exit). (Engines that fail
    while another loads stand aside: engine/group.py.) With several front ends each sees it, and
    worker 1 says it and stops the server (the others wait, unready, for the server's end)."""
    if WORKER == 1:
        log.error("cannot serve the model: %s: %s", type(error).__name__, error,
                  exc_info=None if isinstance(error, _PLAIN_ERRORS) else error)
    STATE.metrics.set_worker_status("failed")
    STATE.load_error = f"{type(error).__name__}: {error}"
    _NO_ENGINE_CAN_SERVE.set()
    if WORKER != 1:
        return
    try:
        lifecycle.fail_the_server(STATE.load_error)
    except OSError as e:           # not under `bentoml serve`'s arbiter: stay up, unready, as before
        log.error("could not stop the server (%s); it stays up without a model", e)


# ------------------------------------------------------------------------------ graceful shutdown
_FINAL_FLUSH_S = 5.0     # after the grace period: for the final chunks to reach their clients
_HANDOVER_S = 3          # then uvicorn's own graceful shutdown, bounded (slow uploads, idle sockets)
_WATCHDOG_S = 15.0       # the last resort past the grace period


def _drain_on_sigterm() -> None:
    """On SIGTERM: answer new requests 503 (Retry-After) while running ones finish, for up to
    Settings.shutdown_grace_s; then end what still runs with a final chunk (finish_reason
    "length", and [DONE] for streams) and hand over to uvicorn's own shutdown. uvicorn alone
    would stop accepting at once (new connections then hang in the listen queue BentoML's
    arbiter keeps open) and wait for every stream without a limit. Runs in the worker's main
    thread (the service is created there, on the event loop), after uvicorn set its handlers."""
    global _uvicorn, _loop
    loop = asyncio.get_running_loop()
    uvicorn_handler = signal.getsignal(signal.SIGTERM)
    _uvicorn, _loop = getattr(uvicorn_handler, "__self__", None), loop

    def on_sigterm(signum, frame) -> None:
        if not STATE.draining:
            STATE.draining = True
            loop.call_soon_threadsafe(lambda: loop.create_task(_drain(uvicorn_handler)))

    signal.signal(signal.SIGTERM, on_sigterm)


def _say_where() -> None:
    """Say where the server listens, as it is (BentoML's own line calls every interface
    "localhost"), and warn when every interface can reach a server with no API key."""
    try:
        host, port = next(sock.getsockname()[:2] for server in (getattr(_uvicorn, "servers", None) or [])
                          for sock in server.sockets)
    except (StopIteration, OSError, AttributeError):
        return
    if host in ("0.0.0.0", "::"):
        log.log(logging.INFO if SETTINGS.api_key else logging.WARNING,
                "listening on every interface (%s port %d)%s", host, port,
                "" if SETTINGS.api_key else " with no API key: anyone who reaches this machine can use it "
                                            "(REALIZAR_API_KEY sets one)")
    else:
        log.info("listening on %s port %d", host, port)


def _guard_connections() -> None:
    """This worker's uvicorn makes its connections with serving/connections.py's limits (header
    and body timeouts, header size, a connection limit). Its server object is found through the
    SIGTERM handler it installed (_drain_on_sigterm), before it listens. Without httptools (a
    dependency; an install that lost it) the server serves on uvicorn's own parser, and says so:
    a worker that failed here would be started again by BentoML without end."""
    try:
        from realizar_backend.serving import connections
    except ImportError as e:
        log.error("HTTP connections have no read timeouts or limits: %s (pip install httptools)", e)
        return
    if _uvicorn is None or not hasattr(_uvicorn, "config"):
        log.warning("not under uvicorn: HTTP connections have no read timeouts or limits here")
        return
    connections.install(_uvicorn, SETTINGS, on_refused=STATE.metrics.on_http_error)


async def _drain(uvicorn_handler) -> None:
    loop = asyncio.get_running_loop()
    grace = SETTINGS.shutdown_grace_s
    log.info("SIGTERM: refusing new requests; %d in flight may run for up to %g s", STATE.active, grace)
    watchdog = threading.Timer(grace + _WATCHDOG_S, _force_exit)
    watchdog.daemon = True
    watchdog.start()
    deadline = loop.time() + grace
    while STATE.active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if STATE.active:
        log.info("grace period over: ending %d requests with a final chunk", STATE.active)
        if STATE.engine is not None:
            STATE.engine.finish_all("shutdown")
        deadline = loop.time() + _FINAL_FLUSH_S
        while STATE.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
    server = getattr(uvicorn_handler, "__self__", None)
    if server is not None and hasattr(server, "config"):
        server.config.timeout_graceful_shutdown = _HANDOVER_S
    if callable(uvicorn_handler):
        uvicorn_handler(signal.SIGTERM, None)
    else:                                # not under uvicorn: the default action ends the process
        signal.signal(signal.SIGTERM, uvicorn_handler or signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def _force_exit() -> None:
    log.error("still running %g s after the grace period; exiting now", _WATCHDOG_S)
    logging.shutdown()
    os._exit(1)
