"""Eviction policies: LRU/FIFO/LFU ordering, the hybrid keep-score's ingredients, Belady's MIN."""

from __future__ import annotations

import random

import pytest

from loraplex.cache.controller import TierController
from loraplex.cache.policy import (
    POLICIES,
    AdapterInfo,
    EvictionPolicy,
    HybridPolicy,
    LRUPolicy,
    belady_hit_ratio,
    belady_hits,
    make_policy,
)

MiB = 1 << 20


def info(
    key: str, size: int = 16 * MiB, priority: int = 0, tenant: str | None = "t"
) -> AdapterInfo:
    return AdapterInfo(key=key, size_bytes=size, tenant=tenant, priority=priority, rank=16)


def access(p: EvictionPolicy, key: str, now: float, **kw: object) -> None:
    p.on_access(key, info(key, **kw), now)  # type: ignore[arg-type]


class SlotCache:
    """``n`` device slots under ``policy`` (the simulator's flat tiers), admitting through the
    cache's own path: a request that misses takes a slot (evicting by policy), then leaves it."""

    def __init__(self, policy: EvictionPolicy, n: int) -> None:
        self.now = 0.0
        self.tiers = TierController(
            policy, slots=n, clock=lambda: self.now, host_tier=False, names=("L0", "L1", "L2")
        )

    def request(self, key: str, now: float) -> bool:
        """One request on ``key`` at ``now`` (the policy is told first); whether it hit."""
        self.now = now
        self.tiers.policy.on_access(key, info(key), now)
        hit = self.tiers.device.lookup(key, now)
        got = self.tiers.reserve_slot(info(key))
        assert got is not None
        self.tiers.release_slot(got[0])
        return hit


# ------------------------------------------------------------------------------ basics


def test_adapter_info_validates() -> None:
    with pytest.raises(ValueError, match="key"):
        AdapterInfo(key="", size_bytes=1)
    with pytest.raises(ValueError, match="size_bytes"):
        AdapterInfo(key="a", size_bytes=-1)
    a = AdapterInfo(key="a", size_bytes=3)
    assert (a.tenant, a.priority, a.rank) == (None, 0, 0)
    with pytest.raises(AttributeError):
        a.size_bytes = 4  # type: ignore[misc]


def test_make_policy_registry() -> None:
    for name in ("lru", "hybrid", "lfu", "fifo"):
        p = make_policy(name)
        assert p.name == name
        assert isinstance(p, EvictionPolicy)
    assert make_policy(" LRU ").name == "lru"
    assert set(POLICIES) == {"lru", "hybrid", "hybrid-forecast", "lfu", "fifo"}
    with pytest.raises(
        ValueError, match=r"unknown eviction policy 'arc'.*fifo, hybrid, hybrid-forecast, lfu, lru"
    ):
        make_policy("arc")
    h = make_policy("hybrid", half_lives_s=(5.0,), priority_base=3.0)
    assert isinstance(h, HybridPolicy)
    assert h.half_lives_s == (5.0,) and h.priority_base == 3.0
    with pytest.raises(ValueError, match="half_lives_s"):
        make_policy("hybrid", half_lives_s=(0.0,))


def test_lru_orders_by_last_access() -> None:
    p = LRUPolicy()
    for t, k in enumerate("abcab"):
        access(p, k, float(t))
    # last accesses: c=2, a=3, b=4
    assert p.order_victims(["a", "b", "c"], "L0", 10.0) == ["c", "a", "b"]
    access(p, "c", 11.0)
    assert p.order_victims(["a", "b", "c"], "L0", 12.0) == ["a", "b", "c"]
    # a key the policy never saw is the first victim
    assert p.order_victims(["a", "zz"], "L0", 12.0)[0] == "zz"


def test_fifo_orders_by_insertion_per_tier() -> None:
    p = make_policy("fifo")
    for t, k in enumerate("abc"):
        p.on_insert(k, info(k), "L0", float(t))
    p.on_insert("a", info("a"), "L1", 5.0)
    p.on_insert("c", info("c"), "L1", 1.0)
    access(p, "a", 9.0)  # recency does not matter to FIFO
    assert p.order_victims(["a", "b", "c"], "L0", 10.0) == ["a", "b", "c"]
    assert p.order_victims(["a", "c"], "L1", 10.0) == ["c", "a"]
    p.on_evict("a", "L0", 11.0)
    p.on_insert("a", info("a"), "L0", 12.0)
    assert p.order_victims(["a", "b", "c"], "L0", 13.0) == ["b", "c", "a"]


def test_lfu_orders_by_count_then_recency() -> None:
    p = make_policy("lfu")
    for t, k in enumerate("aaabbc"):
        access(p, k, float(t))
    access(p, "d", 10.0)
    assert p.order_victims(["a", "b", "c", "d"], "L0", 11.0) == ["c", "d", "b", "a"]


# ------------------------------------------------------------------------------ hybrid


