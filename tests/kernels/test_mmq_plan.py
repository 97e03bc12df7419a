"""Launch shapes of the batched decode projections (backends/cuda/mmq.py): the warps per block of an
mmqs.cu launch; mmq.cu's token tiles and K split on each device's shared memory a block (the plans
of tests/support/mmq_plans.py, a process of its own: mmq.py imports CuPy). Pure arithmetic: runs
without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.host_emu import ROOT

try:
    from realizar_backend.backends.cuda import mmq
except ImportError:            # no CuPy: the plans' checks read mmq_plans.py's output only
    mmq = None
needs_cupy = pytest.mark.skipif(mmq is None, reason="CuPy not installed")

SMS = 132
# qwen15's projections as mmqs launches: (16-row tiles, K)
QWEN15 = {"qkv": (128, 1536), "o": (96, 1536), "gate_up": (560, 1536), "down": (96, 8960),
          "head": (9496, 1536)}


def waves(blocks: int, warps: int) -> int:
    per_sm = mmq.SM_REGS // (mmq.SMALL_REGS * 32 * warps)
    return -(-blocks // (per_sm * SMS))


@needs_cupy
@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", sorted(QWEN15))
def test_warps_fit_the_block_and_its_k(shape, groups):
    tiles, K = QWEN15[shape]
    c = mmq.small_cluster(tiles * groups, K, SMS)
    w = mmq.small_warps(tiles * groups, K, SMS, c)
    assert 1 <= w <= mmq.SMALL_MAX_WARPS
    assert w <= K // 64 // c                         # every warp keeps at least one 64-column item


@needs_cupy
def test_a_small_last_wave_is_taken_off():
    # gate/up at up to 16 rows: 560 blocks; at 4 warps a block (4 an SM) 528 fit a wave and 32 wait
    tiles, K = QWEN15["gate_up"]
    w = mmq.small_warps(tiles, K, SMS)
    assert waves(tiles, w) == 1 and w >= 3


@needs_cupy
def test_many_waves_keep_the_minimum():
    # the LM head's 9,496 blocks take many waves at any width: fewer warps only lengthen each block
    tiles, K = QWEN15["head"]
    assert mmq.small_warps(tiles, K, SMS) == mmq.SMALL_MIN_WARPS


@needs_cupy
def test_one_wave_launches_keep_their_warps():
    for shape in ("qkv", "o"):
        tiles, K = QWEN15[shape]
        assert mmq.small_warps(tiles, K, SMS) == mmq.SMALL_MAX_WARPS


@pytest.mark.parametrize("K", [256, 512, 576, 896, 1024, 1536, 2048, 2304, 3584, 8960])
@pytest.mark.parametrize("wpr", [1, 2, 4])
def test_ffnf_lane_groups_never_leave_more_lanes_idle(K, wpr):
    """ffnf launches take half-warp row groups only where a row's passes then leave fewer lanes
    idle (K = 1536: 48 units fill three passes of 16 lanes, against a full and a half-empty pass
    of 32), and only for groups of one warp (the kernel reduces half-warps within their warp)."""
    ops = pytest.importorskip("realizar_backend.backends.cuda.ops")
    nu = K // 32
    lpg = ops.ffnf_lanes(K, wpr)
    assert lpg in (16, 32)
    if lpg == 16:
        assert wpr == 1
    idle = (-nu) % lpg
    assert idle <= (-nu) % 32
    if K == 1536 and wpr == 1:
        assert lpg == 16 and idle == 0


# ---------------------------------------------------------------- mmq.cu's tiles on each device
TODAY_BN = (8, 16, 32, 64)        # sm_80 / sm_90's widths: the smallest that holds M, else 64
FIELDS = ("M", "shape", "bn", "tiles", "token_tiles", "splits", "cps", "partial_floats", "counters")


@pytest.fixture(scope="module")
def plans() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "mmq_plans.py")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    out["plans"] = [dict(zip(FIELDS, p)) for p in out.pop("today")]
    for dev in out["devices"].values():
        for kind in ("fp16", "a8"):
            dev[kind]["plans"] = [dict(zip(FIELDS, p)) for p in dev[kind]["plans"]]
    return out


def test_sm_80_and_sm_90_plan_as_today(plans):
    """Blocks of 163 KB and more hold every tile: each plan of 1 to 256 rows, either kind of records,
    is the plan without a limit, whose width is the smallest that holds M, else 64."""
    today = plans["plans"]
    for p in today:
        assert p["bn"] == next((b for b in TODAY_BN if b >= p["M"]), 64)
        assert p["token_tiles"] == -(-p["M"] // p["bn"])
    for arch in ("sm_80", "sm_90"):
        for kind in ("fp16", "a8"):
            dev = plans["devices"][arch][kind]
            assert dev["bn_max"] == 64 and dev["plans"] == today, (arch, kind)
            assert dev["scratch"] == plans["scratch_today"]


def test_a_99_kb_block_takes_no_tile_it_cannot_hold(plans):
    """sm_86 / sm_89 (99 KB a block): no plan's tile, fp16 or 8-bit records, needs more dynamic shared
    memory than the block holds beside the static reserve; the fp16 records' 64-row steps take two
    32-token tiles (their 64-token tile needs 110 KB), the 8-bit records' keep one of 64, and rows up
    to 32 plan as today."""
    from realizar_backend.backends.cuda.dispatch import SMEM_STATIC_RESERVE
    today = {(p["M"], p["shape"]): p for p in plans["plans"]}
    for arch in ("sm_86", "sm_89"):
        dev = plans["devices"][arch]
        room = dev["optin"] - SMEM_STATIC_RESERVE
        assert plans["smem"]["64"][0] > dev["optin"]          # the fp16 records' 64-token tile
        for kind, a8 in (("fp16", 0), ("a8", 1)):
            for p in dev[kind]["plans"]:
                assert plans["smem"][str(p["bn"])][a8] <= room, (arch, kind, p)
                assert p["bn"] <= dev[kind]["bn_max"] and p["token_tiles"] * p["bn"] >= p["M"]
                assert p["bn"] == min(b for b in TODAY_BN if b >= min(p["M"], dev[kind]["bn_max"]))
                if p["M"] <= 32 or a8:
                    assert p == today[(p["M"], p["shape"])], (arch, kind, p)
        assert dev["fp16"]["bn_max"] == 32 and dev["a8"]["bn_max"] == 64
        for p in dev["fp16"]["plans"]:
            if p["M"] == 64:
                assert (p["bn"], p["token_tiles"]) == (32, 2), p
            if p["M"] > 32:
                assert p["bn"] == 32 and p["token_tiles"] == -(-p["M"] // 32)


def test_the_scratch_covers_every_plan_of_its_limit(plans):
    """need_scratch under a device's limit holds the partial sums and counters of every plan of each
    shape made under it; sized under another limit it need not (Qwen2.5-1.5B's Q/K/V: 32-token tiles
    are more token tiles, each with its counter), so the scratch and the launches take the same limit."""
    for arch, dev in plans["devices"].items():
        for kind in ("fp16", "a8"):
            for p in dev[kind]["plans"]:
                part, cnt = dev[kind]["scratch"][p["shape"]]
                assert p["partial_floats"] <= part and p["counters"] <= cnt, (arch, kind, p)
    qkv = [p for p in plans["devices"]["sm_86"]["fp16"]["plans"] if p["shape"] == 0]
    assert max(p["counters"] for p in qkv) > plans["scratch_today"][0][1]
