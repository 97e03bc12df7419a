"""One Settings object. Nothing else in the package reads the environment: every knob is a
field here, filled from `REALIZAR_<FIELD>` environment variables or set by the caller."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable

from .errors import SettingsError


def _parse(kind: Any, raw: str):
    if kind in (bool, "bool"):
        v = raw.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off", ""):
            return False
        raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")
    if kind in (int, "int"):
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError("not an integer") from None
    if kind in (float, "float"):
        try:
            return float(raw.strip())
        except ValueError:
            raise ValueError("not a number") from None
    if kind in ("str | None", "Optional[str]"):
        return raw or None
    return raw


# REALIZAR_* variables that are not settings: the test suite's and the GPU tools' own (tests/,
# tools/device_check.sh). Any other unknown REALIZAR_* name stops the start, so that a misspelt
# setting is never ignored silently
NOT_SETTINGS_PREFIXES = ("REALIZAR_TEST_",)
NOT_SETTINGS = frozenset({"REALIZAR_TWINS", "REALIZAR_REAL_SMOL", "REALIZAR_MOE_MODELS", "REALIZAR_GPTOSS_MODELS",
                          "REALIZAR_HYBRID_MODELS"})

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "str | None": (str, type(None))}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class Settings:
    # model: a path to a .gguf file or a safetensors directory; None = the default model
    # (SmolLM2-135M-Instruct, fetched into model_cache on first use: model/default.py)
    model: str | None = None
    # name reported by /v1/models; default derived from the model file
    model_name: str | None = None
    # where the default model (SmolLM2-135M-Instruct) is fetched to on first use (`realizar pull`);
    # "~" is the user's home
    model_cache: str = "~/.cache/realizar-backend/models"
    backend: str = "auto"              # auto | cuda | cpu
    # CUDA device ordinal, for the CLI; under `bentoml serve` each worker takes its own (workers)
    device: int = 0
    context_length: int = 0            # per-sequence context; 0 = the model's own (and never more)
    max_num_seqs: int = 256            # sequences running at once (decode batch up to this; a hybrid's
                                       # GPU backend runs fewer where their recurrent state would not fit)
    # KV cache: one pool of blocks of block_size positions, shared by every sequence. On the GPU the
    # pool takes what gpu_memory_utilization of the device's memory leaves after the weights and
    # the workspace; kv_cache_tokens (> 0) caps it, in tokens (on the CPU it sets the pool)
    kv_cache_tokens: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    # prompts are prefilled in chunks of at most this many tokens per step, between the decode
    # steps of the running sequences (a long prompt never freezes the others' streams for more
    # than a chunk); a burst of short prompts shares steps (16 prompts of 128 tokens a step: fewer,
    # larger steps serve such a burst sooner than more, smaller ones)
    prefill_chunk_tokens: int = 2048
    # full KV blocks are kept keyed by their tokens (and all before them), so a request that
    # shares a prefix with an earlier one reuses them instead of prefilling it again
    enable_prefix_caching: bool = True
    max_waiting: int = 256             # queued requests beyond which the server answers 503
    api_key: str | None = None         # when set, requests must carry `Authorization: Bearer <key>`
    # request limits: a body larger than this is refused with 413 before it is read; each stop
    # string is at most max_stop_chars characters (the engine searches every one per token)
    max_request_bytes: int = 4 << 20
    max_stop_chars: int = 256
    # the Responses API's previous_response_id: the last this many stored responses (with their
    # conversations) are kept in memory by the front end, least recently used out first; 0: none
    # are kept, every request stands alone
    responses_store_size: int = 256
    # a /v1 request whose response has not started this many seconds after it arrived (the whole
    # of a non-streamed generation) is ended: its sequences are cancelled and it gets a 504
    request_timeout_s: float = 900.0
    # the most tokens one request may ask of the engine: its prompt tokens times its choices, and
    # its max_tokens (when given) times its choices, each at most this (0: the KV cache's size,
    # what the engine holds at once): a request past it would hold the engine from everyone else
    max_request_tokens: int = 0
    # a request's grammar (structured output, tools) is tried first in a worker process
    # (grammar_workers of them, each with llguidance's view of the vocabulary: ~100-250 MB) and
    # given up after this many seconds of compiling: a 400, and the worker is replaced
    grammar_timeout_s: float = 10.0
    grammar_workers: int = 1
    # chat templates come with the model file and may do anything Jinja can: each render runs in
    # a separate process (chat_template_workers of them) and is stopped after this many seconds,
    # this many characters of output or this much address space
    chat_template_timeout_s: float = 5.0
    chat_template_max_chars: int = 8 << 20
    chat_template_memory_mb: int = 1024
    chat_template_workers: int = 2
    # on SIGTERM: refuse new requests (503), let running ones finish for this long, then end
    # them with a final chunk and exit
    shutdown_grace_s: float = 20.0
    cuda_graphs: bool = True
    # a file the engine appends one JSON line per step to (when it started, its kind, prompt tokens
    # and sequences, decode rows, wall ms, the idle ms before it, waiting and running after it):
    # where a server's time goes, step by step. None: no trace
    step_trace: str | None = None
    # the CUDA backend's prompt steps (and decode steps of 64+ rows) multiply the dequantized weights
    # on the tensor cores; it keeps them on the device from start-up (gemm_precision says how many
    # bytes a weight) instead of dequantizing them in every such step: "on", "off", or "auto" (on
    # when they take at most half the device memory free at start; the KV pool keeps the other half)
    prefill_weight_cache: str = "auto"
    # the arithmetic of those GEMMs: "fp16": the dequantized weights (kept at 2 bytes each) and the
    # activations rounded to fp16 once, products summed in fp32, as llama.cpp's and vLLM's fp16 GEMMs;
    # "split": each a pair of fp16 halves, about fp32's accuracy for three times a long prompt's
    # tensor-core work and twice the weight bytes (kept at 4 bytes each)
    gemm_precision: str = "fp16"
    self_check: bool = True            # run kernel self-check at CUDA start-up
    # load the kernel modules shipped compiled for this GPU (kernels/cubin, tools/build_kernels.py)
    # where they match the sources; off: compile every module with NVRTC at start-up
    prebuilt_kernels: bool = True
    log_level: str = "INFO"
    # `bentoml serve` runs this many engine cores (each a process with its own copy of the model,
    # KV cache and step loop) behind its one front end, which sends each request to the least busy
    # (engine/group.py). With a GPU, one per GPU (engine i on the i-th visible one) and 0 = every
    # visible GPU; on the CPU 0 = 1
    workers: int = 0
    # `bentoml serve`'s front ends: BentoML workers sharing the port, each tokenizing, checking
    # grammars and streaming its own requests, each able to send them to every engine core
    # (engine/shared.py). 0 = one per engine core with a GPU, one on the CPU: a front end's event loop
    # streams every token of its requests, and two GPUs' streams of a small model behind one front
    # end already wait for it (their time to first token grows); CPU engines are far slower. One
    # front end keeps the engines its own children (engine/group.py); more than one share engines
    # that `bentoml serve`'s own process starts
    front_ends: int = 0
    # a worker whose engine process answers no heartbeat, or has requests and completes no step,
    # for this long is stuck: /livez and /readyz turn 503 until it moves again. Above the longest
    # step the engine may take (a prefill chunk of a large model on the CPU)
    engine_stall_timeout_s: float = 60.0
    # HTTP connections (serving/connections.py): a client must send a request's headers within
    # read_timeout_s of connecting (or of its previous response), and its body within as long
    # again, else 408 and the connection closes; headers larger than max_header_bytes get 431;
    # past max_connections open connections a new one closes the one that has waited longest
    # for its request (or gets 503 when every connection is a request being served). 0: the
    # process's open-file limit less serving/connections.py's FD_RESERVE
    read_timeout_s: float = 30.0
    max_header_bytes: int = 64 << 10
    max_connections: int = 0
    # BLAS threads of the CPU backend's process (NumPy's matrix multiplies); 0: one per core this
    # process may run on less one, which the server's own work keeps (BLAS threads beyond the free
    # cores spin while they wait and slow every step: backends/__init__.py's cpu_threads)
    cpu_threads: int = 0

    ENV_PREFIX = "REALIZAR_"

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def env_name(cls, field_name: str) -> str:
        return cls.ENV_PREFIX + field_name.upper()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if environ is None else environ
        cls._refuse_unknown(env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = cls.env_name(f.name)
            if key in env:
                try:
                    values[f.name] = _parse(f.type, env[key])
                except ValueError as e:
                    raise SettingsError(f"{key}={env[key]!r}: {e}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def _refuse_unknown(cls, env) -> None:
        """A REALIZAR_* variable that names no setting is a typo until shown otherwise: stop with
        the nearest setting's name, as the API answers an unknown field."""
        known = [cls.env_name(f.name) for f in fields(cls)]
        for key in sorted(env):
            if (not key.startswith(cls.ENV_PREFIX) or key in known or key in NOT_SETTINGS
                    or key.startswith(NOT_SETTINGS_PREFIXES)):
                continue
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else " (docs/serving.md lists them)"
            raise SettingsError(f"{key}: no such setting{hint}")

    def _bad(self, name: str, why: str) -> SettingsError:
        shown = "<hidden>" if name == "api_key" else repr(getattr(self, name))
        return SettingsError(f"{self.env_name(name)}={shown}: {why}")

    def validate(self) -> None:
        """Every field: its type, then its range. The message names the environment variable,
        so a bad deployment stops at start with the line to fix."""
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, _TYPES[f.type]) or (f.type in ("int", "float") and isinstance(v, bool)):
                raise self._bad(f.name, f"expected {f.type}")
            if f.type == "float" and not math.isfinite(v):
                raise self._bad(f.name, "must be a finite number")

        def at_least(name: str, lo: float, hi: float | None = None) -> None:
            v = getattr(self, name)
            if v < lo or (hi is not None and v > hi):
                raise self._bad(name, f"must be at least {lo}" if hi is None else f"must be between {lo} and {hi}")

        def one_of(name: str, *allowed: str) -> None:
            if getattr(self, name) not in allowed:
                raise self._bad(name, f"must be one of {', '.join(allowed)}")

        for name in ("model", "model_name", "api_key", "model_cache", "step_trace"):
            v = getattr(self, name)
            if v is not None and (not v.strip() or v != v.strip()):
                raise self._bad(name, "must not be empty or start or end with white space")
        if self.step_trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.step_trace))):
            raise self._bad("step_trace", "names a file in a directory that does not exist")
        one_of("backend", "auto", "cuda", "cpu")
        at_least("device", 0)
        at_least("context_length", 0, 1 << 24)           # 0: the model's own
        at_least("max_num_seqs", 1, 1 << 16)
        at_least("block_size", 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise self._bad("block_size", "must be a power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise self._bad("gpu_memory_utilization", "must be in (0, 1]")
        at_least("kv_cache_tokens", 0)
        if 0 < self.kv_cache_tokens < self.block_size:
            raise self._bad("kv_cache_tokens", f"is less than one block ({self.block_size} tokens)")
        at_least("prefill_chunk_tokens", 1)
        at_least("max_waiting", 1)
        at_least("max_request_bytes", 1024, 1 << 30)
        at_least("max_stop_chars", 1, 1 << 16)
        at_least("responses_store_size", 0, 1 << 20)
        if not 0 < self.request_timeout_s <= 86400:
            raise self._bad("request_timeout_s", "must be greater than 0 and at most 86400 (a day)")
        at_least("max_request_tokens", 0)
        if self.grammar_timeout_s <= 0:
            raise self._bad("grammar_timeout_s", "must be greater than 0")
        at_least("grammar_workers", 1, 64)
        if self.chat_template_timeout_s <= 0:
            raise self._bad("chat_template_timeout_s", "must be greater than 0")
        at_least("chat_template_max_chars", 1024)
        at_least("chat_template_memory_mb", 256)
        at_least("chat_template_workers", 1, 64)
        at_least("shutdown_grace_s", 0)
        one_of("prefill_weight_cache", "auto", "on", "off")
        one_of("gemm_precision", "fp16", "split")
        at_least("workers", 0, 256)
        at_least("front_ends", 0, 64)
        for name in ("engine_stall_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise self._bad(name, "must be greater than 0")
        at_least("max_header_bytes", 1024, 1 << 24)
        at_least("max_connections", 0, 1 << 20)
        at_least("cpu_threads", 0, 1024)
        if self.log_level.upper() not in _LOG_LEVELS:
            raise self._bad("log_level", f"must be one of {', '.join(_LOG_LEVELS)}")

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------ GPUs of `bentoml serve`
# The one place CUDA_VISIBLE_DEVICES is read and set. BentoML gives the service's worker every GPU
# its resources ask for, in one CUDA_VISIBLE_DEVICES; each engine process it starts sees one of
# them (gpu_environ) and uses device 0.

def visible_gpus(driver_gpus: int | Callable[[], int], environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: that variable's, up to
    the first entry CUDA would reject (a negative index hides the rest), when it is set; else
    each of the `driver_gpus` GPUs the driver reports, by index (a callable: asked only then)."""
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(driver_gpus() if callable(driver_gpus) else driver_gpus)]
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry or entry.lstrip("-").isdigit() and int(entry) < 0:
            break
        out.append(entry)
    return out


def gpu_environ(gpu: str) -> dict[str, str]:
    """This process's environment for a child that sees only `gpu` (a CUDA_VISIBLE_DEVICES entry)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}


def serve_engines(settings: Settings, gpus: list[str], use_gpu: bool) -> int:
    """How many engine cores `bentoml serve` runs: one per GPU with a GPU (settings.workers of them,
    or every visible one), settings.workers (at least 1) on the CPU. Asking for more GPUs than are
    visible stops the start; none visible (a build machine) leaves the count to the setting."""
    if not use_gpu:
        return settings.workers or 1
    if settings.device:
        raise settings._bad("device", "under `bentoml serve` engine i takes the i-th visible GPU; "
                                      "choose the GPUs with CUDA_VISIBLE_DEVICES")
    n = settings.workers or max(1, len(gpus))
    if gpus and n > len(gpus):
        raise settings._bad("workers", f"one GPU per engine, and {len(gpus)} are visible "
                                       f"(CUDA_VISIBLE_DEVICES entries {','.join(gpus)})")
    return n


def serve_front_ends(settings: Settings, engines: int, gpu: bool) -> int:
    """How many front ends (BentoML workers) `bentoml serve` runs in front of `engines` engine
    cores: settings.front_ends, or one per engine on GPUs and one on the CPU."""
    return settings.front_ends or (engines if gpu else 1)
