"""One Settings object. Nothing else in the package reads the environment: every knob is a
field here, filled from `REALIZAR_<FIELD>` environment variables or set by the caller."""

from __future__ import annotations

import dataclasses
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
    max_num_seqs: int = 256            # sequences running at once (decode batch up to this)
    # KV cache: one pool of blocks of block_size positions, shared by every sequence. On the GPU the
    # pool takes what gpu_memory_utilization of the device's memory leaves after the weights and
    # the workspace; kv_cache_tokens (> 0) caps it, in tokens (on the CPU it sets the pool)
    kv_cache_tokens: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    # prompts are prefilled in chunks of at most this many tokens per step, between the decode
    # steps of the running sequences (a long prompt never freezes the others' streams for more
    # than a chunk: ~50 ms for qwen15 on the H100); a burst of short prompts shares one step (64
    # clients' 128-token prompts, H100: 6,517 and 6,743 tok/s served with 2048, 6,132 with 512)
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
    # decode graphs link their kernels by programmatic dependent launch (compute capability 9.0+):
    # each kernel starts, and prefetches its weights, while the one before finishes
    programmatic_launch: bool = True
    # decode step n+1 is started on the device's own tokens before the host reads step n's
    # (greedy and sampled); off: every step waits for the host (the unpipelined reference)
    pipelined_decode: bool = True
    # a file the engine appends one JSON line per step to (when it started, its kind, prompt tokens
    # and sequences, decode rows, wall ms, the idle ms before it, waiting and running after it):
    # where a server's time goes, step by step. None: no trace
    step_trace: str | None = None
    # constrained decoding: the vocabulary in this many parts, so that a row's token mask is
    # computed on as many threads while rows x parts fit the cores (small batches, where a slow
    # mask would hold up the step); 0 or 1: one thread a row
    guidance_mask_parts: int = 4
    # numeric trade-offs of the CUDA path (speed vs closeness to the float32 reference; the
    # defaults are the ones that pass the parity bar of the test suite, see README):
    # decode projections on float32 activations ("fp32"), on 8-bit activation blocks ("int8"),
    # or on 8-bit blocks except the FFN down projection ("int8-fp32-down")
    decode_activations: str = "fp32"
    # prefill GEMMs: "split16" (fp16 tensor cores on hi + lo fp16 pairs of weights and activations:
    # three fp16 products per weight, about fp32 accuracy), "fp32" (plain SGEMM, no tensor cores) or
    # "fp16" (one fp16 product per weight: fastest, but prompt logits drift on sensitive models; the
    # down projection's input row-scaled by powers of two, as fp16 cannot hold its range)
    prefill_precision: str = "split16"
    # split16 prefill keeps every layer's weights dequantized and split (4 bytes per weight) instead
    # of redoing that in each prefill (qwen15 pp512: 2.5 of 19.8 ms): "on", "off", or "auto" (on
    # when the copy takes at most a quarter of the device memory free at start)
    prefill_weight_cache: str = "auto"
    # decode steps of many rows (buckets of 8+, or 4+ when mmqs.cu has every matrix's type): the
    # tensor-core matrix multiplies on the quantized blocks ("mmq": kernels/mmqs.cu, and mmq.cu's
    # tiles for the LM head past 16 rows), or from 16 rows the split16 GEMMs on the prefill's kept
    # split weights ("split16": 4 bytes a weight per step, read at GEMM speed, a cost that hardly
    # grows with the rows; needs the kept weights, prefill_weight_cache), or "auto": mmq below 64
    # rows, split16 from 64 where the weights are kept (qwen15 twin, H100, tok/s: 64 rows 11.5k ->
    # 13.5k, 128 rows 14.5k -> 22.3k, 256 rows 15.6k -> 29.1k; at 32 mmq stays ahead)
    batched_decode: str = "auto"
    # prompt steps of up to this many tokens (the tail after a cached prefix, short prompts, a burst
    # of them) run on those tensor-core projections too, padded to a token bucket (8, then
    # multiples of 16) and replayed from one CUDA graph per bucket; longer steps take the prefill
    # GEMMs, launched eagerly (~560 launches: 8-16 ms of host time for qwen15). 0: GEMVs
    # below 12 tokens and GEMMs from there, as before. A multiple of 8, at most 256
    prompt_mmq_tokens: int = 64
    # attention kernels of the CUDA path: "flash" (tensor cores: tiled flash attention for prompts,
    # flash-decoding split over the sequence for long decode rows) or "classic" (CUDA cores: one
    # block per row and head for decode, 16-row tiles for prompts)
    attention: str = "flash"
    self_check: bool = True            # run kernel self-check at CUDA start-up
    # load the kernel modules shipped compiled for this GPU (kernels/cubin, tools/build_kernels.py)
    # where they match the sources; off: compile every module with NVRTC at start-up
    prebuilt_kernels: bool = True
    log_level: str = "INFO"
    # `bentoml serve` runs this many worker processes, each with its own engine and copy of the
    # model; requests spread over them. With a GPU, one worker per GPU (worker i on the i-th
    # visible one) and 0 = every visible GPU; on the CPU 0 = 1
    workers: int = 0
    # `bentoml serve` runs each worker's engine (the backend and the step loop) in a process of its
    # own, so that the server's HTTP and streaming work never holds up a step's launches (the GIL);
    # off: the engine runs on a thread of the worker process
    engine_process: bool = True

    ENV_PREFIX = "REALIZAR_"

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def env_name(cls, field_name: str) -> str:
        return cls.ENV_PREFIX + field_name.upper()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if environ is None else environ
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
        at_least("guidance_mask_parts", 0, 64)
        if 0 < self.kv_cache_tokens < self.block_size:
            raise self._bad("kv_cache_tokens", f"is less than one block ({self.block_size} tokens)")
        at_least("prefill_chunk_tokens", 1)
        at_least("max_waiting", 1)
        at_least("max_request_bytes", 1024, 1 << 30)
        at_least("max_stop_chars", 1, 1 << 16)
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
        one_of("decode_activations", "int8", "int8-fp32-down", "fp32")
        one_of("prefill_precision", "split16", "fp32", "fp16")
        one_of("attention", "flash", "classic")
        one_of("batched_decode", "auto", "mmq", "split16")
        at_least("prompt_mmq_tokens", 0, 256)
        if self.prompt_mmq_tokens % 8:
            raise self._bad("prompt_mmq_tokens", "must be a multiple of 8")
        one_of("prefill_weight_cache", "auto", "on", "off")
        at_least("workers", 0, 256)
        if self.log_level.upper() not in _LOG_LEVELS:
            raise self._bad("log_level", f"must be one of {', '.join(_LOG_LEVELS)}")

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------ GPUs of `bentoml serve`
# The one place CUDA_VISIBLE_DEVICES is read and set. BentoML gives every worker of a service the
# same CUDA_VISIBLE_DEVICES (all the GPUs its resources ask for), so each worker narrows it to its
# own GPU before anything starts CUDA in the process, and then uses device 0.

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


