"""TierIndex: hard constraints around any policy, planned admission, counters — admissions
through the cache's own path (``TierController``: plan, evict each victim through its one
eviction path, insert)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from loraplex.cache.controller import TierController
from loraplex.cache.policy import POLICIES, AdapterInfo, EvictionPolicy, LRUPolicy, make_policy
from loraplex.cache.residency import AdmissionDeferred, NoRoomError, ResidencyError, TierIndex

MiB = 1 << 20


class Clock:
    """Test time: set by the test, read by the controller."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def info(key: str, size: int = 10, tenant: str | None = "t", priority: int = 0) -> AdapterInfo:
    return AdapterInfo(key=key, size_bytes=size, tenant=tenant, priority=priority)


def cache(
    count: int | None = None,
    *,
    nbytes: int | None = None,
    policy: EvictionPolicy | None = None,
    budgets: dict[str, int] | None = None,
    **kw: object,
) -> TierController:
    """A cache's tiers whose host tier (``.host``, the index under test) holds ``count`` copies
    and/or ``nbytes`` bytes, tenants within ``budgets``."""
    return TierController(
        policy or LRUPolicy(),
        slots=1,
        clock=Clock(),
        host_bytes=nbytes,
        max_host_copies=count,
        tenant_budgets={"host": budgets} if budgets else None,
        **kw,  # type: ignore[arg-type]
    )


def admit(ctl: TierController, a: AdapterInfo, now: float) -> list[str]:
    """A loaded copy admitted into host memory by the cache's path, at ``now``, no request
    counted or held; the keys it evicted."""
    ctl.clock.now = now  # type: ignore[attr-defined]
    return ctl.admit_host(a, holds=0, counted=0).dropped


def fill(ctl: TierController, keys: Sequence[str], t0: float = 0.0, **kw: object) -> float:
    t = t0
    for k in keys:
        t += 1.0
        ctl.policy.on_access(k, info(k, **kw), t)  # type: ignore[arg-type]
        admit(ctl, info(k, **kw), t)  # type: ignore[arg-type]
    return t


def slots(n: int) -> TierIndex:
    """A bare index, for planning alone (plans change nothing)."""
    return TierIndex("L0", capacity_bytes=None, capacity_count=n, policy=LRUPolicy())


# ------------------------------------------------------------------------------ basics


def test_admission_follows_policy_and_counts() -> None:
    ctl = cache(3)
    tier = ctl.host
    t = fill(ctl, "abc")
    assert tier.count == 3 and tier.used_bytes == 30
    ctl.policy.on_access("a", info("a"), t + 1)
    assert tier.lookup("a", t + 1) is True
    assert tier.lookup("zz", t + 1) is False
    assert tier.plan_admission(info("d"), t + 2) == ["b"]  # LRU: b is the oldest now
    assert tier.contains("b")  # planning changes nothing
    assert admit(ctl, info("d"), t + 2) == ["b"]
    assert sorted(tier.entries()) == ["a", "c", "d"]
    c = tier.counters
    assert (c.hits, c.misses, c.inserts, c.evictions) == (1, 1, 4, 1)
    assert c.hit_ratio == 0.5
    # already resident: nothing to evict, the request is a hit
    assert tier.plan_admission(info("a"), t + 3) == []
    ctl.clock.now = t + 3  # type: ignore[attr-defined]
    got = ctl.admit_host(info("a"), holds=0)
    assert got.warm and got.dropped == [] and tier.counters.hits == 2


def test_byte_capacity_evicts_enough_and_no_more() -> None:
    ctl = cache(nbytes=100)
    tier = ctl.host
    for t, (k, size) in enumerate([("a", 10), ("b", 60), ("c", 20)]):
        admit(ctl, info(k, size), float(t))
    # 90 used; a 30-byte newcomer needs 20: LRU order is a, b, c; the greedy walk takes a (10)
    # then b (60) — and then a turns out unnecessary, so only b goes
    assert tier.plan_admission(info("d", 30), 5.0) == ["b"]
    assert admit(ctl, info("d", 30), 5.0) == ["b"]
    assert tier.used_bytes == 60
    with pytest.raises(NoRoomError, match="larger than the tier"):
        tier.plan_admission(info("huge", 101), 6.0)


