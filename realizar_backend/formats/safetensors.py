"""Hugging Face checkpoint directories (what transformers' `save_pretrained` writes):
config.json, model.safetensors or shards + model.safetensors.index.json, tokenizer files.

Each file is validated by the `safetensors` package (`safe_open`: header, dtypes, offsets, and
that the data covers the file exactly), then memory-mapped here and sliced with the offsets
of its header, so tensors are zero-copy views like GGUF's. F32 and F16 become float32 / float16
arrays; BF16 (which numpy lacks) stays as its raw bytes, uint8 (rows, 2*cols) with qtype BF16,
the same form a GGUF BF16 tensor has, so `formats.quants.dequantize` and the backends treat both
alike. HF names are mapped to canonical (GGUF) names; HF q/k are not permuted, so the config's
RoPE style is "neox" (set by `config_from_hf`).
"""

from __future__ import annotations

import json
import logging
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors import SafetensorError, safe_open

from ..errors import ModelFormatError, UnsupportedModelError
from ..model.arch import HF_TO_CANONICAL, required_tensors
from ..model.config import config_from_hf
from .model_file import ModelFile, Tensor

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": (Q.F32, np.float32), "F16": (Q.F16, np.float16), "BF16": (Q.BF16, np.uint8)}
# Checkpoints whose tensors need more than renaming (gemma3 norms are stored as w-1, and its
# layer norms map differently); they load from GGUF.
_RENAME_ONLY = ("llama", "qwen2", "qwen3")


def _hf_patterns() -> list[tuple[re.Pattern, str]]:
    out = []
    for hf, canon in HF_TO_CANONICAL.items():
        rx = re.escape(hf).replace(re.escape("{i}"), r"(\d+)")
        out.append((re.compile(rx + "$"), canon))
    return out


_PATTERNS = _hf_patterns()


