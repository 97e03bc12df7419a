"""Architecture -> the model file that defines it. A new architecture is a model file and a row
here (and its tensor names and flags in arch.py / config.py)."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .dense import DenseTransformer, Loader

FAMILIES = {"llama": DenseTransformer, "qwen2": DenseTransformer, "qwen3": DenseTransformer,
            "gemma3": DenseTransformer}


def build_model(config: ModelConfig, loader: Loader) -> Any:
    """The model of config.arch with its weights as the loader keeps them."""
    return FAMILIES[config.arch].load(config, loader)