def test_entries_snapshot_is_a_copy() -> None:
    ctl = cache(2)
    fill(ctl, "a")
    snap = ctl.host.entries()
    snap["a"].inflight = 5
    assert ctl.host.get("a").inflight == 0  # type: ignore[union-attr]
    assert ctl.host.get("zz") is None


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
    ctl = cache(2)
    tier = ctl.host
    with pytest.raises(ResidencyError, match="not resident"):
        tier.acquire("a")
    fill(ctl, "a")
    with pytest.raises(ResidencyError, match="without acquire"):
        tier.release("a")
    with pytest.raises(NoRoomError, match="no slots"):
        slots(0).plan_admission(info("a"), 0.0)


def test_policy_may_only_reorder() -> None:
    class Bad(LRUPolicy):
        def order_victims(self, candidates, tier, now, *, by_bytes=True):  # type: ignore[no-untyped-def]
            return list(candidates)[:1]

    ctl = cache(2, policy=Bad())
    fill(ctl, "ab")
    with pytest.raises(ResidencyError, match="different key set"):
        ctl.host.plan_admission(info("c"), 10.0)
    with pytest.raises(ResidencyError, match="different key set"):
        admit(ctl, info("c"), 10.0)
    assert set(ctl.host.entries()) == {"a", "b"}


# ------------------------------------------------------------------------ hard constraints


def test_inflight_never_evicted_and_clear_error() -> None:
    ctl = cache(3)
    tier = ctl.host
    t = fill(ctl, "abc")
    ctl.hold_request("a")  # live requests hold their copies
    ctl.hold_request("b")
    assert admit(ctl, info("d"), t + 1) == ["c"]
    ctl.hold_request("d")
    with pytest.raises(NoRoomError) as e:
        admit(ctl, info("e"), t + 2)
    assert "all 3 resident adapters are in use (3)" in str(e.value)
    assert e.value.tier == "host" and e.value.key == "e"
    assert set(tier.entries()) == {"a", "b", "d"}  # nothing changed
    ctl.release_request("a")
    assert admit(ctl, info("e"), t + 3) == ["a"]
    with pytest.raises(ResidencyError, match="in-flight"):
        tier.remove("b")


def test_pinned_never_evicted_even_before_residency() -> None:
    ctl = cache(2)
    tier = ctl.host
    ctl.pin("a")  # e.g. a device-preferred adapter pinned by config before it is loaded
    t = fill(ctl, "ab")
    assert tier.get("a").pinned and tier.is_pinned("a")  # type: ignore[union-attr]
    ctl.hold_request("b")
    with pytest.raises(
        NoRoomError, match=r"all 2 resident adapters are in use \(1\) or pinned \(1\)"
    ):
        admit(ctl, info("c"), t + 1)
    ctl.release_request("b")
    assert admit(ctl, info("c"), t + 2) == ["b"]
    with pytest.raises(ResidencyError, match="pinned"):
        tier.remove("a")
    ctl.unpin("a")
    assert admit(ctl, info("d"), t + 3) == ["a"]
    ctl.pin("c")
    assert tier.remove("c", t + 4, force=True).info.key == "c"
    assert tier.counters.evictions == 2  # remove() is not a policy eviction


def test_min_residency() -> None:
    ctl = cache(2, min_residency_s=5.0)
    tier = ctl.host
    admit(ctl, info("a"), 0.0)
    admit(ctl, info("b"), 3.0)
    with pytest.raises(NoRoomError, match="all 2 resident adapters are too new"):
        admit(ctl, info("c"), 4.9)
    assert tier.plan_admission(info("c"), 5.0) == ["a"]  # a is old enough, b is not
    assert tier.evictable("a", 5.0) and not tier.evictable("b", 5.0)
    assert admit(ctl, info("c"), 5.0) == ["a"]