def serve_workers(settings: Settings, gpus: list[str], use_gpu: bool) -> int:
    """How many workers `bentoml serve` starts: one per GPU with a GPU (settings.workers of them,
    or every visible one), settings.workers (at least 1) on the CPU. Asking for more GPUs than
    are visible stops the start; none visible (a build machine) leaves the count to the setting."""
    if not use_gpu:
        return settings.workers or 1
    if settings.device:
        raise settings._bad("device", "under `bentoml serve` worker i takes the i-th visible GPU; "
                                      "choose the GPUs with CUDA_VISIBLE_DEVICES")
    n = settings.workers or max(1, len(gpus))
    if gpus and n > len(gpus):
        raise settings._bad("workers", f"one GPU per worker, and {len(gpus)} are visible "
                                       f"(CUDA_VISIBLE_DEVICES entries {','.join(gpus)})")
    return n


def worker_gpu(worker: int, gpus: list[str]) -> str:
    """The GPU of BentoML worker `worker` (numbered from 1): the worker-th of the visible ones."""
    if not 1 <= worker <= len(gpus):
        shown = ",".join(gpus) or "none"
        raise SettingsError(f"worker {worker} has no GPU of its own: the visible GPUs are {shown}")
    return gpus[worker - 1]


def bind_worker_gpu(settings: Settings, worker: int, gpus: list[str],
                    environ: dict[str, str] | None = None) -> tuple[Settings, str]:
    """Make worker_gpu(worker, gpus) the only GPU this process sees (CUDA_VISIBLE_DEVICES) and
    return the settings that use it (device 0) with its entry. Call before CUDA starts."""
    gpu = worker_gpu(worker, gpus)
    (os.environ if environ is None else environ)["CUDA_VISIBLE_DEVICES"] = gpu
    return settings.replace(device=0), gpu
