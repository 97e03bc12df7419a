"""ModelFile: what every format loader returns (config, metadata, named tensors)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import ModelFormatError
from ..model.config import ModelConfig


@dataclass
class Tensor:
    """One weight. `shape` is numpy order (rows, cols) with cols contiguous, i.e. a matrix is
    (out_features, in_features). `data` is the stored bytes as the file holds them: float32 /
    float16 arrays for F32 / F16, and uint8 (rows, bytes_per_row) for BF16 and block quants."""
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def type_name(self) -> str:
        return self.qtype.name


@dataclass
class ModelFile:
    path: Path
    format: str                                  # "gguf" | "safetensors"
    metadata: dict[str, Any]                     # GGUF keys (tokenizer.ggml.* included)
    tensors: dict[str, Tensor]
    config: ModelConfig
    # safetensors directories carry their tokenizer as files
    tokenizer_json: Path | None = None
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    _keepalive: Any = field(default=None, repr=False)   # the mmap owner

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    def tensor(self, name: str) -> Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(self.path, f"missing required tensor {name!r}")
        return t

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def quant_mix(self) -> dict[str, int]:
        """Tensor count per storage type, most common first."""
        return dict(Counter(t.type_name for t in self.tensors.values()).most_common())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
