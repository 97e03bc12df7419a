"""GGUF v2/v3 through the `gguf` package's reader: memory-mapped, zero copy."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGUF_MAGIC

from ..errors import ModelFormatError, UnsupportedModelError
from ..model.arch import required_tensors
from ..model.config import config_from_gguf
from . import ModelFile, Tensor
from .quants import SUPPORTED

log = logging.getLogger(__name__)


def _field_value(field) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 \
            and field.types[-1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    return field.contents()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def open_gguf(path: Path) -> ModelFile:
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise ModelFormatError(path, f"file is {size} bytes, too short to be GGUF")
    with open(path, "rb") as f:
        magic = int.from_bytes(f.read(4), "little")
    if magic != GGUF_MAGIC:
        raise ModelFormatError(path, f"not a GGUF file (magic {magic:#010x}, expected {GGUF_MAGIC:#010x})")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise ModelFormatError(path, f"corrupt or truncated GGUF header: {e}") from None
    try:
        metadata = read_metadata(reader)
    except Exception as e:  # a field whose value cannot be decoded
        raise ModelFormatError(path, f"corrupt metadata: {e}") from None

    tensors: dict[str, Tensor] = {}
    for rt in reader.tensors:
        end = rt.data_offset + rt.n_bytes
        if end > size or rt.data.nbytes != rt.n_bytes:
            raise ModelFormatError(path, f"tensor {rt.name!r} data ends at byte {end} but the file has "
                                         f"{size} bytes (truncated or bad offset)")
        if rt.tensor_type not in SUPPORTED:
            raise UnsupportedModelError(path, f"tensor {rt.name!r} has type {rt.tensor_type.name}, "
                                              f"which is not supported; supported: "
                                              f"{', '.join(q.name for q in SUPPORTED)}")
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        tensors[rt.name] = Tensor(rt.name, rt.tensor_type, shape, rt.data)

    config = config_from_gguf(path, metadata, set(tensors))
    mf = ModelFile(path=path, format="gguf", metadata=metadata, tensors=tensors, config=config,
                   _keepalive=reader)
    validate_shapes(mf)
    return mf


def validate_shapes(mf: ModelFile) -> None:
    """Every tensor the architecture needs is present, with the shape the metadata implies."""
    c = mf.config
    for name in required_tensors(c.arch, c.n_layers):
        mf.tensor(name)
    expect = {
        "token_embd.weight": (c.vocab_size, c.hidden),
        "output.weight": (c.vocab_size, c.hidden),
        "output_norm.weight": (c.hidden,),
    }
    for i in range(c.n_layers):
        b = f"blk.{i}."
        expect.update({
            b + "attn_norm.weight": (c.hidden,), b + "ffn_norm.weight": (c.hidden,),
            b + "attn_q.weight": (c.q_dim, c.hidden), b + "attn_k.weight": (c.kv_dim, c.hidden),
            b + "attn_v.weight": (c.kv_dim, c.hidden), b + "attn_output.weight": (c.hidden, c.q_dim),
            b + "ffn_gate.weight": (c.ffn_dim, c.hidden), b + "ffn_up.weight": (c.ffn_dim, c.hidden),
            b + "ffn_down.weight": (c.hidden, c.ffn_dim),
            b + "attn_q.bias": (c.q_dim,), b + "attn_k.bias": (c.kv_dim,), b + "attn_v.bias": (c.kv_dim,),
            b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,),
        })
    for name, shape in expect.items():
        t = mf.tensors.get(name)
        if t is not None and tuple(t.shape) != shape:
            raise ModelFormatError(mf.path, f"tensor {name!r} has shape {list(t.shape)} but the metadata "
                                            f"implies {list(shape)}")
