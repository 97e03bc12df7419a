"""The key/value section of a GGUF file as a list that tests can change and write back.

    parts = read(path)                       # header pieces of a real file
    kvs = parts.kvs.copy(); kvs[3] = KV("tokenizer.ggml.merges", V.UINT32, 255)
    write(parts, kvs, dst, data="sparse")    # the same tensors; the data region a hole

Values are written as their declared type says, so a test can declare anything (an integer
where an array belongs, duplicate keys) that `gguf.GGUFWriter` would refuse to write. With
data="sparse" the tensor bytes are a hole in the file (zeros, no disk, no copy): enough for
the loader, which maps tensors without reading them; data="copy" copies the real weights.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as V
from gguf import GGUFWriter
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

_SCALAR_FMT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
               V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d", V.BOOL: "<?"}


@dataclass
class KV:
    key: str
    vtype: int                   # a GGUFValueType (or any u32, to write an unknown type)
    value: Any
    itype: int | None = None     # item type of an ARRAY


@dataclass
class Parts:
    path: Path
    version: int
    kvs: list[KV]
    n_tensors: int
    tensor_info: bytes           # the tensor table, verbatim
    data_start: int
    size: int


class _Cursor:
    def __init__(self, buf: bytes):
        self.buf, self.off = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.buf[self.off:self.off + n].decode("utf-8", "surrogateescape")
        self.off += n
        return s

    def value(self, vtype: int):
        if vtype == V.STRING:
            return self.string(), None
        if vtype in _SCALAR_FMT:
            return self.take(_SCALAR_FMT[vtype]), None
        itype, n = self.take("<I"), self.take("<Q")
        return [self.value(itype)[0] for _ in range(n)], itype


def read(path: str | Path, header_bytes: int = 64 << 20) -> Parts:
    path = Path(path)
    with open(path, "rb") as f:
        buf = f.read(header_bytes)
    c = _Cursor(buf)
    assert c.take("<I") == 0x46554747, "not a GGUF file"
    version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
    kvs = []
    for _ in range(n_kv):
        key = c.string()
        vtype = c.take("<I")
        value, itype = c.value(vtype)
        kvs.append(KV(key, vtype, value, itype))
    info_start = c.off
    for _ in range(n_tensors):
        c.string()
        n_dims = c.take("<I")
        c.off += 8 * n_dims + 4 + 8
    alignment = next((kv.value for kv in kvs if kv.key == "general.alignment"), GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-c.off // alignment) * alignment
    return Parts(path, version, kvs, n_tensors, buf[info_start:c.off], data_start, path.stat().st_size)


def _encode(vtype: int, value: Any, itype: int | None, out: bytearray) -> None:
    if vtype == V.STRING:
        b = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
        out += struct.pack("<Q", len(b)) + b
    elif vtype in _SCALAR_FMT:
        out += struct.pack(_SCALAR_FMT[vtype], value)
    elif vtype == V.ARRAY:
        out += struct.pack("<IQ", itype, len(value))
        for item in value:
            _encode(itype, item, None, out)
    else:
        raise ValueError(f"cannot encode value type {vtype}")


def encode_kvs(kvs: list[KV]) -> bytes:
    out = bytearray()
    for kv in kvs:
        k = kv.key.encode("utf-8", "surrogateescape")
        out += struct.pack("<Q", len(k)) + k + struct.pack("<I", kv.vtype)
        _encode(kv.vtype, kv.value, kv.itype, out)
    return bytes(out)


def write(parts: Parts, kvs: list[KV] | bytes, dst: str | Path, data: str = "sparse",
          n_kv: int | None = None) -> Path:
    """A file with parts' tensors and these key/values (or raw key/value bytes, then n_kv says
    how many entries the header claims)."""
    dst = Path(dst)
    body = kvs if isinstance(kvs, bytes) else encode_kvs(kvs)
    count = n_kv if n_kv is not None else len(kvs)
    alignment = GGUF_DEFAULT_ALIGNMENT
    if not isinstance(kvs, bytes):
        alignment = next((kv.value for kv in kvs if kv.key == "general.alignment" and isinstance(kv.value, int)
                          and kv.value > 0), GGUF_DEFAULT_ALIGNMENT)
    head = struct.pack("<IIQQ", 0x46554747, parts.version, parts.n_tensors, count) + body + parts.tensor_info
    start = -(-len(head) // alignment) * alignment
    data_len = parts.size - parts.data_start
    with open(dst, "wb") as f:
        f.write(head)
        f.write(b"\0" * (start - len(head)))
        if data == "copy":
            with open(parts.path, "rb") as src:
                src.seek(parts.data_start)
                shutil.copyfileobj(src, f, 16 << 20)
        else:
            f.truncate(start + data_len)
    return dst


def replaced(kvs: list[KV], key: str, vtype: int | None = None, value: Any = None, itype: int | None = None,
             drop: bool = False) -> list[KV]:
    """kvs with `key` given a new (type, value), or dropped."""
    out = []
    for kv in kvs:
        if kv.key != key:
            out.append(kv)
        elif not drop:
            out.append(KV(key, vtype, value, itype))
    if not drop and all(kv.key != key for kv in kvs):
        out.append(KV(key, vtype, value, itype))
    return out


# ---------------------------------------------------------------- the real files' heads
def shared_head(name: str) -> Path | None:
    """shared/models/NAME.head.gz (a gzipped head of a real GGUF: metadata, tokenizer, template,
    tensor table), found above the checkout; None where it is not there."""
    for parent in Path(__file__).resolve().parents:
        p = parent / "shared" / "models" / f"{name}.head.gz"
        if p.is_file():
            return p
    return None


def header_twin(name: str, scratch: Path, kvs_edit=None) -> Path | None:
    """The real file NAME's head over a sparse data region of its real size (no disk): what a loader
    reads of it, written into scratch (kvs_edit: a function of its key list, for a changed copy);
    None where shared/models has no such head."""
    src = shared_head(name)
    if src is None:
        return None
    head = Path(scratch) / f"{name}.head"
    head.write_bytes(gzip.decompress(src.read_bytes()))
    parts = read(head)
    parts = dataclasses.replace(parts, size=json.loads(src.with_name(f"{name}.json").read_text())["total"])
    return write(parts, kvs_edit(parts.kvs) if kvs_edit else parts.kvs, Path(scratch) / f"{name}.gguf")


def tokenizer_kvs(head_gz: Path, scratch: Path) -> list[KV]:
    """The tokenizer.* keys (tokenizer and chat template) of a real file's head, unpacked into scratch."""
    import gzip
    head = scratch / head_gz.name.removesuffix(".gz")
    if not head.is_file():
        head.write_bytes(gzip.decompress(head_gz.read_bytes()))
    return [kv for kv in read(head).kvs if kv.key.startswith("tokenizer.")]