def canonical_name(hf_name: str) -> str | None:
    for rx, canon in _PATTERNS:
        m = rx.match(hf_name)
        if m:
            return canon.replace("{i}", m.group(1)) if m.groups() else canon
    return None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(path, f"{what} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"{what} is not valid JSON: {e}") from None


def _weight_files(d: Path) -> list[Path]:
    index_path = d / INDEX
    if index_path.exists():
        index = _read_json(index_path, "the shard index")
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise ModelFormatError(index_path, "bad shard index: expected a non-empty 'weight_map' object "
                                               "of tensor name -> shard file")
        files = []
        for shard in dict.fromkeys(wm.values()):          # order kept, duplicates dropped
            p = (d / shard)
            if Path(shard).name != shard:                 # no paths out of the directory
                raise ModelFormatError(index_path, f"bad shard index: shard name {shard!r} is not a file name")
            if not p.is_file():
                raise ModelFormatError(p, f"shard {shard!r} named by {INDEX} is missing")
            files.append(p)
        return files
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    raise ModelFormatError(d, f"no weights: expected {SINGLE} or {INDEX} in the directory")


def _open_shard(path: Path, tensors: dict[str, Tensor], keep: list) -> None:
    """Validate with safe_open, then map the file and slice each tensor out of it."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            specs = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}
    except SafetensorError as e:
        raise ModelFormatError(path, f"corrupt safetensors file: {e}") from None
    except OSError as e:
        raise ModelFormatError(path, f"cannot read the file: {e}") from None
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    (n_header,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(bytes(buf[8:8 + n_header]))
    base = 8 + n_header
    keep.append(buf)
    for hf, (dtype, shape) in specs.items():
        canon = canonical_name(hf)
        if canon is None:
            log.debug("%s: ignoring tensor %s (not used by the forward pass)", path, hf)
            continue
        if dtype not in DTYPES:
            raise UnsupportedModelError(path, f"tensor {hf!r} has dtype {dtype}, which is not supported; "
                                              f"supported: {', '.join(DTYPES)}")
        if canon in tensors:
            raise ModelFormatError(path, f"tensor {hf!r} appears in more than one shard")
        qtype, np_dtype = DTYPES[dtype]
        begin, end = header[hf]["data_offsets"]
        n = end - begin
        if qtype == Q.BF16:
            data = np.frombuffer(buf, np.uint8, n, base + begin)
            data = data.reshape(shape[:-1] + (shape[-1] * 2,)) if shape else data
        else:
            data = np.frombuffer(buf, np_dtype, n // np.dtype(np_dtype).itemsize, base + begin).reshape(shape)
        tensors[canon] = Tensor(canon, qtype, shape, data)


def open_safetensors(directory: str | Path) -> ModelFile:
    d = Path(directory)
    hf = _read_json(d / "config.json", "config.json")
    if not isinstance(hf, dict):
        raise ModelFormatError(d / "config.json", "config.json should hold a JSON object")
    tensors: dict[str, Tensor] = {}
    keep: list = []
    for shard in _weight_files(d):
        _open_shard(shard, tensors, keep)

    config = config_from_hf(d / "config.json", hf, set(tensors))
    if config.arch not in _RENAME_ONLY:
        raise UnsupportedModelError(d, f"{config.arch} safetensors checkpoints are not supported (use its GGUF); "
                                       f"supported here: {', '.join(_RENAME_ONLY)}")
    if hf.get("tie_word_embeddings", True) is False and "output.weight" not in tensors:
        raise ModelFormatError(d, "config.json says tie_word_embeddings is false, but there is no "
                                  "'lm_head.weight' (output.weight)")

    tok_cfg: dict[str, Any] = {}
    if (d / "tokenizer_config.json").is_file():
        tok_cfg = _read_json(d / "tokenizer_config.json", "tokenizer_config.json")
        if not isinstance(tok_cfg, dict):
            raise ModelFormatError(d / "tokenizer_config.json", "tokenizer_config.json should hold a JSON object")
    # transformers >= 4.47 saves the chat template beside tokenizer_config.json
    if "chat_template" not in tok_cfg:
        if (d / "chat_template.jinja").is_file():
            tok_cfg["chat_template"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif (d / "chat_template.json").is_file():
            ct = _read_json(d / "chat_template.json", "chat_template.json")
            if isinstance(ct, dict) and "chat_template" in ct:
                tok_cfg["chat_template"] = ct["chat_template"]
    tok_json = d / "tokenizer.json"

    metadata: dict[str, Any] = {
        "general.architecture": config.arch,
        "general.name": str(hf.get("_name_or_path") or hf.get("_model_name_or_path") or d.name).rstrip("/").split("/")[-1] or d.name,
        "hf.config": hf,
    }
    gen = d / "generation_config.json"
    gen_cfg = _read_json(gen, "generation_config.json") if gen.is_file() else {}
    for key, src in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                     ("padding_token_id", "pad_token_id")):
        v = hf.get(src, gen_cfg.get(src) if isinstance(gen_cfg, dict) else None)
        if isinstance(v, list) and v:
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool):
            metadata[f"tokenizer.ggml.{key}"] = v
    if isinstance(tok_cfg.get("chat_template"), str):
        metadata["tokenizer.chat_template"] = tok_cfg["chat_template"]

    mf = ModelFile(path=d, format="safetensors", metadata=metadata, tensors=tensors, config=config,
                   tokenizer_json=tok_json if tok_json.is_file() else None, tokenizer_config=tok_cfg,
                   _keepalive=keep)
    _check_required(mf)
    from .gguf import validate_model
    validate_model(mf)
    log.debug("%s: safetensors, %d tensors, %s", d, len(tensors), mf.quant_mix())
    return mf


def _hf_name(canon: str) -> str:
    m = re.match(r"blk\.(\d+)\.(.+)$", canon)
    for hf, c in HF_TO_CANONICAL.items():
        if m and c == "blk.{i}." + m.group(2):
            return hf.replace("{i}", m.group(1))
        if not m and c == canon:
            return hf
    return canon


def _check_required(mf: ModelFile) -> None:
    """Name a missing tensor by its HF name too: that is what the user's checkpoint calls it."""
    c = mf.config
    if c.n_layers > len(mf.tensors):
        return                                   # validate_model words this one
    for name in required_tensors(c.arch, c.n_layers, c.recurrent):
        if name not in mf.tensors:
            raise ModelFormatError(mf.path, f"missing required tensor {_hf_name(name)!r} ({name})")