def test_hybrid_frequent_beats_recent_one_off() -> None:
    p = HybridPolicy()
    for i in range(20):
        access(p, "hot", float(i))
    access(p, "cold", 30.0)  # more recent, but once
    assert p.order_victims(["hot", "cold"], "L0", 31.0) == ["cold", "hot"]
    assert p.rate("hot", 31.0) > 5 * p.rate("cold", 31.0)


def test_hybrid_recency_breaks_equal_frequency() -> None:
    p = HybridPolicy()
    access(p, "old", 0.0)
    access(p, "new", 5.0)
    assert p.order_victims(["new", "old"], "L0", 6.0) == ["old", "new"]


def test_hybrid_old_hot_key_fades() -> None:
    """A formerly hot adapter does not squat forever: decayed counts let a new steady one win."""
    p = HybridPolicy(half_lives_s=(10.0, 100.0))
    for i in range(100):
        access(p, "was-hot", i * 0.1)  # 100 requests in the first 10 s
    for i in range(60):
        access(p, "now-hot", 1000.0 + i)  # 1 req/s for a minute, long after
    assert p.order_victims(["was-hot", "now-hot"], "L0", 1060.0) == ["was-hot", "now-hot"]


def test_hybrid_priority_multiplies() -> None:
    p = HybridPolicy(priority_base=2.0)
    for i in range(10):
        access(p, "batch", float(i))
    for i in range(6):
        access(p, "interactive", float(i), priority=1)
    # rate 10 vs 6 * 2: the higher SLO class is kept
    assert p.order_victims(["interactive", "batch"], "L0", 10.0) == ["batch", "interactive"]
    p0 = HybridPolicy(priority_base=1.0)  # priority ignored
    for i in range(10):
        access(p0, "batch", float(i))
    for i in range(6):
        access(p0, "interactive", float(i), priority=1)
    assert p0.order_victims(["interactive", "batch"], "L0", 10.0) == ["interactive", "batch"]


def test_hybrid_measured_reload_cost() -> None:
    p = HybridPolicy()
    for k in ("slow", "fast"):
        access(p, k, 0.0)
        p.on_insert(k, info(k), "L1", 0.0)
    p.record_load_cost("L1", "slow", 2.0)
    p.record_load_cost("L1", "fast", 0.01)
    assert p.order_victims(["slow", "fast"], "L1", 1.0) == ["fast", "slow"]
    assert p.load_cost("slow", "L1") == pytest.approx(2.0)
    # EWMA moves towards new measurements
    p.record_load_cost("L1", "slow", 0.0)
    assert 0.0 < p.load_cost("slow", "L1") < 2.0
    # an unmeasured key falls back to the tier's seconds per byte
    access(p, "new", 0.0)
    assert p.load_cost("new", "L1") == pytest.approx(p._cost["L1"].per_byte.value * 16 * MiB)


def test_hybrid_size_and_cost_matter_only_on_byte_tiers() -> None:
    p = HybridPolicy()
    p.on_access("big", info("big", size=256 * MiB), 0.0)
    p.on_access("small", info("small", size=8 * MiB), 0.0)
    # equal rates; default cost = 5 ms + size / 1 GB/s: the big one frees more per second lost
    assert p.order_victims(["small", "big"], "L1", 1.0, by_bytes=True) == ["big", "small"]
    # a slot is a slot: size and cost are ignored, the less recently used goes
    p.on_access("big", info("big", size=256 * MiB), 0.5)
    assert p.order_victims(["small", "big"], "L0", 1.0, by_bytes=False) == ["small", "big"]
    p.on_access("small", info("small", size=8 * MiB), 0.6)
    assert p.order_victims(["small", "big"], "L0", 1.0, by_bytes=False) == ["big", "small"]
    p.record_load_cost("L0", "big", 5.0)
    assert p.order_victims(["small", "big"], "L0", 1.0, by_bytes=False) == ["big", "small"]
    # ... unless slots are told to weigh their reload cost
    q = HybridPolicy(slot_cost_exponent=1.0)
    for k, size in (("big", 256 * MiB), ("small", 8 * MiB)):
        q.on_access(k, info(k, size=size), 0.0)
    assert q.order_victims(["small", "big"], "L0", 1.0, by_bytes=False) == ["small", "big"]


def test_hybrid_reload_cost_counts_the_tiers_below() -> None:
    """Evicting from host memory an adapter that is still on local disk is cheap; prefer it."""
    p = HybridPolicy(tier_order=("L0", "L1", "L2"))
    for k in ("backed", "alone"):
        access(p, k, 0.0)
        p.on_insert(k, info(k), "L1", 0.0)
        p.record_load_cost("L0", k, 0.003)
        p.record_load_cost("L1", k, 0.02)
        p.record_load_cost("L2", k, 1.0)
    p.on_insert("backed", info("backed"), "L2", 0.0)
    assert p.reload_cost("backed", "L1") == pytest.approx(0.02)
    assert p.reload_cost("alone", "L1") == pytest.approx(1.02)
    assert p.reload_cost("alone", "L0") == pytest.approx(0.003)  # its host copy is right below
    assert p.order_victims(["alone", "backed"], "L1", 1.0)[0] == "backed"
    p.on_evict("backed", "L2", 2.0)
    p.on_insert("alone", info("alone"), "L2", 2.0)
    assert p.order_victims(["alone", "backed"], "L1", 3.0)[0] == "alone"


