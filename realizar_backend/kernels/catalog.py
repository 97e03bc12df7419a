"""Which kernel modules the CUDA loader builds, and the prebuilt cubins shipped for them.

A module is one kernels/*.cu file with its local headers pasted in (`source`), compiled with
`base_options(cc)` plus a few -D options of its own. The loader (backends/cuda/modules.py) asks for
a module by (file, options); before it compiles one with NVRTC it looks for a cubin of exactly that
source text and those options in cubin/manifest.json, written by `python tools/build_kernels.py`.

Two options only narrow what a module holds, so a module built without them serves every model
and the loader may take it instead (`generalisations`): -DREALIZAR_QMASK (the quant types compiled
in: a model's own, to shorten NVRTC) and -DATT_HEAD_DIM (the decode-attention body chosen at compile
time instead of at run time from the head size). The prebuilt set is `variants()` for each arch in
ARCHS: every module the loader builds for any model (no quant mask), plus the decode attention for
the head sizes of common models and the decode GEMVs for common quant masks (QMASK_EXACT files
are never served by their general module). When the loader gains a module or a variant, add it to
`variants()` and run the tool (tests/kernels/test_prebuilt_kernels.py fails until then).

A GPU of compute capability X.Y with no modules of its own takes those of the highest shipped X.Z
with Z < Y, as CUDA's binary compatibility allows (sm_80 code runs on 8.6 and 8.9): built with
-DREALIZAR_CC=XZ, which is why REALIZAR_CC may only ever gate features (`#if REALIZAR_CC >= 89`),
never choose something that must match the device exactly.

This file needs no GPU and no CuPy (the tool and the CPU tests import it).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import re
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
CUBIN_DIR = KERNEL_DIR / "cubin"
MANIFEST = CUBIN_DIR / "manifest.json"

MMV_NB = (1, 2, 4, 8)                # activation rows per mmvf launch column (template instances)
# warps per block of mmvf.cu's kernels by batch width (-DMMVF_WARPS): 8 at one row (half the blocks
# staging the input); 4 from two rows up, where every weight is applied to each row and blocks run long
MMVF_WARPS = {1: 8, 2: 4, 4: 4, 8: 4}
# rows a warp group owns in the LM head's launch at one row, and in one-row launches whose input is
# too long to stage (-DMMVF_R; the other launches: 2): a head's many rows keep more loads in flight
# with 4 a group, unstaged rows read their activations half as often; 8 runs out of registers
MMVF_HEAD_R = 4
# rows a group in the fused gate/up launch (ffnf) by batch width (-DMMVF_R; absent: 2)
FFNF_R = {1: 1}
# mmv8.cu (one-row GEMVs on 8-bit activations, dp4a): warps a block and blocks an SM its registers
# must allow (-DMMV8_WARPS, -DMMV8_MINB): 2 x 16 warps hold half the SM's 64 warps at 64 registers a
# thread (65536 / (2 x 512)); each block copies the whole quantized input row, so 2 larger blocks an
# SM copy it half as often as 4 blocks of 8 warps would
MMV8_WARPS = 16
MMV8_MINB = 2
# rows a warp group by kind (1 mmv8, 2 ffn8, 3 moe8; -DMMV8_R) and units a lane loads per loop trip
# (-DMMV8_UNROLL): R x M x UNROLL decoded units (12 registers each) live at once, within the 64
# registers: mmv8 2 rows x 1 (the rows share each unit's activations), ffn8 gate + up x 1 row x 2,
# moe8 as ffn8 (its gate and up)
MMV8_R = {1: 2, 2: 1, 3: 1}
MMV8_UNROLL = {1: 1, 2: 2, 3: 2}
# trips of Q4_K weights a lane holds (-DMMV8_LD; mmv8_q4k): 1 = each trip's loads issued just before
# it is worked on; 2 (the next trip's in flight meanwhile) spills at 64 registers with 2 rows (or
# gate + up) and was slower end to end
MMV8_LD = {1: 1, 2: 1, 3: 1}
# Q4_K trips a warp of mmv8 / ffn8 keeps in flight through shared memory (-DMMV8_RING; mmv8_q4k_ring),
# 0: the register path (MMV8_LD). A trip is 576 bytes of each of the warp's rows (mmv8 MMV8_R rows,
# ffn8 gate + up); 3 stages hold two trips in flight while the third is worked on, and the rings of
# 16 warps (55 KB for mmv8) leave room for two blocks an SM beside rows of up to ~19k values on sm_80
# (164 KB an SM; longer rows: one block there), of up to ~46k on sm_90 (228 KB). The experts' moe8
# kernels stage several rows: no ring
MMV8_RING = {1: 3, 2: 3, 3: 0}
MMV8_TRIP = 576                      # mmv8.cu MMV8_TRIP: one Q4_K trip of a row (4 super-blocks)
# threads a block of mmv8_q8 (the input's quantization: a float4 piece a thread; its __launch_bounds__)
MMV8_Q8_THREADS = 256
# dynamic shared memory of an mmv8.cu launch: the row's int8 values (padded to whole 256-value
# super-blocks: mmv8.cu mmv8_kpad), then (d, d * sum q) per 32, in whole 16-byte copies
MMV8_SMEM_MAX = 100 * 1024
# staged fp32 activation rows an mmvf.cu block holds (mmvf.cu mmvf_stage; longer rows: global reads),
# and the dynamic shared memory the loader allows attention.cu (its prompt tiles: ops.attention)
MMVF_SMEM_MAX = 100 * 1024
ATT_SMEM_MAX = 100 * 1024
# These limits fit sm_80 and sm_90 (their opt-in shared memory a block: 163 KB, 227 KB); a device
# with less (sm_86, sm_89: 99 KB) takes the lesser plan of backends/cuda/dispatch.py smem_limits.
# the device's scratch for mmv8_q8's rows (modules.Kernels.mmv8_xq): 4 rows of the longest input
MMV8_XQ_BYTES = 4 * MMV8_SMEM_MAX


def mmv8_smem(K: int) -> int:
    return (K + 255) // 256 * 256 + (8 * (K // 32) + 15) // 16 * 16


MMQ_BN = (8, 16, 32, 64)             # token-tile widths of the batched-decode matrix multiply (mmq.cu)
MMQ_DEPTH = {8: 2, 16: 2, 32: 1, 64: 1}   # mmq.cu MmqCfg<BN>::D: chunks of weights in flight


def mmq_smem_bytes(bn: int, a8: bool = False) -> int:
    """Dynamic shared memory of mmq_bnBN (kernels/mmq.cu mmq_smem_bytes): the 128-row A tile
    (272-byte rows; the 8-bit variant's, 144), its unit scales (80 bytes a row), D + 1 activation
    chunks as their prep records (528 bytes a token; 8-bit: 160). A device whose blocks hold less
    plans narrower token tiles (backends/cuda/dispatch.py smem_limits)."""
    arow, rec = (144, 160) if a8 else (272, 528)
    return 128 * arow + 128 * 80 + (MMQ_DEPTH[bn] + 1) * bn * rec


ATT_KINDS = ("attn_decode", "attn_tile", "attn_tile_v2")   # attention.cu ATT_KIND 1..3
PREBUILT_HEAD_DIMS = (64, 128, 256)  # SmolLM2 / Qwen2.5-0.5B, Qwen2.5-1.5B and Llama, Gemma 3
# compute capabilities shipped prebuilt: 8.0 (A100; its modules also serve 8.6 and 8.9: A10, RTX 30,
# L4, L40, RTX 40) and 9.0 (H100, H200). Each arch costs ~9 minutes of one core to build.
ARCHS = ("sm_80", "sm_90")
# compiler options CuPy adds to every NVRTC compile (cupy.cuda.compiler): the tool passes them to
# nvcc so that the prebuilt code is the code NVRTC would make
NVRTC_IMPLIED = ("-ftz=true",)

_GENERAL = ("-DREALIZAR_QMASK=", "-DATT_HEAD_DIM=")
# Files whose quant mask is never generalised away: the decode GEMVs of one row (mmvf.cu, mmv8.cu)
# and of a few (mmqs.cu). Compiled for every type, their kernels switch over every decoder, and a decode
# step of one row runs markedly slower than on a module built for the model's own types. A model
# whose mask ships no module of these compiles it with NVRTC (once: CuPy caches it on disk) rather
# than take the general one.
QMASK_EXACT = frozenset({"mmvf.cu", "mmv8.cu", "mmqs.cu"})
# quant masks shipped prebuilt for the QMASK_EXACT files: the matrix types of common GGUF files
# (Q4_K_M: Q4_K + Q6_K; Q4_K_M with Q5_0 / Q8_0 tensors, as Qwen2.5-0.5B and Gemma 3 270M; Q4_1 +
# Q8_0, as SmolLM2-135M; Q5_K_M: Q5_K + Q6_K), as GGML type numbers
PREBUILT_QMASKS = ((12, 14), (6, 8, 12, 14), (3, 8), (13, 14))


def source(name: str) -> str:
    """kernels/<name> with its local headers (common.cuh, paged_kv.cuh) pasted in rather than
    #included: CuPy's on-disk kernel cache and the prebuilt manifest are keyed by the source text,
    so an edit to a header must change the key of every file that uses it. A pasted header's
    `#pragma once` goes (each is pasted once; in a main file the pragma only draws a warning)."""
    def inline(text: str, seen: set) -> str:
        def sub(m):
            h = m.group(1)
            if h in seen:
                return ""
            seen.add(h)
            header = re.sub(r"^#pragma once\s*$", "", (KERNEL_DIR / h).read_text(), flags=re.M)
            return inline(header, seen)
        return re.sub(r'^#include "([\w.]+\.cuh)"\s*$', sub, text, flags=re.M)
    return inline((KERNEL_DIR / name).read_text(), set())


def base_options(cc: str | int) -> tuple[str, ...]:
    return ("-std=c++17", f"-DREALIZAR_CC={cc}")


def qmask_option(qtypes: Iterable[int]) -> str:
    return f"-DREALIZAR_QMASK={sum(1 << int(q) for q in set(qtypes)):#x}ull"


def mmvf_options(nb: int, kind: int, head: bool = False) -> tuple[str, ...]:
    """The options of mmvf.cu's module of batch width nb and kind 1 (mmvf) or 2 (ffnf); head: the
    LM head's mmvf at one row (MMVF_HEAD_R rows a group)."""
    opts = (f"-DMMVF_NB={nb}", f"-DMMVF_KIND={kind}", f"-DMMVF_WARPS={MMVF_WARPS[nb]}")
    if head:
        return opts + (f"-DMMVF_R={MMVF_HEAD_R}",)
    return opts + (f"-DMMVF_R={FFNF_R[nb]}",) if kind == 2 and nb in FFNF_R else opts


def mmv8_options(kind: int, ring: bool = True) -> tuple[str, ...]:
    """The options of mmv8.cu's module of kind 1 (mmv8_nb1, mmv8_q8), 2 (ffn8_nb1) or 3 (the experts'
    moe8_gate_up_nb1 and moe8_gemv_nb1); ring False: without the Q4_K ring (MMV8_RING 0, on a device
    whose blocks cannot hold it: dispatch.smem_limits; no such module ships prebuilt)."""
    return (f"-DMMV8_KIND={kind}", f"-DMMV8_WARPS={MMV8_WARPS}", f"-DMMV8_MINB={MMV8_MINB}",
            f"-DMMV8_R={MMV8_R[kind]}", f"-DMMV8_UNROLL={MMV8_UNROLL[kind]}", f"-DMMV8_LD={MMV8_LD[kind]}",
            f"-DMMV8_RING={MMV8_RING[kind] if ring else 0}")


def mmv8_ring_smem(kind: int, ring: bool = True) -> int:
    """Dynamic shared memory of the Q4_K rings of an mmv8.cu launch of `kind` (after its staged row):
    MMV8_WARPS rings of MMV8_RING trips of the warp's rows (mmv8.cu mmv8_ring_bytes); 0 for a module
    built without the ring (mmv8_options(kind, ring=False))."""
    if not ring:
        return 0
    return MMV8_WARPS * MMV8_RING[kind] * (2 if kind == 2 else 1) * MMV8_R[kind] * MMV8_TRIP


def variants() -> list[tuple[str, tuple[str, ...]]]:
    """(file, options beyond base_options) of every prebuilt module, for one arch."""
    out = [("mmvf.cu", mmvf_options(nb, kind)) for nb in MMV_NB for kind in (1, 2)]
    out += [("mmvf.cu", (qmask_option(m),) + mmvf_options(nb, kind))
            for m in PREBUILT_QMASKS for nb in MMV_NB for kind in (1, 2)]
    out += [("mmvf.cu", mask + mmvf_options(1, 1, head=True))
            for mask in [()] + [(qmask_option(m),) for m in PREBUILT_QMASKS]]
    out += [("mmv8.cu", mask + mmv8_options(kind))
            for mask in [()] + [(qmask_option(m),) for m in PREBUILT_QMASKS] for kind in (1, 2, 3)]
    out += [("attention.cu", (f"-DATT_KIND={i}",)) for i in range(1, len(ATT_KINDS) + 1)]
    out += [("attention.cu", ("-DATT_KIND=1", f"-DATT_HEAD_DIM={d}")) for d in PREBUILT_HEAD_DIMS]
    out += [(name, ()) for name in ("dequant.cu", "repack.cu", "elementwise.cu", "norm.cu", "rope.cu",
                                    "prefill.cu", "gemv.cu", "sampling.cu", "moe.cu",
                                    "deltanet.cu")]
    out += [("mmq.cu", (f"-DMMQ_BN={bn}",)) for bn in MMQ_BN + (0,)]          # 0: the prep kernel
    out += [("mmq.cu", ("-DMMQ_A8=1", f"-DMMQ_BN={bn}")) for bn in MMQ_BN + (0,)]   # its 8-bit-activation variant
    out.append(("mmqs.cu", ()))
    out += [("mmqs.cu", (qmask_option(m),)) for m in PREBUILT_QMASKS]
    # flash attention (backends/cuda/flash.py plans): the default variant of each head size
    for d in PREBUILT_HEAD_DIMS:
        out.append(("flash_prefill.cu", (f"-DFL_D={d}", "-DFL_NW=4", f"-DFL_WM={1 if d > 128 else 2}", "-DFL_QS=0")))
        out.append(("flash_decode.cu", (f"-DFL_D={d}", "-DFL_QS=1")))
    return out


def module_key(text: str, options: Sequence[str]) -> str:
    """Names a module by everything that decides its code: the source text and the options (in
    any order; the arch is in them as -DREALIZAR_CC)."""
    h = hashlib.sha256(text.encode())
    h.update(b"\0" + "\0".join(sorted(options)).encode())
    return h.hexdigest()


def _older_archs(options: Sequence[str]) -> list[tuple[str, ...]]:
    """options, then the same for each shipped arch of the same major and a lower minor (newest
    first), whose machine code this device runs."""
    opts = tuple(options)
    cc = next((o.split("=", 1)[1] for o in opts if o.startswith("-DREALIZAR_CC=")), None)
    out = [opts]
    if cc is None or not cc.isdigit():
        return out
    major, minor = divmod(int(cc), 10)
    shipped = sorted((int(a.removeprefix("sm_")) for a in manifest().get("archs", ()) if a.removeprefix("sm_").isdigit()),
                     reverse=True)
    for other in shipped:
        if other // 10 == major and other % 10 < minor:
            out.append(tuple(f"-DREALIZAR_CC={other}" if o.startswith("-DREALIZAR_CC=") else o for o in opts))
    return out


def generalisations(options: Sequence[str], keep_mask: bool = False) -> list[tuple[str, ...]]:
    """options, then the same without the narrowing options (quant mask, head size), most
    specific first: each later entry builds a module that serves everything the first one does.
    keep_mask: the quant mask stays (QMASK_EXACT files)."""
    opts = tuple(options)
    out = [opts]
    for drop in ((_GENERAL[1:],) if keep_mask else (_GENERAL[:1], _GENERAL[1:], _GENERAL)):
        cut = tuple(o for o in opts if not o.startswith(drop))
        if cut not in out:
            out.append(cut)
    return out


@lru_cache(maxsize=1)
def manifest() -> dict:
    """cubin/manifest.json ({} when there is none)."""
    try:
        return json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        return {}


@lru_cache(maxsize=1)
def _by_key() -> dict[str, Path]:
    return {m["key"]: CUBIN_DIR / m["cubin"] for m in manifest().get("modules", ())}


def find_prebuilt(text: str, options: Sequence[str], keep_mask: bool = False) -> tuple[Path, tuple[str, ...]] | None:
    """The prebuilt cubin (xz-compressed: cubins of one source shrink ~10x) for a module of source
    `text` asked for with `options`, or for a more general one (generalisations; keep_mask: never
    one without the quant mask asked for), with the options it was built with; None where none ships."""
    table = _by_key()
    for arch_opts in _older_archs(options):
        for opts in generalisations(arch_opts, keep_mask):
            path = table.get(module_key(text, opts))
            if path is not None and path.is_file():
                return path, opts
    return None


_unpack_lock = threading.Lock()
_unpack_dir: list[Path] = []


def unpacked(path: Path) -> Path:
    """The cubin of a shipped .cubin.xz as a plain file (CuPy loads modules from paths), in a
    directory of this process that goes at exit. Raises ImportError where Python has no lzma."""
    import lzma
    with _unpack_lock:
        if not _unpack_dir:
            _unpack_dir.append(Path(tempfile.mkdtemp(prefix="realizar-cubin-")))
            atexit.register(shutil.rmtree, _unpack_dir[0], True)
    out = _unpack_dir[0] / path.name.removesuffix(".xz")
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(lzma.decompress(path.read_bytes()))
        tmp.replace(out)
    return out


def cubin_kernels(cubin: bytes) -> list[str]:
    """The kernel entry points of a cubin (ELF64: one `.text.<name>` section per kernel), sorted."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", cubin, base)
        offset, size = struct.unpack_from("<QQ", cubin, base + 0x18)
        return name, offset, size

    _, stroff, strsize = section(shstrndx)
    strtab = cubin[stroff:stroff + strsize]
    names = []
    for i in range(shnum):
        n = section(i)[0]
        label = strtab[n:strtab.index(b"\0", n)].decode()
        if label.startswith(".text."):
            names.append(label[len(".text."):])
    return sorted(names)
