"""The KV block manager on its own: allocation, growth, freeing, prefix sharing, LRU eviction."""

import random

import pytest

from realizar_backend.engine.kv_manager import KVManager


def toks(ids):
    """A sequence's token accessor, as the scheduler gives one: (start, end) -> tokens."""
    return lambda a, b: ids[a:b]


def test_blocks_are_taken_at_boundaries_and_all_come_back():
    kv = KVManager(num_blocks=8, block_size=4)
    ids = list(range(100, 110))
    assert kv.allocate("a", toks(ids), 10) == 0
    assert len(kv.table("a")) == 3 and kv.used_blocks == 3 and kv.used_tokens == 10
    assert kv.append("a", 12) and len(kv.table("a")) == 3          # position 11: still block 2
    assert kv.append("a", 13) and len(kv.table("a")) == 4          # position 12: a new block
    assert len(set(kv.table("a"))) == 4
    kv.allocate("b", toks(list(range(7))), 7)
    assert kv.used_blocks == 6 and kv.usage == pytest.approx(6 / 8)
    assert set(kv.table("a")).isdisjoint(kv.table("b"))
    kv.free("a")
    kv.free("b")
    kv.free("b")                                                    # a second free is a no-op
    assert kv.used_blocks == 0 and kv.used_tokens == 0 and kv.num_free == 8


def test_a_full_pool_refuses_without_changing_anything():
    kv = KVManager(num_blocks=4, block_size=4, prefix_caching=False)
    kv.allocate("a", toks(list(range(12))), 12)
    assert not kv.can_allocate(toks(list(range(8))), 8)
    with pytest.raises(MemoryError):
        kv.allocate("b", toks(list(range(8))), 8)
    assert not kv.holds("b") and kv.used_blocks == 3
    assert kv.append("a", 16)
    assert not kv.append("a", 17)
    assert len(kv.table("a")) == 4 and kv.used_tokens == 16


def test_a_shared_prefix_is_computed_once_and_never_the_last_token():
    kv = KVManager(num_blocks=16, block_size=4)
    base = list(range(1, 14))                    # 13 tokens: 3 full blocks
    kv.allocate("a", toks(base), 13)
    # nothing is shared before it is computed
    assert kv.allocate("early", toks(base), 13) == 0
    kv.free("early")
    kv.commit("a", toks(base), 13)
    assert kv.cached_blocks == 3
    other = base[:10] + [99, 98, 97]             # shares 2 full blocks and half of the third
    assert kv.allocate("b", toks(other), 13) == 8
    assert kv.table("b")[:2] == kv.table("a")[:2] and kv.table("b")[2] != kv.table("a")[2]
    # the same 12-token prompt: 3 blocks are cached, but the last token must run for its logits
    assert kv.allocate("c", toks(base[:12]), 12) == 8
    assert kv.allocate("d", toks(base), 13) == 12
    assert kv.queried_tokens == 13 + 13 + 13 + 12 + 13 and kv.hit_tokens == 8 + 8 + 12
    # a shared block counts once in the token usage
    assert kv.used_tokens == 13 * 3 + 12 - (3 + 3 + 1) * 4     # blocks 0, 1: 4 holders; 2: 2
    # blocks the same tokens hold after a different prefix are not the same blocks
    shifted = [0] + base
    assert kv.allocate("e", toks(shifted), 14) == 0


