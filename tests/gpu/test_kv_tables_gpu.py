"""Block tables reach the device as the engine set them: several slots in one copy (set_tables),
appends, a shorter replacement and untouched rows in between; a bad entry changes nothing."""

from types import SimpleNamespace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from realizar_backend.backends.cuda.kv_cache import KVCache  # noqa: E402


@pytest.fixture
def kv():
    cfg = SimpleNamespace(n_layers=2, kv_layers=(0, 1), n_kv_heads=2, head_dim=64, recurrent=())
    cache = KVCache(cfg, num_blocks=200, block_size=16, max_slots=9, max_context=300)   # 19 blocks a row
    yield cache
    cache.close()


def device_rows(kv):
    cupy.cuda.get_current_stream().synchronize()
    return cupy.asnumpy(kv.tables)


def test_several_tables_in_one_copy(kv, rng):
    stream = cupy.cuda.Stream(non_blocking=True)
    want = np.full((kv.max_slots + 1, kv.max_blocks), kv.scratch_block, np.int32)
    tables = {s: rng.choice(kv.num_blocks, size=n, replace=False) for s, n in ((0, 4), (2, 19), (3, 6), (7, 10))}
    kv.set_tables(tables, stream)
    for s, t in tables.items():
        want[s, :t.size] = t
    stream.synchronize()
    np.testing.assert_array_equal(device_rows(kv), want)
    assert all(kv.covered[s] == t.size * kv.block_size for s, t in tables.items())

    # growth of two rows far apart (the rows between keep their tables), a new slot, and a
    # shorter table (its entries past the new end are never read: only `covered` changes)
    grow = {0: np.array([tables[0][0], 5]), 3: np.append(tables[3], 199), 7: tables[7][:3], 8: np.array([9, 10, 11])}
    kv.set_tables(grow, stream)
    for s, t in grow.items():
        want[s, :t.size] = t
    stream.synchronize()
    got = device_rows(kv)
    np.testing.assert_array_equal(got, want)
    assert kv.covered[7] == 3 * kv.block_size and kv.covered[8] == 3 * kv.block_size

    # a bad entry anywhere in the batch raises before anything changes
    covered = kv.covered.copy()
    with pytest.raises(ValueError, match="block ids"):
        kv.set_tables({1: [1, 2], 4: [kv.num_blocks]}, stream)
    with pytest.raises(ValueError, match="out of range"):
        kv.set_tables({1: [1, 2], kv.max_slots: [3]}, stream)
    np.testing.assert_array_equal(device_rows(kv), want)
    np.testing.assert_array_equal(kv.covered, covered)


def test_uploads_queued_behind_work_land_in_order(kv, rng):
    """More uploads than a few pinned staging copies, queued behind work still running on the
    stream (as the engine's are, behind a decode step in flight): every one lands, in order."""
    stream = cupy.cuda.Stream(non_blocking=True)
    want = np.full((kv.max_slots + 1, kv.max_blocks), kv.scratch_block, np.int32)
    a = cupy.asarray(rng.standard_normal((2048, 2048), dtype=np.float32))
    with stream:
        for _ in range(8):                     # tens of milliseconds of work ahead of the copies
            a = a @ a
            a /= cupy.linalg.norm(a)
    tables = {s: [] for s in range(kv.max_slots)}
    for step in range(kv.max_blocks):          # every slot grows by one block a step, as in decode
        for s in tables:
            tables[s].append(int(rng.integers(0, kv.num_blocks)))
        kv.set_tables({s: list(t) for s, t in tables.items()}, stream)
    for s, t in tables.items():
        want[s, :len(t)] = t
    stream.synchronize()
    np.testing.assert_array_equal(device_rows(kv), want)
