"""Architecture -> the model that defines it (model/transformer.py). A new architecture is its
layer's blocks there and a row here (and its tensor names and flags in arch.py / config.py)."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .transformer import DenseTransformer, HybridMoeTransformer, HybridTransformer, Loader, MoeTransformer

FAMILIES = {"llama": DenseTransformer, "qwen2": DenseTransformer, "qwen3": DenseTransformer,
            "gemma3": DenseTransformer, "qwen3moe": MoeTransformer, "gpt-oss": MoeTransformer,
            "qwen35": HybridTransformer, "qwen35moe": HybridMoeTransformer}


def build_model(config: ModelConfig, loader: Loader) -> Any:
    """The model of config.arch with its weights as the loader keeps them."""
    return FAMILIES[config.arch].load(config, loader)