def test_tenant_budget_evicts_own_entries_first() -> None:
    ctl = cache(nbytes=100, budgets={"greedy": 30})
    tier = ctl.host
    t = 0.0
    for k, tenant in [("o1", "other"), ("g1", "greedy"), ("g2", "greedy"), ("g3", "greedy")]:
        t += 1
        ctl.policy.on_access(k, info(k, tenant=tenant), t)
        admit(ctl, info(k, tenant=tenant), t)
    assert tier.tenant_bytes("greedy") == 30
    # plenty of room in the tier, but greedy is at its budget: its own LRU entry goes, not o1
    assert tier.plan_admission(info("g4", tenant="greedy"), t + 1) == ["g1"]
    assert admit(ctl, info("g4", tenant="greedy"), t + 1) == ["g1"]
    assert tier.tenant_bytes("greedy") == 30 and tier.contains("o1")
    # other tenants are unaffected by greedy's budget
    assert admit(ctl, info("o2", tenant="other"), t + 2) == []
    # a single adapter bigger than the budget can never fit
    with pytest.raises(NoRoomError, match="exceeds tenant 'greedy'"):
        admit(ctl, info("g9", size=31, tenant="greedy"), t + 3)
    # budget full of in-flight entries: a clear error naming the tenant
    for k in ("g2", "g3", "g4"):
        ctl.hold_request(k)
    with pytest.raises(NoRoomError, match=r"tenant 'greedy' is at its budget .* in use \(3\)"):
        admit(ctl, info("g5", tenant="greedy"), t + 4)


def test_storm_never_breaks_constraints() -> None:
    """Random admissions, hits, pins, live requests and removals, under every policy."""
    for name in POLICIES:
        rng = random.Random(hash(name) & 0xFFFF)
        budgets = {"t0": 60 * MiB, "t1": 40 * MiB}
        ctl = cache(
            12, nbytes=128 * MiB, policy=make_policy(name), budgets=budgets, min_residency_s=0.5
        )
        tier = ctl.host
        assert tier is not None
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
                ctl.policy.on_access(k, a, t)
                if not tier.lookup(k, t):
                    try:
                        evicted = admit(ctl, a, t)
                    except NoRoomError:
                        continue
                    for v in evicted:
                        assert inflight.get(v, 0) == 0 and v not in pinned
                        assert t - before[v].inserted_at >= 0.5
                if rng.random() < 0.5:
                    ctl.hold_request(k)
                    inflight[k] = inflight.get(k, 0) + 1
            elif op < 0.8:
                held = [x for x, n in inflight.items() if n]
                if held:
                    x = rng.choice(held)
                    ctl.release_request(x)
                    inflight[x] -= 1
            elif op < 0.9:
                if rng.random() < 0.5:
                    ctl.pin(k)
                    pinned.add(k)
                else:
                    ctl.unpin(k)
                    pinned.discard(k)
            elif tier.contains(k) and not ctl.remove("host", k, force=False):
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
            ctl.check_invariants()
        assert tier.counters.evictions > 50, name  # the storm did put the tier under pressure


# ------------------------------------------------------------------------ thrash accounting


def test_reload_after_eviction_and_thrash_ratio() -> None:
    ctl = cache(1, thrash_window_s=10.0)
    assert ctl.host.counters.thrash_ratio == 0.0
    admit(ctl, info("a"), 0.0)
    admit(ctl, info("b"), 1.0)  # evicts a at t=1
    admit(ctl, info("a"), 5.0)  # a back within 10 s: a reload after eviction (evicts b at 5)
    admit(ctl, info("c"), 6.0)  # evicts a at 6
    admit(ctl, info("b"), 30.0)  # b back 25 s after its eviction: outside the window
    c = ctl.host.counters
    assert (c.evictions, c.reload_after_eviction) == (4, 1)
    assert c.thrash_ratio == pytest.approx(0.25)


