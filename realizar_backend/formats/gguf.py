"""GGUF v2/v3: memory-mapped, zero copy, and every byte of the header bounds-checked.

The layout is GGUF's (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); type ids, block
sizes and value types come from the `gguf` package. The header is parsed here rather than with
`gguf.GGUFReader` for two reasons: the reader trusts every count in the file (an array length of
2**60 makes it loop for ever, a short file surfaces as a bare IndexError), and it builds one numpy
view per vocabulary string, which costs seconds on a 150k-token vocabulary. The tests check that
this parser and `gguf.GGUFReader` agree on real and synthetic files.
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC

from ..errors import ModelFormatError, UnsupportedModelError
from ..model.arch import ARCHITECTURES, SHARED_EXPERT, required_tensors
from ..model.config import config_from_gguf
from .model_file import ModelFile, Tensor
from .quants import SUPPORTED

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4        # no real file nests arrays at all; bounds the recursion

_SCALARS: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"), GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("<u1"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STR_MIN = 8                 # a string is at least its u64 length
_KV_MIN = _STR_MIN + 4 + 1   # key, value type, smallest value
_TENSOR_INFO_MIN = _STR_MIN + 4 + 4 + 8   # name, n_dims, type, offset (0 dims)


def _min_value_size(vtype: GGUFValueType) -> int:
    if vtype in _SCALARS:
        return _SCALARS[vtype].itemsize
    if vtype == GGUFValueType.STRING:
        return _STR_MIN
    return 4 + 8             # an array: item type and count


class _Header:
    """A cursor over the mapped file that refuses to read past its end."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.off = path, buf, size, 0

    def fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.off:
            raise self.fail(f"truncated header: {what} at byte {self.off} needs {n} bytes, "
                            f"but the file ends at byte {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.off)
        self.off += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.off)
        self.off += 8
        return v

    def raw_str(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        if n > self.size - self.off:
            raise self.fail(f"{what} at byte {self.off - 8} claims {n} bytes, but only "
                            f"{self.size - self.off} remain in the file")
        b = self.buf[self.off:self.off + n]
        self.off += n
        return b

    def name(self, what: str) -> str:
        b = self.raw_str(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.off - len(b)} is not valid UTF-8: {b[:40]!r}") from None

    def count(self, n: int, min_item: int, what: str) -> int:
        """A count read from the file, refused at once when its items cannot fit in what is
        left of the file (a kv_count of 2**60 fails here instead of looping)."""
        if n * min_item > self.size - self.off:
            raise self.fail(f"{what} is {n}, impossible: that needs at least {n * min_item} bytes "
                            f"but {self.size - self.off} remain in the file (truncated or corrupt header)")
        return n

    def value_type(self, key: str) -> GGUFValueType:
        at = self.off
        raw = self.u32(f"value type of {key!r}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"metadata key {key!r} has unknown value type {raw} at byte {at}") from None

    def value(self, vtype: GGUFValueType, key: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.raw_str(f"string value of {key!r}").decode("utf-8", errors="replace")
        if vtype in _SCALARS:
            dt = _SCALARS[vtype]
            self.need(dt.itemsize, f"value of {key!r}")
            v = np.frombuffer(self.buf, dt, 1, self.off)[0]
            self.off += dt.itemsize
            return bool(v) if vtype == GGUFValueType.BOOL else v.item()
        # ARRAY
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"metadata key {key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
        at = self.off
        raw = self.u32(f"array item type of {key!r}")
        try:
            itype = GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"metadata array {key!r} has unknown item type {raw} at byte {at}") from None
        n = self.count(self.u64(f"array length of {key!r}"), _min_value_size(itype),
                       f"array length of {key!r}")
        if itype in _SCALARS:
            dt = _SCALARS[itype]
            arr = np.frombuffer(self.buf, dt, n, self.off)
            self.off += n * dt.itemsize
            return arr.astype(bool).tolist() if itype == GGUFValueType.BOOL else arr.tolist()
        if itype == GGUFValueType.STRING:
            return self._str_array(n, key)
        return [self.value(itype, key, depth + 1) for _ in range(n)]

    def _str_array(self, n: int, key: str) -> list[str]:
        # The hot loop of the header (150k vocabulary strings, 150k merges): the loop only slices,
        # the bounds are checked once after it and the strings decoded in one call. A file that
        # fails a check (or holds invalid UTF-8 or a NUL) goes through the checked loop below,
        # which names the item.
        buf, size, off, raw = self.buf, self.size, self.off, []
        unpack, append = _U64.unpack_from, raw.append
        try:
            for _ in range(n):
                (ln,) = unpack(buf, off)
                start = off + 8
                off = start + ln
                append(buf[start:off])
        except (struct.error, OverflowError):     # a length field past the end of the file
            off = size + 1
        if off <= size and n:
            joined = b"\0".join(raw)
            if joined.count(b"\0") == n - 1:
                try:
                    out = joined.decode("utf-8").split("\0")
                except UnicodeDecodeError:
                    out = None
                if out is not None:
                    self.off = off
                    return out
        return self._str_array_checked(n, key)

    def _str_array_checked(self, n: int, key: str) -> list[str]:
        buf, size, off, out = self.buf, self.size, self.off, []
        unpack = _U64.unpack_from
        for i in range(n):
            if off + 8 > size:
                self.off = off
                raise self.fail(f"truncated header: item {i} of array {key!r} at byte {off}")
            (ln,) = unpack(buf, off)
            off += 8
            if ln > size - off:
                raise self.fail(f"item {i} of array {key!r} at byte {off - 8} claims {ln} bytes, "
                                f"but only {size - off} remain in the file")
            out.append(buf[off:off + ln].decode("utf-8", errors="replace"))
            off += ln
        self.off = off
        return out


def _read_header(path: Path, buf: mmap.mmap, size: int):
    h = _Header(path, buf, size)
    magic = h.u32("magic")
    if magic != GGUF_MAGIC:
        raise h.fail(f"not a GGUF file (magic {magic:#010x}, expected {GGUF_MAGIC:#010x} 'GGUF')")
    version = h.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise UnsupportedModelError(path, "big-endian GGUF files are not supported")
        raise UnsupportedModelError(path, f"GGUF version {version} is not supported; supported: "
                                          f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    n_tensors = h.u64("tensor count")
    n_kv = h.count(h.u64("metadata kv count"), _KV_MIN, "metadata kv count")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.name("metadata key")
        vtype = h.value_type(key)
        value = h.value(vtype, key)
        if key in metadata:
            raise h.fail(f"metadata key {key!r} appears twice")
        metadata[key] = value

    n_tensors = h.count(n_tensors, _TENSOR_INFO_MIN, "tensor count")
    infos = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        name = h.name("tensor name")
        if name in seen:
            raise h.fail(f"tensor {name!r} appears twice in the tensor table")
        seen.add(name)
        n_dims = h.u32(f"dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise h.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
        dims = [h.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
        raw_type = h.u32(f"type of tensor {name!r}")
        offset = h.u64(f"data offset of tensor {name!r}")
        infos.append((name, dims, raw_type, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise h.fail(f"general.alignment is {alignment!r}; it must be a positive power of two")
    data_start = -(-h.off // alignment) * alignment
    return version, metadata, infos, alignment, data_start


def _tensor_table(path: Path, buf: mmap.mmap, size: int, infos, alignment: int, data_start: int):
    """Check every tensor's type, geometry and byte range; return zero-copy views."""
    spans, tensors = [], {}
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFormatError(path, f"tensor {name!r} has unknown type id {raw_type} "
                                         f"(not a GGML type this reader knows)") from None
        if any(d == 0 for d in dims):
            raise ModelFormatError(path, f"tensor {name!r} has a zero dimension: {dims}")
        if dims and dims[0] % block:
            raise ModelFormatError(path, f"tensor {name!r} has rows of {dims[0]} values, not a multiple "
                                         f"of the {qtype.name} block size {block}")
        n_elems = int(np.prod(dims, dtype=object)) if dims else 1
        n_bytes = n_elems // block * type_size
        if offset % alignment:
            raise ModelFormatError(path, f"tensor {name!r} has data offset {offset}, not a multiple "
                                         f"of the alignment {alignment}")
        start = data_start + offset
        if start + n_bytes > size:
            raise ModelFormatError(path, f"truncated or bad offset: tensor {name!r} needs bytes "
                                         f"{start}..{start + n_bytes} but the file has {size} bytes")
        spans.append((start, start + n_bytes, name))
        shape = tuple(int(d) for d in reversed(dims))            # numpy order: (rows, cols)
        if qtype == GGMLQuantizationType.F32:
            data = np.frombuffer(buf, np.float32, n_elems, start).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = np.frombuffer(buf, np.float16, n_elems, start).reshape(shape)
        else:                                                     # BF16 and block quants: raw rows
            byte_shape = shape[:-1] + (shape[-1] // block * type_size,) if shape else (n_bytes,)
            data = np.frombuffer(buf, np.uint8, n_bytes, start).reshape(byte_shape)
        tensors[name] = Tensor(name, qtype, shape, data)
    spans.sort()
    for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ModelFormatError(path, f"tensors {an!r} and {bn!r} overlap in the file "
                                         f"(bytes {a0}..{a1} and {b0}..)")
    return tensors


_BLOCK = re.compile(r"blk\.(\d+)\.")


def open_gguf(path: Path) -> ModelFile:
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise ModelFormatError(path, f"cannot read the file: {e.strerror or e}") from None
    with f:
        if size < 24:   # magic, version, two u64 counts
            raise ModelFormatError(path, f"file is {size} bytes, too short to be GGUF")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    version, metadata, infos, alignment, data_start = _read_header(path, buf, size)
    tensors = _tensor_table(path, buf, size, infos, alignment, data_start)
    log.debug("%s: GGUF v%d, %d metadata keys, %d tensors", path, version, len(metadata), len(tensors))

    # Architecture first: an unsupported model should say so, not list tensors it lacks.
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None and freqs.qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        raise ModelFormatError(path, f"rope_freqs.weight should be F32 or F16, not {freqs.qtype.name}")
    config = config_from_gguf(path, metadata, set(tensors), None if freqs is None else freqs.data)
    for t in tensors.values():
        if t.qtype not in SUPPORTED:
            raise UnsupportedModelError(path, f"tensor {t.name!r} has type {t.qtype.name}, which is not "
                                              f"supported; supported: {', '.join(q.name for q in SUPPORTED)}")
    mf = ModelFile(path=path, format="gguf", metadata=metadata, tensors=tensors, config=config,
                   _keepalive=buf)
    validate_model(mf)
    return mf


def validate_model(mf: ModelFile) -> None:
    """The tensors agree with the config: the block count, every required tensor present, and
    every tensor a model reads with the shape the metadata implies, so that a disagreeing file
    fails here, naming the tensor, and never as a shape error (or an out-of-bounds read on the
    GPU) in a forward pass. Shared with the safetensors loader."""
    c = mf.config
    # Compare block_count with the tensors before building per-layer name lists, so an absurd
    # count (10**12) fails here instead of allocating.
    layers = {int(m.group(1)) for n in mf.tensors if (m := _BLOCK.match(n))}
    if c.n_layers > len(mf.tensors) or (layers and max(layers) >= c.n_layers):
        top = max(layers) + 1 if layers else 0
        raise ModelFormatError(mf.path, f"the metadata says {c.n_layers} layers but the tensors "
                                        f"describe {top}")
    for name in required_tensors(c.arch, c.n_layers, c.recurrent):
        mf.tensor(name)
    expect = {
        "token_embd.weight": (c.vocab_size, c.hidden),
        "output.weight": (c.vocab_size, c.hidden),
        "output_norm.weight": (c.hidden,),
    }
    q_rows = 2 * c.q_dim if ARCHITECTURES[c.arch].gated_attention else c.q_dim   # [query | gate]
    E, F, H = c.n_experts, c.expert_ffn_dim, c.hidden
    # Gated DeltaNet: q|k|v mixed in C channels, value heads V of dim c.ssm_v_dim
    C = 2 * c.ssm_k_heads * c.ssm_k_dim + c.ssm_v_heads * c.ssm_v_dim
    V = c.ssm_v_heads * c.ssm_v_dim
    for i in range(c.n_layers):
        b = f"blk.{i}."
        expect.update({
            b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,),
            b + "attn_q.weight": (q_rows, H), b + "attn_k.weight": (c.kv_dim, H),
            b + "attn_v.weight": (c.kv_dim, H), b + "attn_output.weight": (H, c.q_dim),
            b + "ffn_gate.weight": (c.ffn_dim, H), b + "ffn_up.weight": (c.ffn_dim, H),
            b + "ffn_down.weight": (H, c.ffn_dim),
            b + "attn_q.bias": (q_rows,), b + "attn_k.bias": (c.kv_dim,), b + "attn_v.bias": (c.kv_dim,),
            b + "attn_output.bias": (H,), b + "attn_sinks.weight": (c.n_heads,),     # a sink logit per head
            b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,),
            b + "post_attention_norm.weight": (H,), b + "post_ffw_norm.weight": (H,),
        })
        if c.n_experts:
            expect.update({
                b + "ffn_gate_inp.weight": (E, H), b + "ffn_gate_inp.bias": (E,),
                b + "ffn_gate_exps.weight": (E, F, H), b + "ffn_up_exps.weight": (E, F, H),
                b + "ffn_down_exps.weight": (E, H, F),
                b + "ffn_gate_exps.bias": (E, F), b + "ffn_up_exps.bias": (E, F), b + "ffn_down_exps.bias": (E, H),
            })
            shared = [b + n for n in SHARED_EXPERT if b + n in mf.tensors]
            if shared and len(shared) != len(SHARED_EXPERT):
                raise ModelFormatError(mf.path, f"layer {i} has a partial shared expert: "
                                                f"{', '.join(shared)} without the rest of {', '.join(SHARED_EXPERT)}")
            # its width: the metadata's (expert_shared_feed_forward_length), else its gate's rows
            S = c.shared_expert_ffn_dim or (mf.tensors[shared[0]].shape[0] if shared else 0)
            expect.update({
                b + "ffn_gate_shexp.weight": (S, H), b + "ffn_up_shexp.weight": (S, H),
                b + "ffn_down_shexp.weight": (H, S), b + "ffn_gate_inp_shexp.weight": (1, H),
            })
        if c.has_recurrent_state:
            expect.update({
                b + "attn_qkv.weight": (C, H), b + "attn_gate.weight": (V, H),
                b + "ssm_beta.weight": (c.ssm_v_heads, H), b + "ssm_alpha.weight": (c.ssm_v_heads, H),
                b + "ssm_conv1d.weight": (C, c.ssm_conv_kernel),
                b + "ssm_a": (c.ssm_v_heads,), b + "ssm_dt.bias": (c.ssm_v_heads,),
                b + "ssm_norm.weight": (c.ssm_v_dim,), b + "ssm_out.weight": (H, V),
            })
    for name, shape in expect.items():
        t = mf.tensors.get(name)
        if t is not None and tuple(t.shape) != shape:
            raise ModelFormatError(mf.path, f"tensor {name!r} has shape {list(t.shape)} but the metadata "
                                            f"implies {list(shape)}")
