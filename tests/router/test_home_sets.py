"""Home sets (policy ``home``): stable, traffic-sized, adjusted by residency and saturation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loraplex.router.cli import RouteConfigError, parse_route_args
from loraplex.router.fleet_sim import FleetShape, partition_bound, simulate_routing
from loraplex.router.homes import (
    HomeMap,
    HomeSettings,
    Member,
    Picker,
    TrafficShares,
    assign_homes,
)
from loraplex.router.scoring import ReplicaView, Thresholds, choose, rendezvous

URLS = [f"http://r{i}:8000" for i in range(5)]
NAMES = [f"a{i:02d}" for i in range(60)]


def views(urls: list[str] = URLS, memory: int | None = None, **kw: object) -> list[ReplicaView]:
    return [ReplicaView(url=u, memory=memory, **kw) for u in urls]  # type: ignore[arg-type]


def uniform_map(settings: HomeSettings | None = None, n: int = 600) -> HomeMap:
    hm = HomeMap(settings)
    rng = random.Random(1)
    for _ in range(n):
        hm.observe(rng.choice(NAMES))
    return hm


def test_same_adapter_same_home_across_calls_and_turns() -> None:
    hm = uniform_map()
    vs = views()
    first = {a: tuple(hm.home(a, vs)) for a in NAMES}
    assert all(len(h) == 1 for h in first.values())  # 1/60 of the traffic: one home
    assert len({h[0] for h in first.values()}) == len(URLS)  # the adapters spread over all
    for _ in range(3):
        hm.rebalance(hm._fleet or ())  # recomputing changes nothing
        assert {a: tuple(hm.home(a, vs)) for a in NAMES} == first
    picker = Picker("home")
    picker.homes = hm
    for a in NAMES[:10]:
        picks = {picker.pick(vs, a).index for _ in range(5)}  # type: ignore[union-attr]
        assert picks == {first[a][0]}  # whatever the turn


def test_removing_one_replica_remaps_only_its_adapters() -> None:
    items = [(a, 1, 1.0) for a in NAMES]
    loose = 100.0  # bounds that never bind: pure rendezvous
    before = assign_homes(items, [Member(u, None) for u in URLS], loose)
    gone = URLS[2]
    after = assign_homes(items, [Member(u, None) for u in URLS if u != gone], loose)
    moved = {a for a in NAMES if before[a] != after[a]}
    assert moved == {a for a in NAMES if before[a] == (gone,)} and moved
    for a in moved:  # each to its next rendezvous choice
        rest = [u for u in URLS if u != gone]
        assert after[a] == (max(rest, key=lambda u: rendezvous(a, u)),)
    # adding a replica moves only adapters onto it, about 1/N of them
    grown = assign_homes(items, [Member(u, None) for u in [*URLS, "http://r5:8000"]], loose)
    moved = {a for a in NAMES if before[a] != grown[a]}
    assert all(grown[a] == ("http://r5:8000",) for a in moved)
    assert 0 < len(moved) <= 2 * len(NAMES) / 6


def test_removal_with_bounded_memory_moves_few_others() -> None:
    items = [(a, 1, 1.0) for a in NAMES]
    before = assign_homes(items, [Member(u, 16) for u in URLS], 0.25)
    counts = {u: sum(h == (u,) for h in before.values()) for u in URLS}
    assert max(counts.values()) <= (1.25 * len(NAMES) / len(URLS))  # the load bound holds
    gone = URLS[0]
    after = assign_homes(items, [Member(u, 16) for u in URLS[1:]], 0.25)
    own = {a for a in NAMES if before[a] == (gone,)}
    others = {a for a in NAMES if before[a] != after[a]} - own
    assert len(others) <= len(own)  # a few pushed along by the bounds, never a reshuffle
    assert all(len(after[a]) == 1 and after[a][0] != gone for a in NAMES)


def test_home_map_follows_the_live_fleet() -> None:
    hm = uniform_map(HomeSettings(balance=100.0))  # no load bound: rendezvous alone
    vs = views(memory=None)
    homes = {a: hm.home(a, vs)[0] for a in NAMES}
    down = 3
    vs2 = [ReplicaView(url=v.url, healthy=(i != down)) for i, v in enumerate(vs)]
    homes2 = {a: hm.home(a, vs2)[0] for a in NAMES}
    assert all(homes2[a] != down for a in NAMES)
    changed = {a for a in NAMES if homes[a] != homes2[a]}
    assert changed and all(homes[a] == down for a in changed)  # only the ejected one's adapters
    back = {a: hm.home(a, vs)[0] for a in NAMES}  # re-admitted: they come home again
    assert back == homes


def test_fleet_memory_is_filled_evenly() -> None:
    # 8 adapters, 2 replicas holding 4 each: exactly 4 homes on each (hashing alone would not)
    names = [f"a{i:02d}" for i in range(8)]
    hm = HomeMap()
    for _ in range(50):
        for a in names:
            hm.observe(a)
    vs = views(URLS[:2], memory=4)
    counts = [0, 0]
    for a in names:
        (i,) = hm.home(a, vs)
        counts[i] += 1
    assert counts == [4, 4]


def test_warm_member_first_then_home_then_spill() -> None:
    th = Thresholds(max_waiting=4)
    vs = [
        ReplicaView("a", tiers={"x": "device"}),  # warm, but outside the home set
        ReplicaView("b"),
        ReplicaView("c", tiers={"x": "host"}),
    ]
    d = choose(vs, "x", policy="home", home=[1, 2], thresholds=th)
    assert d is not None and (d.index, d.reason) == (2, "affinity")  # the warm member
    d = choose(vs, "x", policy="home", home=[1], thresholds=th)
    assert d is not None and (d.index, d.reason) == (1, "home")  # home, not the warm stranger
    sat = [vs[0], ReplicaView("b", waiting=4), vs[2]]
    d = choose(sat, "x", policy="home", home=[1], thresholds=th)
    assert d is not None and d.reason == "spill" and d.index == 0  # spill: warm copies first
    d = choose(sat, "x", policy="home", home=[1], thresholds=th, exclude=frozenset({0}))
    assert d is not None and (d.index, d.reason) == (2, "spill")
    d = choose(views(URLS[:2], waiting=9), "x", policy="home", home=[0], thresholds=th)
    assert d is not None and d.reason == "fallback"
    # a hot adapter's members share its load: the busier warm one loses to an idle member
    busy = [ReplicaView("a", tiers={"x": "device"}, in_flight=30), ReplicaView("b"), vs[2]]
    d = choose(busy, "x", policy="home", home=[0, 2], thresholds=Thresholds(max_in_flight=64))
    assert d is not None and (d.index, d.reason) == (2, "affinity")


def test_hot_adapter_widens_and_narrows_again() -> None:
    hm = HomeMap(HomeSettings(window=400, rebalance_every=16))
    vs = views(URLS[:4])
    rng = random.Random(2)
    for _ in range(800):  # "hot" takes 60% of the traffic
        a = "hot" if rng.random() < 0.6 else rng.choice(NAMES[:20])
        hm.observe(a)
        hm.home(a, vs)
    assert len(hm.home("hot", vs)) == 3  # ceil(0.6 x 4)
    assert all(len(hm.home(a, vs)) == 1 for a in NAMES[:20])
    wide = hm.home("hot", vs)
    # the hot adapter spreads over its members under load, cold ones stay home
    picker = Picker("home", thresholds=Thresholds(max_in_flight=64))
    picker.homes = hm
    load = [0] * 4
    for _ in range(30):
        vs_now = [ReplicaView(url=v.url, in_flight=load[i]) for i, v in enumerate(vs)]
        d = picker.pick(vs_now, "hot")
        assert d is not None and d.index in wide
        load[d.index] += 1
    assert sum(1 for i in wide if load[i] > 0) == 3
    # traffic moves away: the set narrows again
    for _ in range(2000):
        a = rng.choice(NAMES[:20])
        hm.observe(a)
        hm.home(a, vs)
    hm.observe("hot")
    assert len(hm.home("hot", vs)) == 1


def test_only_answered_requests_count_and_unknown_names_take_no_room() -> None:
    p = Picker("home")
    vs = views(URLS[:2], memory=1)
    for _ in range(3):  # asked for, never answered (a bogus name, a 401 or 404)
        assert p.pick(vs, "bogus") is not None
    assert p.homes.shares.counts == {} and p.home_sets() == {}
    p.note_answered("x")
    d = p.pick(vs, "x")
    assert d is not None and p.home_sets() == {"x": [vs[d.index].url]}
    for i in range(20):  # a flood of unknown names (each answered 404) leaves the fill alone
        p.pick(vs, f"bogus-{i}")
        p.note_unanswered(f"bogus-{i}")
    p.note_answered("y")
    p.pick(vs, "y")
    homes = p.home_sets()
    assert set(homes) == {"x", "y"} and homes["x"] != homes["y"]  # one memory slot each


def test_traffic_shares_decay() -> None:
    s = TrafficShares(window=100)
    s.observe("a")
    for _ in range(99):
        s.observe("b")
    s.decay()
    assert s.counts["a"] == pytest.approx((1 - 1 / 100) ** 100)
    assert s.fraction("b") == pytest.approx(99 / 100 * s.counts["b"] / s.counts["b"], rel=0.02)
    for _ in range(1000):
        s.observe("b")
    s.decay()
    assert "a" not in s.counts  # forgotten after a few windows unseen


def test_sequential_two_by_eight_converges_where_round_robin_does_not() -> None:
    # issue 16: 2 replicas x (1 device slot, memory for 4), 8 equally popular adapters, one
    # request at a time: the fleet's memory holds all 8, so a partition makes no cold start
    rng = random.Random(0)
    names = [f"a{i}" for i in range(8)]
    trace = [rng.choice(names) for _ in range(600)]
    shape = FleetShape(replicas=2, device_slots=1, memory=4)
    assert partition_bound(trace, shape.fleet_memory, warmup=200) == 0
    home = simulate_routing(trace, shape, policy="home", warmup=200)
    rr = simulate_routing(trace, shape, policy="round-robin", warmup=200)
    chase = simulate_routing(trace, shape, policy="residency", warmup=200)
    assert home.requests == rr.requests == 400
    assert home.cold == 0 and home.replicas_per_adapter == 1.0
    assert rr.cold_rate > 0.4 and chase.cold_rate > 0.2  # the observation
    assert set(home.decisions) == {"affinity"}


def test_partition_bound_when_the_working_set_does_not_fit() -> None:
    trace = ["a", "b", "c", "a", "b", "c", "a", "a"]
    assert partition_bound(trace, fleet_memory=3) == 3  # compulsory misses only
    assert partition_bound(trace, fleet_memory=2) == 2 + 2  # a, b first touch; both c's
    assert partition_bound(trace, fleet_memory=2, warmup=3) == 1  # only the c after warm-up


def test_home_is_the_default_policy_and_its_flags() -> None:
    c = parse_route_args(["--replica", "http://a:1"])
    assert c.policy == "home" and c.homes == HomeSettings()
    c = parse_route_args(["--replica", "http://a:1", "--home-spread", "2", "--home-window",
                          "500", "--home-balance", "0.5", "--home-rebalance", "8"])  # fmt: skip
    assert c.homes == HomeSettings(spread=2.0, window=500, balance=0.5, rebalance_every=8)
    with pytest.raises(RouteConfigError, match="spread: must be > 0"):
        parse_route_args(["--replica", "http://a:1", "--home-spread", "0"])


# -- issue 33, item 4: home sets that converge from empty caches --------------------------------
def uniform_trace(n: int, requests: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(n)]
    return [rng.choice(names) for _ in range(requests)]


@pytest.mark.parametrize("seed", range(5))
def test_from_empty_caches_two_by_eight_makes_only_the_compulsory_misses(seed: int) -> None:
    # the fleet, no warm-up: 160 sequential requests, cold starts counted over all of
    # them; the fleet's memory holds all 8 adapters, so a partition misses each once
    trace = uniform_trace(8, 160, seed)
    shape = FleetShape(replicas=2, device_slots=1, memory=4)
    home = simulate_routing(trace, shape, policy="home")
    rr = simulate_routing(trace, shape, policy="round-robin")
    assert partition_bound(trace, shape.fleet_memory) == 8
    assert home.cold == 8  # placed once, on the replica that first answered, never moved
    assert home.replicas_per_adapter == 1.0
    assert home.cold <= rr.cold / 3


def test_from_empty_caches_above_memory_every_adapter_keeps_one_home() -> None:
    # 12 adapters, memory for 8: the overflow is cold by any partition; nobody moves
    shape = FleetShape(replicas=2, device_slots=1, memory=4)
    home_cold = bound = 0
    for seed in range(5):
        trace = uniform_trace(12, 160, seed)
        home = simulate_routing(trace, shape, policy="home")
        assert home.replicas_per_adapter == 1.0
        home_cold += home.cold
        bound += partition_bound(trace, shape.fleet_memory)
    assert home_cold <= 1.25 * bound


def test_from_empty_caches_concurrent_fleet_sits_on_the_bound() -> None:
    # 8 replicas x (2 slots, memory 8), 48 adapters, 8 clients at once from empty caches
    shape = FleetShape(replicas=8, device_slots=2, memory=8)
    home_cold = bound = 0
    for seed in range(3):
        trace = uniform_trace(48, 160, seed)
        home = simulate_routing(trace, shape, policy="home", concurrency=8)
        home_cold += home.cold
        bound += partition_bound(trace, shape.fleet_memory)
    assert home_cold <= 1.06 * bound


def test_concurrent_newcomers_hold_a_slot_until_answered() -> None:
    """First requests for new adapters sent before any answers (concurrent clients): each
    holds a memory slot where it goes, so the next newcomer goes elsewhere instead of
    overfilling one replica; the answer places it there, and a request that fails frees the
    slot."""
    hm = HomeMap()
    vs = views(URLS[:4], memory=2)
    names = [f"n{i}" for i in range(8)]  # exactly the fleet's memory
    first = {a: hm.home(a, vs)[0] for a in names}
    assert sorted(Counter(first.values()).values()) == [2, 2, 2, 2]
    assert all(hm.home(a, vs) == [first[a]] for a in names)  # sticky until answered
    for a in names:
        hm.observe(a, vs[first[a]].url)
    assert {a: hm.homes[a] for a in names} == {a: (vs[first[a]].url,) for a in names}
    late = HomeMap()
    (where,) = late.home("gone", vs)
    assert late._tentative == {"gone": vs[where].url}
    assert sum(late._placer.count.values()) == 1  # type: ignore[union-attr]
    late.unanswered("gone")  # its request failed: the slot is free for the next newcomer
    assert late._tentative == {} and sum(late._placer.count.values()) == 0  # type: ignore[union-attr]


def test_first_answer_places_the_adapter_where_it_was_served() -> None:
    hm = HomeMap()
    vs = views(URLS[:2], memory=4)
    (first,) = hm.home("x", vs)  # never answered: where it would go (a slot held there)
    assert hm.homes == {}
    other = vs[1 - first].url
    hm.observe("x", other)  # another replica answered it (a spill): warm there, home there
    assert hm.homes["x"] == (other,)
    assert hm.home("x", vs) == [1 - first]


def test_rebalances_keep_homes_that_still_fit() -> None:
    # 8 adapters over 2 x 4 slots, placed as they arrive; later traffic is skewed 3:1 among
    # them, and the rebalances (every 16 requests) move nobody: a move costs a cold start
    hm = HomeMap(HomeSettings(rebalance_every=16))
    vs = views(URLS[:2], memory=4)
    names = [f"a{i}" for i in range(8)]
    for a in names:
        i = hm.home(a, vs)[0]
        hm.observe(a, vs[i].url)
    placed = dict(hm.homes)
    assert sorted(sum(h == (u.url,) for h in placed.values()) for u in vs) == [4, 4]
    rng = random.Random(3)
    for _ in range(600):
        a = rng.choice(names[:3] * 3 + names[3:])
        i = hm.home(a, vs)[0]
        hm.observe(a, vs[i].url)
    assert hm.rebalances > 30 and hm.homes == placed


def test_a_replica_that_joins_takes_about_its_share() -> None:
    hm = uniform_map(HomeSettings(balance=100.0))  # no load bound: rendezvous alone
    before = {a: hm.home(a, views())[0] for a in NAMES}
    grown = [*URLS, "http://r5:8000"]
    after = {a: hm.home(a, views(grown))[0] for a in NAMES}
    moved = {a for a in NAMES if before[a] != after[a]}
    assert moved and all(after[a] == 5 for a in moved)  # only onto the new replica
    assert moved == {a for a in NAMES if max(grown, key=lambda u: rendezvous(a, u)) == grown[5]}


def test_masses_need_evidence_before_they_tell_adapters_apart() -> None:
    s = TrafficShares(window=1000)
    for a in ["a", "b", "b", "b"]:
        s.observe(a)
    assert s.fraction("a") / s.fraction("b") > 0.95  # 1 vs 3 requests: noise
    assert s.fraction("a") + s.fraction("b") == pytest.approx(1.0)
    for _ in range(300):
        for a in ["a", "b", "b", "b"]:
            s.observe(a)
    assert s.fraction("a") / s.fraction("b") == pytest.approx(1 / 3, rel=0.01)
