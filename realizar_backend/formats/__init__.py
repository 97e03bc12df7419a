"""Model files -> one ModelFile: config, metadata and named tensors (zero-copy views)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelFormatError, UnsupportedModelError
from .model_file import ModelFile, Tensor


def open_model(path: str | Path) -> ModelFile:
    """Open a .gguf file or a Hugging Face safetensors directory."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(p, "no such file or directory")
    if p.is_dir():
        from .safetensors import open_safetensors
        return open_safetensors(p)
    from .gguf import open_gguf
    return open_gguf(p)


__all__ = ["Tensor", "ModelFile", "open_model", "ModelFormatError", "UnsupportedModelError"]
