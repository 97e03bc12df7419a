"""Launch plans of the flash attention kernels (backends/cuda/flash.py): shapes, scratch sizes and
the errors a caller gets for shapes the kernels do not serve. Pure arithmetic: runs without a GPU."""

from __future__ import annotations

import pytest

flash = pytest.importorskip("realizar_backend.backends.cuda.flash")


def test_decode_plan_scratch_holds_two_combine_levels():
    p = flash.plan_decode(1, 12, 2, 128, splits=64)
    assert p.grid == (64, 2, 1) and p.threads == 128
    assert p.part_floats == 1 * 12 * 128 * (64 + 8)        # split partials, then 8 group partials
    assert p.ml_count == 12 * (64 + 8) and p.counters == 2 * (1 + 8)
    one = flash.plan_decode(256, 12, 2, 128, splits=1)
    assert one.part_floats == one.ml_count == one.counters == 0   # no splits: no scratch


def test_decode_plan_in_clusters_keeps_one_partial_per_cluster():
    p = flash.plan_decode(1, 12, 2, 128, splits=64, cluster=8)
    assert p.grid == (64, 2, 1) and p.cluster == 8
    assert p.part_floats == p.ml_count == 0                # the partials live in the counters, flagged
    # a counter per 32-dim slice of every head, then 8 cluster partials of each slice as 34 64-bit words
    assert p.counters == 12 * 4 + 2 * 12 * 4 * 8 * 34
    assert flash.plan_decode(3, 3, 1, 64, splits=32, cluster=4).counters == 18 + 2 * 18 * 8 * 34
    assert flash.plan_decode(1, 12, 2, 128, splits=1, cluster=1).counters == 0


def test_decode_cluster_waits_only_where_the_waiting_blocks_leave_room():
    one = flash.plan_decode(1, 12, 2, 128, splits=128, cluster=8)
    assert flash.decode_spins(one, 132, 2)                 # 2 waiting blocks of 8 in 264 slots
    assert flash.decode_spins(one, 64, 1)                  # 16 of 64: a quarter
    assert not flash.decode_spins(one, 63, 1)
    many = flash.plan_decode(9, 12, 2, 128, splits=64, cluster=8)
    assert not flash.decode_spins(many, 132, 2)            # 144 waiting blocks: the counter elects
    assert not flash.decode_spins(flash.plan_decode(1, 12, 2, 128, splits=64), 132, 2)   # no clusters


def test_decode_cluster_choice():
    assert flash.decode_cluster(64, True) == (64, 8)
    assert flash.decode_cluster(33, True) == (32, 8)       # two rows: splits rounded to whole clusters
    assert flash.decode_cluster(8, True) == (8, 8)
    assert flash.decode_cluster(12, True) == (8, 8)
    assert flash.decode_cluster(4, True) == (4, 4)         # 16 rows
    assert flash.decode_cluster(2, True) == (2, 1)
    assert flash.decode_cluster(1, True) == (1, 1)
    assert flash.decode_cluster(64, False) == (64, 1)      # before sm_90: the global combine


def test_prefill_plan():
    p = flash.plan_prefill(1000, 12, 128, splits=3)      # 4 warps x 2 m-tiles: 128 rows per block
    assert p.grid == (8, 12, 3) and p.kernel == "flash_prefill_d128_w4_m2_q0" and p.rows == 128
    assert p.part_floats == 3 * 1000 * 12 * 128 and p.counters == 8 * 12
    assert flash.plan_prefill(1000, 12, 128, nw=8, wm=1).grid == (8, 12, 1)
    assert flash.plan_prefill(1000, 4, 256).grid == (16, 4, 1)   # 256 dims: one m-tile per warp
    # one m-tile of q fragments in registers (<= 128 dims): the q tile shares a K/V stage
    assert flash.prefill_smem(128, wm=1) == 4 * 64 * 136 * 2
    assert flash.prefill_smem(128, wm=2) == (4 * 32 + 128) * 136 * 2
    assert flash.prefill_smem(256) == (4 * 32 + 64) * 264 * 2
    assert flash.decode_smem(128) <= 227 * 1024 and flash.prefill_smem(256, qsplit=True) <= 227 * 1024


@pytest.mark.parametrize("call,msg", [
    (lambda: flash.plan_decode(1, 34, 2, 128), "17 q heads per KV head"),
    (lambda: flash.plan_decode(1, 12, 2, 96), "head_dim 96"),
    (lambda: flash.plan_decode(1, 12, 5, 128), "do not group"),
    (lambda: flash.plan_decode(1, 12, 2, 128, splits=65), "splits must be 1..64"),
    (lambda: flash.plan_decode(1, 12, 2, 128, splits=136, cluster=8), "splits must be 1..128 in clusters"),
    (lambda: flash.plan_decode(1, 12, 2, 128, splits=12, cluster=8), "divide the 12 splits"),
    (lambda: flash.plan_decode(1, 12, 2, 128, splits=48, cluster=16), "one of"),
    (lambda: flash.plan_prefill(10, 12, 128, splits=9), "splits must be 1..8"),
    (lambda: flash.plan_prefill(10, 12, 64, nw=8), "no variant with 8 warps"),
    (lambda: flash.plan_prefill(10, 4, 256, wm=2), "2 m-tiles for head_dim 256"),
])
def test_bad_shapes_are_refused(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_split_policy():
    sm = 132
    assert flash.decode_splits(1, 2, sm) == 64            # one long row still fills the GPU
    assert flash.decode_splits(16, 2, sm) == 4            # about one block per SM
    assert flash.decode_splits(64, 2, sm) == 1
    assert flash.decode_splits(256, 2, sm) == 1           # the rows alone fill it
    # in clusters, one row may take two blocks per SM, beyond the global combine's 64
    assert flash.decode_splits(1, 2, sm, clusters=True) == 128
    assert flash.decode_cluster(128, True) == (128, 8)
    assert flash.decode_splits(2, 2, sm, clusters=True) == flash.decode_splits(2, 2, sm) == 33
    assert flash.decode_splits(16, 2, sm, clusters=True) == 4
    assert flash.decode_splits(1, 3, sm, clusters=True) == 44       # 3 x 64 blocks would not fit one wave
    p = flash.plan_decode(1, 12, 2, 128, splits=128, cluster=8)
    assert p.grid == (128, 2, 1) and p.cluster == 8
    assert flash.prefill_splits(16384, 12, 16384, sm) == 1
    assert flash.prefill_splits(512, 12, 16384, sm) == 6  # a 512-token chunk deep in a long prompt
    assert flash.prefill_splits(512, 12, 512, sm) == 1    # ... but not at its start


def test_flash_takes_the_head_sizes_whose_blocks_fit_the_device():
    """flash.fits (forward.py: the flash kernels where a head size's default plans fit the device's
    block, else attention.cu's): every head size on sm_90; on sm_80 the 256-dim decode block (165.5 KB)
    does not fit; a 99 KB block (sm_86, sm_89) holds the prompt plans of 64 and 128 dims and the
    decode plan of 64 only."""
    from support.devices import SMEM_OPTIN

    def takes(arch):
        o = SMEM_OPTIN[arch]
        return {D: (flash.fits(flash.plan_prefill(1, 8, D).smem, o), flash.fits(flash.decode_smem(D), o))
                for D in flash.HEAD_DIMS}
    assert takes("sm_90") == {64: (True, True), 128: (True, True), 256: (True, True)}
    assert takes("sm_80") == {64: (True, True), 128: (True, True), 256: (True, False)}
    assert takes("sm_86") == {64: (True, True), 128: (True, False), 256: (False, False)}
    assert flash.fits(10 ** 6, None)
