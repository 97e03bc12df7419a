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

import logging
import threading
import time

import bentoml

from realizar_backend.serving.openai import ServerState, create_app
from realizar_backend.settings import Settings

log = logging.getLogger("realizar_backend.service")

SETTINGS = Settings.from_env()
logging.getLogger("realizar_backend").setLevel(SETTINGS.log_level.upper())


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

    def __is_ready__(self) -> bool:
        return STATE.engine is not None

    def __is_alive__(self) -> bool:
        return STATE.load_error is None

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        engine, STATE.engine = STATE.engine, None
        if engine is not None:
            engine.shutdown()
