"""The BentoML service: one Engine per worker process, behind OpenAI-compatible routes.

    bentoml serve                      # from the repo root: the default SmolLM2-135M, best backend here
    REALIZAR_MODEL=/models/x.gguf REALIZAR_BACKEND=cuda bentoml serve --port 3000
    realizar serve /models/x.gguf      # the same from anywhere the package is installed

The class lives in the package (not in the repo's service.py, which re-exports it) so that an
installed package can serve without a checkout.

Configuration is Settings.from_env() (REALIZAR_* variables; see realizar_backend/settings.py).
The OpenAI routes are a Starlette app mounted with `bentoml.asgi_app`, so their paths, status
codes and SSE framing are exactly OpenAI's; BentoML itself serves /livez, /readyz and /metrics
(ours included: see realizar_backend/serving/metrics.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import signal
import tempfile
import threading
import time

import bentoml

from realizar_backend.serving.openai import ServerState, create_app
from realizar_backend.settings import Settings

log = logging.getLogger("realizar_backend.service")

SETTINGS = Settings.from_env()       # a bad REALIZAR_* value stops `bentoml serve` here, naming it
logging.getLogger("realizar_backend").setLevel(SETTINGS.log_level.upper())


def _own_metrics_dir() -> None:
    """Give this server its own Prometheus multiprocess directory. BentoML's default is one
    directory under BENTOML_HOME, which every `bentoml serve` empties at start: a second server
    on the host (one per GPU, as the docs advise) would wipe the first one's counters and then
    share its files. `bentoml serve` imports this module before it prepares that directory, so
    the path set here is the one its workers get; a worker's own value is never used."""
    from bentoml._internal.configuration.containers import BentoMLContainer

    path = os.path.join(tempfile.gettempdir(), f"realizar-metrics-{os.getpid()}")
    BentoMLContainer.prometheus_multiproc_dir.set(path)
    atexit.register(shutil.rmtree, path, True)


_own_metrics_dir()


def _gpu_present() -> bool:
    """Whether this host has an NVIDIA GPU, asked through NVML (a BentoML dependency) so that the
    process that reads the service definition does not initialise CUDA."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver or no library: no GPU to ask for
        return False


def _wants_gpu(settings: Settings) -> bool:
    if settings.backend == "cpu":
        return False
    return settings.backend == "cuda" or _gpu_present()


# BentoML assigns the GPU (CUDA_VISIBLE_DEVICES) to the worker from these resources; asking for
# one on a host without any would only produce warnings, so the request depends on the host.
RESOURCES = {"gpu": 1} if _wants_gpu(SETTINGS) else {}

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

REFRESH_S = 2.0
STATE = ServerState(settings=SETTINGS)
app = create_app(STATE)


@bentoml.service(
    name="realizar",
    image=IMAGE,
    resources=RESOURCES,
    workers=1,
    # the timeout runs until a response starts; a long non-streaming CPU generation needs minutes
    traffic={"timeout": 900},
)
@bentoml.asgi_app(app, path="/")
class Realizar:
    def __init__(self) -> None:
        from realizar_backend.serving.metrics import get_metrics

        # created here, not at import: BentoML sets the multiprocess metrics dir before this runs
        STATE.metrics = get_metrics()
        STATE.started = time.time()
        _drain_on_sigterm()
        # load in the background so /livez answers at once and /readyz turns ready when done
        self._loader = threading.Thread(target=self._load, name="realizar-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        from realizar_backend.engine.engine import Engine

        t0 = time.perf_counter()
        log.info("loading %s (backend=%s, context=%d, max_num_seqs=%d)",
                 SETTINGS.model or "the default model", SETTINGS.backend,
                 SETTINGS.context_length, SETTINGS.max_num_seqs)
        try:
            engine = Engine.from_settings(SETTINGS, observer=STATE.metrics)
        except Exception as e:  # reported by /livez (dead) and by every request (503)
            STATE.load_error = f"{type(e).__name__}: {e}"
            log.exception("model load failed")
            return
        STATE.metrics.on_step(engine.stats())       # gauges exist before the first step
        STATE.engine = engine
        log.info("ready: serving %s on %s in %.1f s", engine.model_name, engine.stats().get("backend"),
                 time.perf_counter() - t0)
        # the engine updates the gauges after each step; an idle engine takes no steps, so refresh
        # them now and then (decode tokens/s must fall to 0 when traffic stops)
        while STATE.engine is engine:
            time.sleep(REFRESH_S)
            if STATE.engine is engine:
                STATE.metrics.on_step(engine.stats())

    # async, so that the probes never wait for a worker thread
    async def __is_ready__(self) -> bool:
        return STATE.engine is not None and not STATE.draining

    async def __is_alive__(self) -> bool:
        return STATE.load_error is None

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        engine, STATE.engine = STATE.engine, None
        if engine is not None:
            engine.shutdown()


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
    loop = asyncio.get_running_loop()
    uvicorn_handler = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        if not STATE.draining:
            STATE.draining = True
            loop.call_soon_threadsafe(lambda: loop.create_task(_drain(uvicorn_handler)))

    signal.signal(signal.SIGTERM, on_sigterm)


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
