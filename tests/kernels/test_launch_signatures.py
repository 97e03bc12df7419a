"""The Python launchers of gemv.cu, mmv8.cu, mmq.cu's tiles (mmq_bnBN), the grouped experts (moe.cu's
bucketing, mmq.cu's mmq_moe_bnBN), deltanet.cu, prefill.cu (split16.py) and the decode attention (attention.cu's attn_decode,
flash_decode.cu) against the kernels' `extern "C"` signatures: each launch's
argument count and each argument's C type (pointers and unsigned long long: uint64, long long: int64, int: int32, float:
float32), its block against __launch_bounds__, its grid against what the kernel indexes, its dynamic
shared memory against the limit the loader sets (48 KB where it sets none). The launches are
recorded on the CPU (tests/support/launch_record.py, in a process of its own: it stands in a bare
cupy module); the signatures come from the module's source as the loader builds it (catalog.source
and its options), run through g++'s preprocessor, which expands the macro-made kernels. A
mismatch here is garbage or a crash on the GPU only. Skipped where g++ is absent."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from functools import lru_cache

import pytest

from realizar_backend.kernels import catalog
from realizar_backend.backends.cuda.dispatch import SMEM_STATIC_RESERVE, smem_limits
from realizar_backend.backends.cuda.support import DN_CHUNK, DN_DELTA_K
from support.host_emu import GXX, ROOT

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

DEFAULT_SMEM = 48 * 1024
# split16.ROW_WIDTH (split16 imports CuPy): prefill.cu's activation layouts split, paired, fp16 ->
# a row's width in K
ROW_WIDTH = {0: 3, 1: 4, 2: 1}
# kernel name -> (file, options beyond base_options) as backends/cuda/modules.py builds its module
MODULES = {**{f"{p}_{t}": ("gemv.cu", ()) for p in ("gemv", "ffn_gate_up") for t in ("f32", "f16", "bf16")},
           "mmv8_nb1": ("mmv8.cu", catalog.mmv8_options(1)), "ffn8_nb1": ("mmv8.cu", catalog.mmv8_options(2)),
           "mmv8_q8": ("mmv8.cu", catalog.mmv8_options(1)),
           **{n: ("mmv8.cu", catalog.mmv8_options(3)) for n in ("moe8_gate_up_nb1", "moe8_gemv_nb1",
                                                                  "moe8_down_combine_nb1")},
           **{f"mmq{p}_bn{bn}": ("mmq.cu", (f"-DMMQ_BN={bn}",)) for p in ("", "_moe") for bn in catalog.MMQ_BN},
           **{f"mmq8{p}_bn{bn}": ("mmq.cu", ("-DMMQ_A8=1", f"-DMMQ_BN={bn}")) for p in ("", "_moe")
              for bn in catalog.MMQ_BN},
           "mmq_prep": ("mmq.cu", ("-DMMQ_BN=0",)), "mmq8_prep": ("mmq.cu", ("-DMMQ_A8=1", "-DMMQ_BN=0")),
           "moe_bucket_count": ("moe.cu", ()), "moe_bucket_fill": ("moe.cu", ()), "moe_combine": ("moe.cu", ()),
           **{n: ("deltanet.cu", ()) for n in ("dn_conv", "dn_delta", *(f"dn_{kind}_k{d}" for kind in ("delta", "chunk")
                                                                          for d in DN_DELTA_K))},
           **{n: ("prefill.cu", ()) for n in ("split_weights", "norm_split", "act_split", "unscale_scatter",
                                              "unscale_add")},
           "attn_decode": ("attention.cu", ("-DATT_KIND=1",)),
           "flash_decode_d128_q1": ("flash_decode.cu", ("-DFL_D=128", "-DFL_QS=1"))}
# dynamic shared memory the loader allows each module (modules.py build(..., smem)); else 48 KB
# (mmq: modules.mmq_smem_bytes(bn), flash_decode: the device's limit, as recorded)
SMEM_LIMIT = {"mmv8.cu": catalog.MMV8_SMEM_MAX + max(map(catalog.mmv8_ring_smem, catalog.MMV8_RING)), "mmq.cu": None,
              "flash_decode.cu": None}
# kernels whose bodies take blockDim to be their __launch_bounds__ exactly (MMV8_WARPS, MMQ_THREADS,
# MOE_BUCKET_THREADS in their reductions)
EXACT_BLOCK = {"mmv8_nb1", "ffn8_nb1", "mmv8_q8", "moe8_gate_up_nb1", "moe8_gemv_nb1", "moe8_down_combine_nb1",
               "moe_bucket_count",
               "moe_bucket_fill", "mmq_prep", "mmq8_prep",
               *(f"mmq{v}{p}_bn{bn}" for v in ("", "8") for p in ("", "_moe") for bn in catalog.MMQ_BN)}
_SIG = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\(([^)]*)\)\s*)?(\w+)\s*\(([^)]*)\)')


def c_type(param: str) -> str:
    """The NumPy type string a launcher must pass for one C parameter."""
    p = re.sub(r"\b(const|__restrict__|volatile)\b", " ", param)
    words = p.replace("*", " * ").split()
    if "*" in words:
        return "<u8"
    base = " ".join(words[:-1])
    return {"int": "<i4", "unsigned": "<u4", "unsigned int": "<u4", "long long": "<i8",
            "unsigned long long": "<u8", "float": "<f4"}[base]


@lru_cache(maxsize=None)
def signatures(fname: str, options: tuple[str, ...]) -> dict[str, tuple[int | None, list[str]]]:
    """name -> (threads of __launch_bounds__ or None, each parameter's NumPy type) of the module."""
    text = re.sub(r"^\s*#\s*include.*$", "", catalog.source(fname), flags=re.M)
    r = subprocess.run([GXX, "-E", "-P", "-x", "c++", "-std=c++17", *catalog.base_options(90), *options, "-"],
                       input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = {}
    for bounds, name, params in _SIG.findall(r.stdout):
        threads = eval(bounds.split(",")[0], {}) if bounds else None     # noqa: S307  (an integer expression)
        out[name] = (threads, [c_type(p) for p in params.split(",")])
    return out


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "launch_record.py")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_kernels_declared():
    for name, (fname, opts) in MODULES.items():
        assert name in signatures(fname, opts), f"{name}: no such kernel in {fname} {' '.join(opts)}"


def test_host_constants_match_kernels():
    from realizar_backend.backends.cuda.support import (DN_CHUNK, DN_CHUNK_MAX_V, DN_DELTA_K, DN_MAX_K, DN_MAX_TAPS,
                                                        DN_MAX_V, MOE_MAX_K)
    dn = catalog.source("deltanet.cu")
    moe = catalog.source("moe.cu")
    mmv8 = catalog.source("mmv8.cu")

    def define(text, name):
        return int(re.search(rf"^#define {name} (\d+)", text, re.M).group(1))
    assert (define(dn, "DN_MAX_TAPS"), define(dn, "DN_MAX_K"), define(dn, "DN_MAX_V")) == (DN_MAX_TAPS, DN_MAX_K,
                                                                                            DN_MAX_V)
    assert tuple(int(d) for d in re.findall(r"X\((\d+)\)", re.search(r"#define DN_DELTA_K_LIST.*", dn).group(0))) \
        == DN_DELTA_K
    assert (define(dn, "DN_CHUNK"), define(dn, "DN_CHUNK_MAX_V")) == (DN_CHUNK, DN_CHUNK_MAX_V)
    assert define(dn, "DN_CONV_THREADS") == 128        # ops.DN_CONV_THREADS (ops imports CuPy)
    assert define(moe, "MOE_BUCKET_THREADS") == 256    # ops.MOE_BUCKET_THREADS
    gemv = catalog.source("gemv.cu")
    # ops.GEMV_WARPS, GEMV_MAXB, GEMV_MAX_WPR; GEMV_FFN_MAX_WPR is GEMV_WARPS in both
    assert (define(gemv, "GEMV_WARPS"), define(gemv, "GEMV_MAXB"), define(gemv, "GEMV_MAX_WPR")) == (4, 8, 16)
    assert re.search(r"^#define GEMV_FFN_MAX_WPR GEMV_WARPS$", gemv, re.M)
    assert define(moe, "MOE_MAX_K") == define(mmv8, "MMV8_MOE_MAX_K") == MOE_MAX_K
    pre = catalog.source("prefill.cu")
    assert [define(pre, f"LAYOUT_{n}") for n in ("SPLIT", "PAIRED", "FP16")] == list(ROW_WIDTH)


def test_launches_match_signatures(launches):
    seen = set()
    for L in launches:
        name = L["kernel"]
        seen.add(name)
        fname, opts = MODULES[name]
        threads, params = signatures(fname, opts)[name]
        got = [t for t, _ in L["args"]]
        assert len(got) == len(params), f"{name}: {len(got)} arguments, the kernel takes {len(params)}"
        bad = [(i, g, p) for i, (g, p) in enumerate(zip(got, params)) if g != p]
        assert not bad, f"{name}: (argument, passed, kernel's) {bad}"
        block = math.prod(L["block"])
        assert block % 32 == 0 and len(L["grid"]) <= 3 and all(g >= 1 for g in L["grid"]), L
        if threads is not None:
            assert block == threads if name in EXACT_BLOCK else block <= threads, (name, block, threads)
        limit = SMEM_LIMIT.get(fname, DEFAULT_SMEM)
        if limit is None:
            limit = L["smem_limit"]
        assert L["smem"] <= limit, (name, L["smem"], limit)
        if "smem_optin" in L:          # recorded on a device of that many bytes a block: within it
            assert L["smem"] + SMEM_STATIC_RESERVE <= L["smem_optin"], (name, L["smem"], L["smem_optin"])
    assert seen == set(MODULES), seen


def _args(L) -> list:
    return [v for _, v in L["args"]]


def test_grids_cover_the_kernels_indexing(launches):
    by = {}
    for L in launches:
        by.setdefault(L["kernel"].rstrip("0123456789").removesuffix("_bn").removesuffix("_k"), []).append(L)
    # gemv.cu: wpr (the last argument) warps a row, a power of two; blocks of max(GEMV_WARPS, wpr) warps,
    # GEMV_WARPS / wpr rows each (at least one), by a block per GEMV_MAXB activation rows
    gemv = catalog.source("gemv.cu")
    gw, gb, most = (int(re.search(rf"^#define {n} (\d+)", gemv, re.M).group(1))
                    for n in ("GEMV_WARPS", "GEMV_MAXB", "GEMV_MAX_WPR"))
    wprs = {}
    for L in launches:
        if not L["kernel"].startswith(("gemv_", "ffn_gate_up_")):
            continue
        a, ffn = _args(L), L["kernel"].startswith("ffn_")
        N, K, nb, wpr = a[2 + ffn], a[3 + ffn], a[8 + ffn], a[-1]
        assert 1 <= wpr <= (gw if ffn else most) and wpr & (wpr - 1) == 0, (L["kernel"], wpr)
        warps = max(gw, wpr)
        assert L["block"] == [32 * warps] and L["grid"] == [-(-N // (warps // wpr)), -(-nb // gb)], L
        wprs[(L["kernel"], N, K, nb)] = wpr
    # the rule (ops.gemv_wpr): the routers of Qwen3-30B-A3B and gpt-oss-20b and a one-row gate take
    # the most warps, as the rows shrink; a large dense matrix one warp a row
    assert wprs[("gemv_f32", 128, 2048, 1)] == wprs[("gemv_f32", 32, 2880, 1)] == wprs[("gemv_f32", 1, 2048, 1)] == most
    assert wprs[("gemv_f16", 151936, 1536, 1)] == 1 and wprs[("gemv_bf16", 33, 37, 11)] == 1
    assert wprs[("ffn_gate_up_f32", 8, 4096, 1)] == gw and wprs[("ffn_gate_up_bf16", 8960, 1536, 1)] == 1
    # each GEMV follows the mmv8_q8 that quantized its input into the rows it reads (pointer and stride),
    # one block column a row in both, mmv8_q8 a thread per 4 values
    for i, L in enumerate(launches):
        if L["kernel"] not in ("mmv8_nb1", "ffn8_nb1"):
            continue
        Q8, a = launches[i - 1], _args(L)
        q = _args(Q8)
        assert Q8["kernel"] == "mmv8_q8"
        K, xq, xqs = (a[21], a[22], a[23]) if L["kernel"] == "mmv8_nb1" else (a[4], a[6], a[7])
        assert (q[2], q[5], q[6]) == (K, xq, xqs) and xqs == catalog.mmv8_smem(K)
        # the staged row, then the warps' Q4_K rings (none where a block cannot hold them: a launch
        # recorded on a device of smem_optin bytes a block, dispatch.smem_limits)
        lim = smem_limits(L.get("smem_optin"))
        kind = 1 if L["kernel"] == "mmv8_nb1" else 2
        assert L["smem"] == xqs + catalog.mmv8_ring_smem(kind, lim.mmv8_ring) <= lim.mmv8_smem(kind)
        assert Q8["grid"] == [-(-(K // 4) // catalog.MMV8_Q8_THREADS), L["grid"][1]]
    for L in by["mmv8_nb"] + by["ffn8_nb"]:
        assert L["block"] == [catalog.MMV8_WARPS * 32]
        wpr = _args(L)[24] if L["kernel"] == "mmv8_nb1" else _args(L)[11]
        assert catalog.MMV8_WARPS % wpr == 0
        # every row group has a warp group in the first round (mmv8_body counts each segment's groups),
        # unless the grid is the resident wave (launch_record's Rec: 64 registers, 2 blocks on each of 132 SMs)
        a, R = _args(L), catalog.MMV8_R[1 if L["kernel"] == "mmv8_nb1" else 2]
        rows = (a[2], a[9], a[16]) if L["kernel"] == "mmv8_nb1" else (a[3],)
        groups = sum(-(-n // R) for n in rows)
        assert L["grid"][0] == min(-(-groups // (catalog.MMV8_WARPS // wpr)), 2 * 132), (L["kernel"], groups, wpr)
    # the one-row pairs: each follows the mmv8_q8 of its input rows (the token's for gate and up: xdiv =
    # top_k; each pair's own for the down projection), a block column per pair
    for i, L in enumerate(launches):
        if L["kernel"] not in ("moe8_gate_up_nb1", "moe8_gemv_nb1"):
            continue
        q, a = _args(launches[i - 1]), _args(L)
        gu = L["kernel"] == "moe8_gate_up_nb1"
        N, K, xdiv, xq, xqs = a[4 + gu], a[5 + gu], a[8 + gu], a[9 + gu], a[10 + gu]
        pairs = L["grid"][1]
        assert launches[i - 1]["kernel"] == "mmv8_q8" and (q[2], q[5], q[6]) == (K, xq, xqs)
        assert launches[i - 1]["grid"][1] == -(-pairs // xdiv) and xqs == catalog.mmv8_smem(K)
        groups = -(-N // catalog.MMV8_R[3])
        assert 1 <= L["grid"][0] <= -(-groups // catalog.MMV8_WARPS) and L["block"] == [catalog.MMV8_WARPS * 32]
    # the down projection fused with the combine: it follows the mmv8_q8 of its tokens' top_k rows each
    # (grid.y: the tokens), whose rows all its blocks stage (top_k x mmv8_smem(K) bytes); wpr warps a
    # row group, every row group with a warp group in the first round unless the grid is the resident
    # wave, and at the models' shapes (Qwen3-30B-A3B's, gpt-oss's) most of that wave
    fused = [i for i, L in enumerate(launches) if L["kernel"] == "moe8_down_combine_nb1"]
    assert len(fused) == 2
    for i in fused:
        L, Q8 = launches[i], launches[i - 1]
        a, q = _args(L), _args(Q8)
        N, K, top, xq, xqs, wpr = a[4], a[5], a[8], a[9], a[10], a[15]
        T = L["grid"][1]
        assert Q8["kernel"] == "mmv8_q8" and (q[2], q[5], q[6]) == (K, xq, xqs) and Q8["grid"][1] == T * top
        assert xqs == catalog.mmv8_smem(K) and L["smem"] == top * xqs
        assert catalog.MMV8_WARPS % wpr == 0 and L["block"] == [catalog.MMV8_WARPS * 32]
        groups = -(-N // catalog.MMV8_R[3])
        assert L["grid"][0] == min(-(-groups // (catalog.MMV8_WARPS // wpr)), 2 * 132 // T), (groups, wpr)
        assert L["grid"][0] * T >= 0.9 * 2 * 132, (N, top, L["grid"])
    # where the rows do not fit: the rows y of the pairs, then moe_combine of them (a block column per token)
    (C,) = by["moe_combine"]
    D = launches[launches.index(C) - 1]
    assert D["kernel"] == "moe8_gemv_nb1" and _args(C)[2:4] == _args(D)[-2:]      # y and its row stride
    assert _args(C)[5] == D["grid"][1] // C["grid"][0] and C["grid"][1] == -(-_args(C)[6] // C["block"][0])
    fills = by["moe_bucket_fill"]
    for L, F in zip(by["moe_bucket_count"], fills):
        E = _args(F)[2]
        assert L["grid"] == [E] and F["grid"] == [E]
    moes = [L for L in launches if L["kernel"].startswith(("mmq_moe_bn", "mmq8_moe_bn"))]
    assert len(moes) == 2 * len(fills)
    for i, L in enumerate(moes):
        a = _args(L)
        n, TB, mode, fill = a[4], a[17], a[18], _args(fills[i // 2])
        assert (a[14], a[15], TB) == (fill[6], fill[5], fill[7])        # tiles, list, TB of the bucketing
        assert mode == 1 - i % 2
        assert L["grid"] == [-(-n // (64 if mode else 128)) * TB]
        assert L["smem"] == L["smem_limit"]
    # prefill.cu: split_weights a thread per 32-weight unit of up to three matrices, its last
    # argument whether the low halves are written; the activation kernels a block per row, their
    # row stride the layout's width, their last argument the layout
    sw = by["split_weights"]
    assert [_args(L)[-1] for L in sw] == [1, 1, 0, 0]
    for L in sw:
        a = _args(L)
        assert L["grid"] == [-(-(a[2] + a[6] + a[10]) * (-(-a[12] // 32)) // L["block"][0])]
    for L in by["norm_split"]:
        a = _args(L)
        assert L["grid"] == [a[3]] and a[7] == ROW_WIDTH[a[-1]] * a[4]
    for L in by["act_split"]:
        a = _args(L)
        assert L["grid"] == [a[5]] and a[7] == ROW_WIDTH[a[-1]] * a[2]
    assert sorted(_args(L)[-1] for L in by["norm_split"]) == sorted(ROW_WIDTH)
    for L in by["dn_conv"]:
        a = _args(L)
        assert L["grid"] == [-(-a[9] // 128), a[8]] and L["block"] == [128]
    for L in by["dn_delta"]:
        a = _args(L)
        nv, dv, n = a[17], a[18], a[14]
        assert L["grid"] == [nv, n] and dv <= L["block"][0] <= 256
    # each chunked launch (a block per DN_CHUNK rows: each block's rows hold at most one chunked
    # segment's start; two threads a column of the state) is followed by its dk's dn_delta_k<dk> over the same rows and arguments,
    # chunk_min (the last) included: the tail runs from the state the chunks left
    chunked = [i for i, L in enumerate(launches) if L["kernel"].startswith("dn_chunk_k")]
    assert chunked
    for i in chunked:
        L, D = launches[i], launches[i + 1]
        assert D["kernel"] == L["kernel"].replace("chunk", "delta")
        assert D["args"] == L["args"]
        nv, n, dv = _args(L)[17], _args(L)[14], _args(L)[18]
        assert L["grid"] == [nv, -(-n // DN_CHUNK)] and D["grid"] == [nv, n]
        assert L["block"] == [-(-dv // 16) * 32]            # two threads a column
        assert _args(L)[-1] >= DN_CHUNK


def test_mmq_tiles_cover_the_step_within_the_devices_block(launches):
    """mmq.cu's tiles of dense projections (launch_record: Q/K/V and the fused gate / up at 5 to 64
    rows): a grid of weight tiles x K ranges x token tiles of the kernel's width covering the step's
    rows, whole K ranges; the width the smallest that holds the rows, up to the widest the device's
    block holds for the records read (dispatch.smem_limits; sm_90's plan where not tagged): on the
    99 KB device a 64-row step of fp16 records takes two 32-token tiles, of 8-bit records one of 64."""
    seen = {}
    for L in launches:
        m = re.fullmatch(r"mmq(8?)_bn(\d+)", L["kernel"])
        if m is None:
            continue
        a8, bn, a = m.group(1) == "8", int(m.group(2)), _args(L)
        K, M, mode, splits, cps = a[21], a[25], a[26], a[29], a[30]
        tiles = -(-a[2] // 64) if mode == 1 else sum(-(-n // 128) for n in (a[2], a[9], a[16]))
        assert L["grid"] == [tiles * splits * -(-M // bn)], L["kernel"]
        assert (splits - 1) * cps < -(-K // 128) <= splits * cps
        assert L["smem"] == L["smem_limit"] == catalog.mmq_smem_bytes(bn, a8)
        widest = smem_limits(L.get("smem_optin")).mmq_bn_max(a8)
        assert bn == min([b for b in catalog.MMQ_BN if M <= b <= widest] or [widest]), (L["kernel"], M, widest)
        seen[(L.get("smem_optin"), a8, M, mode)] = (bn, -(-M // bn))
    for optin in (None, 101_376):
        assert {seen[(optin, a8, M, 0)][0] for a8 in (False, True) for M in (5, 13, 29)} == {8, 16, 32}
    assert seen[(None, False, 64, 0)] == seen[(None, False, 64, 1)] == (64, 1)
    assert seen[(101_376, False, 64, 0)] == seen[(101_376, False, 64, 1)] == (32, 2)
    assert seen[(101_376, True, 64, 0)] == seen[(101_376, True, 64, 1)] == (64, 1)