def test_ghost_map_is_bounded() -> None:
    ctl = cache(1, thrash_window_s=1e9)
    ctl.host.ghost_capacity = 3  # the cache's indexes remember 4096 evicted keys
    for i in range(10):
        admit(ctl, info(f"k{i}"), float(i))
    assert len(ctl.host._ghosts) == 3
    admit(ctl, info("k0"), 20.0)  # forgotten: not counted
    admit(ctl, info("k8"), 21.0)  # remembered
    assert ctl.host.counters.reload_after_eviction == 1


# ------------------------------------------------------------------------ patient admission
# Slot admissions (``reserve_slot``) are patient for ``patience_s`` after a request first waited.


def _hybrid(n: int, **kw: object) -> TierController:
    """``n`` device slots under the hybrid policy, host memory unbounded."""
    return TierController(
        make_policy("hybrid"),
        slots=n,
        clock=Clock(),
        patience_s=60.0,
        **kw,  # type: ignore[arg-type]
    )


def _request(ctl: TierController, key: str, now: float, *, done: bool = True) -> None:
    """One request on ``key``: its host copy (loaded when cold), then a slot; it finishes at
    once unless not ``done`` (its slot and copy stay held)."""
    ctl.clock.now = now  # type: ignore[attr-defined]
    a = info(key)
    if not ctl.serve_from_host(a):
        ctl.admit_host(a)
    got = ctl.reserve_slot(a)
    assert got is not None, key
    if done:
        ctl.release_slot(got[0])
        ctl.release_request(key)


def test_patient_plan_waits_for_busy_cold_slot() -> None:
    ctl = _hybrid(3)
    t = 0.0
    for _ in range(30):
        for k in ("hot1", "hot2"):
            t += 0.1
            _request(ctl, k, t)
    _request(ctl, "cold1", t + 0.1, done=False)  # a request on the cold adapter still runs
    ctl.clock.now = t + 0.2  # type: ignore[attr-defined]
    ctl.admit_host(info("cold2"))
    # impatient: a hot adapter is the only evictable entry
    assert ctl.device.plan_admission(info("cold2"), t + 0.2) in (["hot1"], ["hot2"])
    with pytest.raises(AdmissionDeferred, match="waiting for one of 1 busy"):
        ctl.device.plan_admission(info("cold2"), t + 0.2, patient=True)
    assert ctl.reserve_slot(info("cold2"), waiting_since=t + 0.2) is None  # it waits
    assert set(ctl.slot_of) == {"hot1", "hot2", "cold1"}
    ctl.release_slot(ctl.slot_of["cold1"])
    ctl.clock.now = t + 0.3  # type: ignore[attr-defined]
    assert ctl.reserve_slot(info("cold2"), waiting_since=t + 0.2) is not None
    assert set(ctl.slot_of) == {"hot1", "hot2", "cold2"}  # cold1 went, the hot set stayed
    assert ctl.device.counters.evictions == 1


def test_patient_plan_counts_too_new_but_not_pinned() -> None:
    ctl = _hybrid(2, min_residency_s=1.0)
    t = 0.0
    for _ in range(30):
        t += 0.1
        _request(ctl, "hot", t)
    _request(ctl, "cold1", t)
    ctl.clock.now = t + 0.5  # type: ignore[attr-defined]
    ctl.admit_host(info("cold2"))
    with pytest.raises(AdmissionDeferred):  # cold1 is too new, hot is valuable
        ctl.device.plan_admission(info("cold2"), t + 0.5, patient=True)
    ctl.pin("cold1", device=True)  # pinned entries never become evictable: nothing to wait for
    assert ctl.device.plan_admission(info("cold2"), t + 0.5, patient=True) == ["hot"]


def test_baseline_policies_never_wait() -> None:
    for name in ("lru", "lfu", "fifo"):
        ctl = cache(2, policy=make_policy(name))
        fill(ctl, "ab")
        ctl.hold_request("b")
        assert ctl.host.plan_admission(info("c"), 10.0, patient=True) == ["a"], name
