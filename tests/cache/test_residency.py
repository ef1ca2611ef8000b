"""TierIndex: hard constraints around any policy, two-phase admission, counters."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from loraplex.cache.policy import POLICIES, AdapterInfo, LRUPolicy, make_policy
from loraplex.cache.residency import AdmissionDeferred, NoRoomError, ResidencyError, TierIndex

MiB = 1 << 20


def info(key: str, size: int = 10, tenant: str | None = "t", priority: int = 0) -> AdapterInfo:
    return AdapterInfo(key=key, size_bytes=size, tenant=tenant, priority=priority)


def slots(n: int, **kw: object) -> TierIndex:
    return TierIndex("L0", capacity_bytes=None, capacity_count=n, policy=LRUPolicy(), **kw)  # type: ignore[arg-type]


def fill(tier: TierIndex, keys: Sequence[str], t0: float = 0.0, **kw: object) -> float:
    t = t0
    for k in keys:
        t += 1.0
        tier.policy.on_access(k, info(k, **kw), t)  # type: ignore[arg-type]
        tier.admit(info(k, **kw), t)  # type: ignore[arg-type]
    return t


# ------------------------------------------------------------------------------ basics


def test_admission_follows_policy_and_counts() -> None:
    tier = slots(3)
    t = fill(tier, "abc")
    assert tier.count == 3 and tier.used_bytes == 30
    tier.policy.on_access("a", info("a"), t + 1)
    assert tier.lookup("a", t + 1) is True
    assert tier.lookup("zz", t + 1) is False
    assert tier.plan_admission(info("d"), t + 2) == ["b"]  # LRU: b is the oldest now
    assert tier.contains("b")  # planning changes nothing
    assert tier.commit_admission(info("d"), ["b"], t + 2) == ["b"]
    assert sorted(tier.entries()) == ["a", "c", "d"]
    c = tier.counters
    assert (c.hits, c.misses, c.inserts, c.evictions) == (1, 1, 4, 1)
    assert c.hit_ratio == 0.5
    # already resident: nothing to evict, commit is a hit
    assert tier.plan_admission(info("a"), t + 3) == []
    assert tier.commit_admission(info("a"), [], t + 3) == []
    assert tier.counters.hits == 2


def test_byte_capacity_evicts_enough_and_no_more() -> None:
    tier = TierIndex("L1", capacity_bytes=100, capacity_count=None, policy=LRUPolicy())
    for t, (k, size) in enumerate([("a", 10), ("b", 60), ("c", 20)]):
        tier.admit(info(k, size), float(t))
    # 90 used; a 30-byte newcomer needs 20: LRU order is a, b, c; the greedy walk takes a (10)
    # then b (60) — and then a turns out unnecessary, so only b goes
    assert tier.plan_admission(info("d", 30), 5.0) == ["b"]
    assert tier.admit(info("d", 30), 5.0) == ["b"]
    assert tier.used_bytes == 60
    with pytest.raises(NoRoomError, match="larger than the tier"):
        tier.plan_admission(info("huge", 101), 6.0)


def test_entries_snapshot_is_a_copy() -> None:
    tier = slots(2)
    fill(tier, "a")
    snap = tier.entries()
    snap["a"].inflight = 5
    assert tier.get("a").inflight == 0  # type: ignore[union-attr]
    assert tier.get("zz") is None


def test_validation_and_misuse() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        TierIndex("x", capacity_bytes=-1, capacity_count=None, policy=LRUPolicy())
    with pytest.raises(ValueError, match="min_residency_s"):
        TierIndex(
            "x", capacity_bytes=None, capacity_count=1, policy=LRUPolicy(), min_residency_s=-1
        )
    with pytest.raises(ValueError, match="budget of tenant"):
        TierIndex(
            "x", capacity_bytes=None, capacity_count=1, policy=LRUPolicy(), tenant_budgets={"a": -1}
        )
    tier = slots(2)
    with pytest.raises(ResidencyError, match="not resident"):
        tier.acquire("a")
    fill(tier, "a")
    with pytest.raises(ResidencyError, match="without acquire"):
        tier.release("a")
    with pytest.raises(NoRoomError, match="no slots"):
        slots(0).plan_admission(info("a"), 0.0)


def test_policy_may_only_reorder() -> None:
    class Bad(LRUPolicy):
        def order_victims(self, candidates, tier, now, *, by_bytes=True):  # type: ignore[no-untyped-def]
            return list(candidates)[:1]

    tier = TierIndex("L0", capacity_bytes=None, capacity_count=2, policy=Bad())
    fill(tier, "ab")
    with pytest.raises(ResidencyError, match="different key set"):
        tier.plan_admission(info("c"), 10.0)


# ------------------------------------------------------------------------ hard constraints


def test_inflight_never_evicted_and_clear_error() -> None:
    tier = slots(3)
    t = fill(tier, "abc")
    tier.acquire("a")
    tier.acquire("b")
    assert tier.admit(info("d"), t + 1) == ["c"]
    tier.acquire("d")
    with pytest.raises(NoRoomError) as e:
        tier.plan_admission(info("e"), t + 2)
    assert "all 3 resident adapters are in use (3)" in str(e.value)
    assert e.value.tier == "L0" and e.value.key == "e"
    tier.release("a")
    assert tier.plan_admission(info("e"), t + 3) == ["a"]
    with pytest.raises(ResidencyError, match="in-flight"):
        tier.remove("b")


def test_pinned_never_evicted_even_before_residency() -> None:
    tier = slots(2)
    tier.pin("a")  # e.g. a device-preferred adapter pinned by config before it is loaded
    t = fill(tier, "ab")
    assert tier.get("a").pinned and tier.is_pinned("a")  # type: ignore[union-attr]
    tier.acquire("b")
    with pytest.raises(
        NoRoomError, match=r"all 2 resident adapters are in use \(1\) or pinned \(1\)"
    ):
        tier.plan_admission(info("c"), t + 1)
    tier.release("b")
    assert tier.admit(info("c"), t + 2) == ["b"]
    with pytest.raises(ResidencyError, match="pinned"):
        tier.remove("a")
    tier.unpin("a")
    assert tier.admit(info("d"), t + 3) == ["a"]
    tier.pin("c")
    assert tier.remove("c", t + 4, force=True).info.key == "c"
    assert tier.counters.evictions == 2  # remove() is not a policy eviction


def test_min_residency() -> None:
    tier = slots(2, min_residency_s=5.0)
    tier.admit(info("a"), 0.0)
    tier.admit(info("b"), 3.0)
    with pytest.raises(NoRoomError, match="all 2 resident adapters are too new"):
        tier.plan_admission(info("c"), 4.9)
    assert tier.plan_admission(info("c"), 5.0) == ["a"]  # a is old enough, b is not
    assert tier.evictable("a", 5.0) and not tier.evictable("b", 5.0)


def test_tenant_budget_evicts_own_entries_first() -> None:
    tier = TierIndex(
        "L1",
        capacity_bytes=100,
        capacity_count=None,
        policy=LRUPolicy(),
        tenant_budgets={"greedy": 30},
    )
    t = 0.0
    for k, tenant in [("o1", "other"), ("g1", "greedy"), ("g2", "greedy"), ("g3", "greedy")]:
        t += 1
        tier.policy.on_access(k, info(k, tenant=tenant), t)
        tier.admit(info(k, tenant=tenant), t)
    assert tier.tenant_bytes("greedy") == 30
    # plenty of room in the tier, but greedy is at its budget: its own LRU entry goes, not o1
    assert tier.plan_admission(info("g4", tenant="greedy"), t + 1) == ["g1"]
    assert tier.admit(info("g4", tenant="greedy"), t + 1) == ["g1"]
    assert tier.tenant_bytes("greedy") == 30 and tier.contains("o1")
    # other tenants are unaffected by greedy's budget
    assert tier.admit(info("o2", tenant="other"), t + 2) == []
    # a single adapter bigger than the budget can never fit
    with pytest.raises(NoRoomError, match="exceeds tenant 'greedy'"):
        tier.plan_admission(info("g9", size=31, tenant="greedy"), t + 3)
    # budget full of in-flight entries: a clear error naming the tenant
    for k in ("g2", "g3", "g4"):
        tier.acquire(k)
    with pytest.raises(NoRoomError, match=r"tenant 'greedy' is at its budget .* in use \(3\)"):
        tier.plan_admission(info("g5", tenant="greedy"), t + 4)


def test_storm_never_breaks_constraints() -> None:
    """Random admissions, hits, pins, in-flight references and removals, under every policy."""
    for name in POLICIES:
        rng = random.Random(hash(name) & 0xFFFF)
        budgets = {"t0": 60 * MiB, "t1": 40 * MiB}
        tier = TierIndex(
            "L1",
            capacity_bytes=128 * MiB,
            capacity_count=12,
            policy=make_policy(name),
            min_residency_s=0.5,
            tenant_budgets=budgets,
        )
        inflight: dict[str, int] = {}
        pinned: set[str] = set()
        t = 0.0
        for _ in range(2000):
            t += rng.random() * 0.2
            k = f"k{rng.randrange(60)}"
            a = info(k, size=rng.choice([4, 8, 16, 32]) * MiB, tenant=f"t{rng.randrange(3)}")
            if tier.contains(k):
                a = tier.get(k).info  # type: ignore[union-attr]
            op = rng.random()
            before = tier.entries()
            if op < 0.55:
                tier.policy.on_access(k, a, t)
                if not tier.lookup(k, t):
                    try:
                        victims = tier.plan_admission(a, t)
                    except NoRoomError:
                        continue
                    evicted = tier.commit_admission(a, victims, t)
                    for v in evicted:
                        assert inflight.get(v, 0) == 0 and v not in pinned
                        assert t - before[v].inserted_at >= 0.5
                if rng.random() < 0.5:
                    tier.acquire(k)
                    inflight[k] = inflight.get(k, 0) + 1
            elif op < 0.8:
                held = [x for x, n in inflight.items() if n]
                if held:
                    x = rng.choice(held)
                    tier.release(x)
                    inflight[x] -= 1
            elif op < 0.9:
                if rng.random() < 0.5:
                    tier.pin(k)
                    pinned.add(k)
                else:
                    tier.unpin(k)
                    pinned.discard(k)
            elif tier.contains(k):
                try:
                    tier.remove(k, t)
                except ResidencyError:
                    assert inflight.get(k, 0) or k in pinned
            # invariants after every operation
            entries = tier.entries()
            for x, n in inflight.items():
                if n:
                    assert x in entries and entries[x].inflight == n, (name, x)
            for x in pinned & set(before):
                assert x in entries, (name, "pinned evicted", x)
            assert tier.used_bytes == sum(e.info.size_bytes for e in entries.values())
            assert tier.used_bytes <= 128 * MiB and tier.count <= 12
            for tenant, b in budgets.items():
                used = sum(e.info.size_bytes for e in entries.values() if e.info.tenant == tenant)
                assert used == tier.tenant_bytes(tenant) <= b
        assert tier.counters.evictions > 50, name  # the storm did put the tier under pressure


# ------------------------------------------------------------------------ two-phase admission


def test_commit_replans_when_a_victim_became_busy() -> None:
    tier = slots(2)
    t = fill(tier, "ab")
    victims = tier.plan_admission(info("c"), t + 1)
    assert victims == ["a"]
    tier.acquire("a")  # a request started using the victim while c was loading
    assert tier.commit_admission(info("c"), victims, t + 2) == ["b"]
    assert tier.contains("a") and tier.contains("c")


def test_commit_replans_when_room_was_taken() -> None:
    tier = slots(3)
    t = fill(tier, "ab")
    assert tier.plan_admission(info("c"), t + 1) == []  # a free slot
    tier.admit(info("x"), t + 2)  # someone else took it during the load
    assert tier.commit_admission(info("c"), [], t + 3) == ["a"]
    assert tier.count == 3


def test_commit_with_vanished_victim_and_impossible_replan() -> None:
    tier = slots(2)
    t = fill(tier, "ab")
    victims = tier.plan_admission(info("c"), t + 1)
    tier.remove("a")
    # the victim is gone, which made room: the re-plan evicts nothing
    assert tier.commit_admission(info("c"), victims, t + 2) == []
    victims = tier.plan_admission(info("d"), t + 3)
    tier.acquire("b")
    tier.acquire("c")
    before = tier.entries()
    with pytest.raises(NoRoomError):
        tier.commit_admission(info("d"), victims, t + 4)
    assert tier.entries() == before  # unchanged


def test_commit_when_already_admitted_meanwhile() -> None:
    tier = slots(2)
    t = fill(tier, "ab")
    victims = tier.plan_admission(info("c"), t + 1)
    tier.admit(info("c"), t + 2)
    assert tier.commit_admission(info("c"), victims, t + 3) == []
    assert tier.counters.inserts == 3


# ------------------------------------------------------------------------ thrash accounting


def test_reload_after_eviction_and_thrash_ratio() -> None:
    tier = slots(1, thrash_window_s=10.0)
    assert tier.counters.thrash_ratio == 0.0
    tier.admit(info("a"), 0.0)
    tier.admit(info("b"), 1.0)  # evicts a at t=1
    tier.admit(info("a"), 5.0)  # a back within 10 s: a reload after eviction (evicts b at 5)
    tier.admit(info("c"), 6.0)  # evicts a at 6
    tier.admit(info("b"), 30.0)  # b back 25 s after its eviction: outside the window
    c = tier.counters
    assert (c.evictions, c.reload_after_eviction) == (4, 1)
    assert c.thrash_ratio == pytest.approx(0.25)


def test_ghost_map_is_bounded() -> None:
    tier = slots(1, thrash_window_s=1e9, ghost_capacity=3)
    for i in range(10):
        tier.admit(info(f"k{i}"), float(i))
    assert len(tier._ghosts) == 3
    tier.admit(info("k0"), 20.0)  # forgotten: not counted
    tier.admit(info("k8"), 21.0)  # remembered
    assert tier.counters.reload_after_eviction == 1


# ------------------------------------------------------------------------ patient admission


def _hybrid_tier(n: int, **kw: object) -> TierIndex:
    return TierIndex(
        "L0", capacity_bytes=None, capacity_count=n, policy=make_policy("hybrid"), **kw
    )  # type: ignore[arg-type]


def _request(tier: TierIndex, key: str, now: float) -> None:
    tier.policy.on_access(key, info(key), now)
    if not tier.lookup(key, now):
        tier.admit(info(key), now)


def test_patient_plan_waits_for_busy_cold_slot() -> None:
    tier = _hybrid_tier(3)
    t = 0.0
    for _ in range(30):
        for k in ("hot1", "hot2"):
            t += 0.1
            _request(tier, k, t)
    _request(tier, "cold1", t + 0.1)
    tier.acquire("cold1")  # a request on the cold adapter is still running
    tier.policy.on_access("cold2", info("cold2"), t + 0.2)
    # impatient: a hot adapter is the only evictable entry
    assert tier.plan_admission(info("cold2"), t + 0.2) in (["hot1"], ["hot2"])
    with pytest.raises(AdmissionDeferred, match="waiting for one of 1 busy"):
        tier.plan_admission(info("cold2"), t + 0.2, patient=True)
    tier.release("cold1")
    assert tier.admit(info("cold2"), t + 0.3, patient=True) == ["cold1"]
    assert tier.contains("hot1") and tier.contains("hot2")


def test_patient_plan_counts_too_new_but_not_pinned() -> None:
    tier = _hybrid_tier(2, min_residency_s=1.0)
    t = 0.0
    for _ in range(30):
        t += 0.1
        _request(tier, "hot", t)
    _request(tier, "cold1", t)
    tier.policy.on_access("cold2", info("cold2"), t + 0.5)
    with pytest.raises(AdmissionDeferred):  # cold1 is too new, hot is valuable
        tier.plan_admission(info("cold2"), t + 0.5, patient=True)
    tier.pin("cold1")  # pinned entries never become evictable: nothing to wait for
    assert tier.plan_admission(info("cold2"), t + 0.5, patient=True) == ["hot"]


def test_baseline_policies_never_wait() -> None:
    for name in ("lru", "lfu", "fifo"):
        tier = TierIndex("L0", capacity_bytes=None, capacity_count=2, policy=make_policy(name))
        fill(tier, "ab")
        tier.acquire("b")
        assert tier.plan_admission(info("c"), 10.0, patient=True) == ["a"], name