def tiny_writer(path: str | Path, head: str, arch: str, *, layers: int, context_length: int, hidden: int, ffn: int,
                heads: int, kv_heads: int, head_dim: int):
    """A gguf GGUFWriter for a tiny random `arch` model at path ("tiny-ARCH") that carries the tokenizer
    and chat template of shared/models/HEAD.head.gz (FileNotFoundError where that is not there), its
    attention shape's keys added (uint32). Returns (writer, the head's tokenizer.* keys, vocabulary size):
    the caller adds its architecture's other keys and the tensors, then `finish(writer, kvs)`."""
    path = Path(path)
    src = shared_head(head)
    if src is None:
        raise FileNotFoundError(f"shared/models/{head}.head.gz")
    kvs = tokenizer_kvs(src, path.parent)
    n_vocab = len(next(kv.value for kv in kvs if kv.key == "tokenizer.ggml.tokens"))
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    for key, val in [("block_count", layers), ("context_length", context_length), ("embedding_length", hidden),
                     ("feed_forward_length", ffn), ("attention.head_count", heads),
                     ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                     ("attention.value_length", head_dim)]:
        w.add_uint32(f"{arch}.{key}", val)
    return w, kvs, n_vocab


def finish(writer, kvs: list[KV]) -> None:
    """tiny_writer's file written out: the tokenizer keys (after the model's own), then the tensors."""
    add_kvs(writer, kvs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_kvs(writer, kvs: list[KV]) -> None:
    """Each key of kvs into a gguf GGUFWriter, typed as it was."""
    for kv in kvs:
        if kv.vtype == V.ARRAY:
            writer.add_key_value(kv.key, kv.value, V.ARRAY, kv.itype)
        else:
            writer.add_key_value(kv.key, kv.value, kv.vtype)
