"""One Settings object. Nothing else in the package reads the environment: every knob is a
field here, filled from `REALIZAR_<FIELD>` environment variables or set by the caller."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any


def _parse(kind: Any, raw: str):
    if kind in (bool, "bool"):
        v = raw.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if kind in (int, "int"):
        return int(raw)
    if kind in (float, "float"):
        return float(raw)
    if kind in ("str | None", "Optional[str]"):
        return raw or None
    return raw


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
    device: int = 0                    # CUDA device ordinal
    context_length: int = 0            # per-sequence context; 0 = the model's own (and never more)
    max_num_seqs: int = 256            # sequences running at once (decode batch up to this)
    # KV cache: one pool of blocks of block_size positions, shared by every sequence. On the GPU the
    # pool takes what gpu_memory_utilization of the device's memory leaves after the weights and
    # the workspace; kv_cache_tokens (> 0) caps it, in tokens. On the CPU it sets the pool (0: what
    # fits in 1 GiB, at least one full context, at most max_num_seqs full contexts)
    kv_cache_tokens: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    # prompts are prefilled in chunks of at most this many tokens per step, between the decode
    # steps of the running sequences (a long prompt never freezes the others' streams)
    prefill_chunk_tokens: int = 512
    # full KV blocks are kept keyed by their tokens (and all before them), so a request that
    # shares a prefix with an earlier one reuses them instead of prefilling it again
    enable_prefix_caching: bool = True
    max_waiting: int = 256             # queued requests beyond which the server answers 503
    api_key: str | None = None         # when set, requests must carry `Authorization: Bearer <key>`
    cuda_graphs: bool = True
    # decode graphs link their kernels by programmatic dependent launch (compute capability 9.0+):
    # each kernel starts, and prefetches its weights, while the one before finishes
    programmatic_launch: bool = True
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
    # attention kernels of the CUDA path: "flash" (tensor cores: tiled flash attention for prompts,
    # flash-decoding split over the sequence for long decode rows) or "classic" (CUDA cores: one
    # block per row and head for decode, 16-row tiles for prompts)
    attention: str = "flash"
    self_check: bool = True            # run kernel self-check at CUDA start-up
    # load the kernel modules shipped compiled for this GPU (kernels/cubin, tools/build_kernels.py)
    # where they match the sources; off: compile every module with NVRTC at start-up
    prebuilt_kernels: bool = True
    log_level: str = "INFO"

    ENV_PREFIX = "REALIZAR_"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = cls.ENV_PREFIX + f.name.upper()
            if key in env:
                try:
                    values[f.name] = _parse(f.type, env[key])
                except ValueError as e:
                    raise ValueError(f"{key}: {e}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        s = cls(**values)
        s.validate()
        return s

    def validate(self) -> None:
        if self.backend not in ("auto", "cuda", "cpu"):
            raise ValueError(f"backend must be auto, cuda or cpu, not {self.backend!r}")
        if self.context_length < 0:
            raise ValueError("context_length must be >= 0 (0: the model's own)")
        for name in ("max_num_seqs", "block_size", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.decode_activations not in ("int8", "int8-fp32-down", "fp32"):
            raise ValueError("decode_activations must be int8, int8-fp32-down or fp32, "
                             f"not {self.decode_activations!r}")
        if self.prefill_precision not in ("split16", "fp32", "fp16"):
            raise ValueError(f"prefill_precision must be split16, fp32 or fp16, not {self.prefill_precision!r}")
        if self.attention not in ("flash", "classic"):
            raise ValueError(f"attention must be flash or classic, not {self.attention!r}")
        if self.prefill_weight_cache not in ("auto", "on", "off"):
            raise ValueError(f"prefill_weight_cache must be auto, on or off, not {self.prefill_weight_cache!r}")
        if not self.model_cache:
            raise ValueError("model_cache must name a directory")
        if self.kv_cache_tokens < 0:
            raise ValueError("kv_cache_tokens must be >= 0")
        if 0 < self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) is less than one block "
                             f"({self.block_size} tokens)")

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)