def test_shared_blocks_outlive_one_owner_and_freed_ones_stay_cached():
    kv = KVManager(num_blocks=6, block_size=4)
    ids = list(range(50, 59))                    # 9 tokens: 2 full blocks
    kv.allocate("a", toks(ids), 9)
    kv.commit("a", toks(ids), 9)
    assert kv.allocate("b", toks(ids), 9) == 8
    shared = kv.table("a")[:2]
    kv.free("a")
    # still held by b: not free, and not handed to anyone else
    assert kv.num_free == 3
    kv.allocate("c", toks(list(range(8))), 8)
    assert set(kv.table("c")).isdisjoint(shared)
    kv.free("c")
    kv.free("b")
    assert kv.used_blocks == 0
    # freed, but their prefix is still there for the next request
    assert kv.allocate("d", toks(ids), 9) == 8 and kv.table("d")[:2] == shared


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed():
    kv = KVManager(num_blocks=6, block_size=2)
    old, new = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]     # 2 full blocks each + a partial one
    for name, ids in (("old", old), ("new", new)):
        kv.allocate(name, toks(ids), 5)
        kv.commit(name, toks(ids), 5)
        kv.free(name)                                 # "old" freed first
    assert kv.cached_blocks == 4
    # 2 blocks: the two partial (uncached) blocks go first, every prefix survives
    kv.allocate("x", toks([0, 0, 0]), 3)
    assert kv.cached_blocks == 4
    # 2 more: the least recently freed prefix goes, the newer one stays
    kv.allocate("y", toks([0, 0, 0]), 3)
    assert kv.cached_blocks == 2
    kv.free("x")
    kv.free("y")
    assert kv.allocate("n", toks(new), 5) == 4
    assert kv.allocate("o", toks(old), 5) == 0


def test_eviction_goes_from_a_prefix_tail_first():
    kv = KVManager(num_blocks=4, block_size=2)
    ids = [1, 2, 3, 4, 5, 6, 7]                      # 3 full blocks
    kv.allocate("a", toks(ids), 7)
    kv.commit("a", toks(ids), 7)
    kv.free("a")
    kv.allocate("x", toks([0] * 4), 4)             # the partial block, then the prefix's last
    kv.free("x")
    assert kv.allocate("b", toks(ids), 7) == 4     # the first two blocks are still cached


def test_prefix_caching_off_shares_nothing_and_counts_nothing():
    kv = KVManager(num_blocks=8, block_size=4, prefix_caching=False)
    ids = list(range(12))
    kv.allocate("a", toks(ids), 12)
    kv.commit("a", toks(ids), 12)
    assert kv.allocate("b", toks(ids), 12) == 0
    assert set(kv.table("a")).isdisjoint(kv.table("b"))
    assert kv.queried_tokens == kv.hit_tokens == 0 and kv.cached_blocks == 0


def test_random_traffic_never_hands_out_a_block_in_use():
    """Random allocate / grow / commit / free over a small vocabulary (so prefixes repeat): at
    every point a block is either free or held, its holders are exactly the tables that name
    it, a block in two tables is a full cached one, and the usage figures add up."""
    rng = random.Random(7)
    kv = KVManager(num_blocks=24, block_size=4)
    live: dict[int, list[int]] = {}          # seq -> its tokens so far
    computed: dict[int, int] = {}
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            if kv.can_allocate(toks(prompt), len(prompt)):
                hit = kv.allocate(next_id, toks(prompt), len(prompt))
                assert hit % 4 == 0 and hit < len(prompt)
                live[next_id], computed[next_id] = prompt, hit
                next_id += 1
            else:
                with pytest.raises(MemoryError):
                    kv.allocate(-1, toks(prompt), len(prompt))
        elif op < 0.75 and live:
            s = rng.choice(list(live))
            ids = live[s]
            computed[s] = len(ids)                # the prompt (or the step) ran
            kv.commit(s, toks(ids), computed[s])
            if kv.append(s, len(ids) + 1):
                ids.append(rng.randrange(3))
        elif live:
            s = rng.choice(list(live))
            kv.free(s)
            del live[s], computed[s]
        holders: dict[int, int] = {}
        for s in live:
            t = kv.table(s)
            assert len(t) == len(set(t)) == kv.blocks_for(len(live[s]))
            for b in t:
                holders[b] = holders.get(b, 0) + 1
        free = set(kv._free)
        assert free.isdisjoint(holders) and len(free) + len(holders) == kv.num_blocks
        for b, n in holders.items():
            assert kv._ref[b] == n
            if n > 1:
                assert kv._key[b] is not None
        assert kv.used_blocks == len(holders)
        assert kv.used_tokens == sum(len(v) for v in live.values()) - 4 * sum(n - 1 for n in holders.values())
    for s in list(live):
        kv.free(s)
    assert kv.used_blocks == 0 and kv.used_tokens == 0 and kv.hit_tokens > 0
