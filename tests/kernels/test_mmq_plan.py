"""Launch shapes of the batched decode projections (backends/cuda/mmq.py): the warps per block of an
mmqs.cu launch. Pure arithmetic: runs without a GPU."""

from __future__ import annotations

import pytest

mmq = pytest.importorskip("realizar_backend.backends.cuda.mmq")

SMS = 132
# qwen15's projections as mmqs launches: (16-row tiles, K)
QWEN15 = {"qkv": (128, 1536), "o": (96, 1536), "gate_up": (560, 1536), "down": (96, 8960),
          "head": (9496, 1536)}


def waves(blocks: int, warps: int) -> int:
    per_sm = mmq.SM_REGS // (mmq.SMALL_REGS * 32 * warps)
    return -(-blocks // (per_sm * SMS))


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", sorted(QWEN15))
def test_warps_fit_the_block_and_its_k(shape, groups):
    tiles, K = QWEN15[shape]
    c = mmq.small_cluster(tiles * groups, K, SMS)
    w = mmq.small_warps(tiles * groups, K, SMS, c)
    assert 1 <= w <= mmq.SMALL_MAX_WARPS
    assert w <= K // 64 // c                         # every warp keeps at least one 64-column item


def test_a_small_last_wave_is_taken_off():
    # gate/up at up to 16 rows: 560 blocks; at 4 warps a block (4 an SM) 528 fit a wave and 32 wait
    tiles, K = QWEN15["gate_up"]
    w = mmq.small_warps(tiles, K, SMS)
    assert waves(tiles, w) == 1 and w >= 3


def test_many_waves_keep_the_minimum():
    # the LM head's 9,496 blocks take many waves at any width: fewer warps only lengthen each block
    tiles, K = QWEN15["head"]
    assert mmq.small_warps(tiles, K, SMS) == mmq.SMALL_MIN_WARPS


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
