"""Tiny models the GPU tests need, made here and carried to the GPU machine, which has neither
transformers nor a network: tests/support/hf_oracle.py builds a family's tiny random model with
transformers and converts it with llama.cpp's converter (cached); each family's module
(moe_models.py, gptoss_models.py, hybrid_models.py) names its models, their architecture and config
overrides and each tensor's storage type, and this class makes, finds and writes them:

    python tests/support/moe_models.py DIR      # every model of the family into DIR

A test finds a model in the directory its environment variable names, else in hf_oracle's cache
(made on demand), else gets None and skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf import GGMLQuantizationType as Q

# (tensor name, shape in NumPy order) -> its storage type (None: as converted)
TypeRule = Callable[[str, tuple[int, ...]], "Q | None"]


@dataclass(frozen=True)
class CarriedModels:
    prefix: str                                 # file names: PREFIX-NAME.gguf
    env: str                                    # the variable naming the carried directory
    default_dir: str                            # where `python MODULE.py` writes without an argument
    arch: dict[str, str]                        # hf_oracle's architecture of each model
    overrides: dict[str, dict]                  # its config.json overrides (hf_oracle ARCHS has the rest)
    types: dict[str, TypeRule | None]           # its storage types (None: the converter's file as it is)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.arch)

    def file_name(self, name: str) -> str:
        return f"{self.prefix}-{name}.gguf"

    def make(self, name: str, out: Path) -> Path:
        """Build the model `name` with transformers and the converter, stored as its types say, into out."""
        from support.hf_oracle import tiny_gguf
        from support.synth import requantize
        src = tiny_gguf(self.arch[name], **self.overrides[name])
        out.parent.mkdir(parents=True, exist_ok=True)
        rule = self.types[name]
        if rule is None:
            shutil.copyfile(src, out)
            return out
        return requantize(src, out, rule)

    def model_path(self, name: str) -> Path | None:
        """The model `name`: from the carried directory where it is there, else made now beside the
        converted model in hf_oracle's cache (None where transformers or the converter is out of reach)."""
        d = os.environ.get(self.env)
        if d and (Path(d) / self.file_name(name)).exists():
            return Path(d) / self.file_name(name)
        try:
            from support.hf_oracle import available, tiny_gguf
            if not available(self.arch[name]):
                return None
            out = tiny_gguf(self.arch[name], **self.overrides[name]).parent / self.file_name(name)
            return out if out.exists() else self.make(name, out)
        except (ImportError, subprocess.CalledProcessError, RuntimeError):   # no transformers, converter or network
            return None

    def main(self) -> None:
        """Every model of the family into the directory argv[1] names (default_dir without one)."""
        dest = Path(sys.argv[1] if len(sys.argv) > 1 else self.default_dir)
        for n in self.names:
            print(self.make(n, dest / self.file_name(n)))