def test_hybrid_ghost_statistics_survive_eviction() -> None:
    p = HybridPolicy()
    for i in range(30):
        access(p, "a", float(i))
    p.on_insert("a", info("a"), "L0", 0.0)
    p.on_evict("a", "L0", 30.0)
    assert "L0" not in p.resident_tiers("a")
    access(p, "a", 31.0)  # comes back: its history is intact
    access(p, "b", 31.0)
    assert p.rate("a", 31.0) > 10 * p.rate("b", 31.0)


def test_policy_state_is_bounded() -> None:
    for name in POLICIES:
        p = make_policy(name, max_tracked=100)
        p.on_insert("pinned-resident", info("pinned-resident"), "L0", 0.0)
        for i in range(1000):
            access(p, f"k{i}", float(i))
        assert len(p._info) <= 101, name  # type: ignore[attr-defined]
        assert "pinned-resident" in p._info, name  # residents are never forgotten


def test_hybrid_inline_order_matches_keep_score() -> None:
    rng = random.Random(1)
    p = HybridPolicy(tier_order=("L0", "L1"))
    keys = [f"k{i}" for i in range(40)]
    for t in range(400):
        k = rng.choice(keys[: rng.randint(1, 40)])
        p.on_access(k, info(k, size=rng.choice([8, 16, 64]) * MiB, priority=rng.randint(0, 2)), t)
        if rng.random() < 0.3:
            p.on_insert(k, info(k), rng.choice(["L0", "L1"]), t)
            p.record_load_cost(rng.choice(["L0", "L1"]), k, rng.random())
    for by_bytes in (True, False):
        got = p.order_victims(keys, "L0", 401.0, by_bytes=by_bytes)
        scores = [p.keep_score(k, "L0", 401.0, by_bytes=by_bytes) for k in got]
        assert sorted(got) == sorted(keys)
        assert scores == sorted(scores)


def test_hybrid_keeps_hot_set_through_a_burst() -> None:
    """Hot adapters requested steadily stay resident while 500 one-off adapters stream through."""
    for name, expect_kept in (("hybrid", True), ("lru", False)):
        request = SlotCache(make_policy(name), 4).request
        t = 0.0

        for _ in range(20):  # warm-up: the hot set is used
            for h in ("h1", "h2", "h3"):
                t += 0.1
                request(h, t)
        hot_hits = hot_total = 0
        for i in range(500):  # the burst, with the hot set still used every 10th request
            t += 0.01
            request(f"cold{i}", t)
            if i % 10 == 0:
                hot_total += 1
                hot_hits += request(("h1", "h2", "h3")[(i // 10) % 3], t)
        assert (hot_hits == hot_total) is expect_kept, (name, hot_hits, hot_total)


# ------------------------------------------------------------------------------ Belady


def test_belady_textbook_trace() -> None:
    # 1 2 3 4 1 2 5 1 2 3 4 5 with 3 frames: OPT has 7 faults (Silberschatz et al.)
    trace = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
    hits = belady_hits(trace, 3)
    assert hits == [False] * 4 + [True, True, False, True, True, False, False, True]
    assert belady_hit_ratio(trace, 3) == pytest.approx(5 / 12)
    # with 4 frames: 6 faults
    assert belady_hits(trace, 4).count(False) == 6
    assert belady_hit_ratio([], 3) == 0.0


def test_belady_beats_online_policies() -> None:
    rng = random.Random(0)
    trace = [f"k{min(int(rng.paretovariate(1.0)), 60)}" for _ in range(3000)]
    best = belady_hit_ratio(trace, 5)
    for name in POLICIES:
        cache = SlotCache(make_policy(name), 5)
        hits = sum(cache.request(k, float(t)) for t, k in enumerate(trace))
        assert hits / len(trace) <= best + 1e-12, name


def test_belady_bytes_heuristic() -> None:
    keys = ["a", "b", "a", "c", "b", "a"]
    sizes = [4, 4, 4, 8, 4, 4]
    # capacity 8: c (8 bytes) evicts a (used farthest away) and then b, to fit
    hits = belady_hits(keys, sizes=sizes, capacity_bytes=8)
    assert hits == [False, False, True, False, False, False]
    # a key bigger than the capacity is never admitted
    assert belady_hits(["x", "x"], sizes=[9, 9], capacity_bytes=8) == [False, False]
    with pytest.raises(ValueError, match="capacity"):
        belady_hits(keys)
    with pytest.raises(ValueError, match="sizes"):
        belady_hits(keys, capacity_bytes=8)
