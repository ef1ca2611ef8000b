"""Routing decisions as pure functions: affinity until saturated, load, fallback, policies."""

from __future__ import annotations

import pytest

from loraplex.router.scoring import (
    ReplicaView,
    Thresholds,
    Weights,
    choose,
    home,
    is_saturated,
    load,
    rendezvous,
    score,
)


def rv(url: str, tiers: dict[str, str] | None = None, **kw: object) -> ReplicaView:
    return ReplicaView(url=url, tiers=tiers or {}, **kw)  # type: ignore[arg-type]


def test_tier_order_device_host_disk_absent() -> None:
    views = [
        rv("a", {"x": "absent"}),
        rv("b", {"x": "disk"}),
        rv("c", {"x": "host"}),
        rv("d", {"x": "device"}),
    ]
    d = choose(views, "x")
    assert d is not None and (d.index, d.reason) == (3, "affinity")
    scores = [score(v, "x", Weights(hash=0), Thresholds()) for v in views]
    assert scores == sorted(scores)  # absent < disk < host < device, all else equal
    d = choose(views[:3], "x")
    assert d is not None and (d.index, d.reason) == (2, "affinity")


def test_affinity_wins_over_moderate_load() -> None:
    warm = rv("a", {"x": "device"}, running=6, waiting=2, in_flight=3)
    idle = rv("b")
    d = choose([warm, idle], "x")
    assert d is not None and d.index == 0 and d.reason == "affinity"


def test_load_wins_once_saturated() -> None:
    th = Thresholds(max_waiting=4, max_kv_usage=0.9, max_in_flight=16)
    for busy in (
        dict(waiting=4),  # queue at the threshold
        dict(kv_usage=0.95),  # KV cache full
        dict(in_flight=16),  # the router's own outstanding requests
    ):
        warm = rv("a", {"x": "device"}, **busy)
        assert is_saturated(warm, th)
        d = choose([warm, rv("b"), rv("c", running=1)], "x", thresholds=th)
        assert d is not None and d.index in (1, 2) and d.reason == "load", busy
    # the host copy on an unsaturated replica beats a saturated device copy
    d = choose([rv("a", {"x": "device"}, waiting=9), rv("b", {"x": "host"})], "x", thresholds=th)
    assert d is not None and (d.index, d.reason) == (1, "affinity")


def test_fallback_when_everything_is_saturated() -> None:
    th = Thresholds(max_waiting=2)
    views = [rv("a", {"x": "device"}, waiting=9), rv("b", waiting=3), rv("c", waiting=5)]
    d = choose(views, "x", thresholds=th)
    assert d is not None and (d.index, d.reason) == (1, "fallback")


def test_cold_adapter_gets_a_stable_home_among_equal_loads() -> None:
    views = [rv(f"http://r{i}:8000") for i in range(4)]
    homes = {}
    for k in range(64):
        name = f"a{k}"
        picks = {choose(views, name, turn=t).index for t in range(5)}  # type: ignore[union-attr]
        assert len(picks) == 1  # the same replica whatever the round-robin turn
        homes[name] = picks.pop()
    assert len(set(homes.values())) == 4  # and the adapters spread over all replicas
    # a busier home loses to an idle replica once the load gap exceeds the hash weight
    name = "a0"
    i = homes[name]
    busy = [rv(v.url, running=0, waiting=(3 if j == i else 0)) for j, v in enumerate(views)]
    assert choose(busy, name).index != i  # type: ignore[union-attr]


def test_rendezvous_is_stable_and_in_range() -> None:
    assert rendezvous("x", "http://a") == rendezvous("x", "http://a")
    assert rendezvous("x", "http://a") != rendezvous("x", "http://b")
    assert all(0 <= rendezvous(f"a{i}", "u") < 1 for i in range(100))


def test_unhealthy_and_excluded_are_skipped() -> None:
    views = [rv("a", {"x": "device"}, healthy=False), rv("b", {"x": "host"}), rv("c")]
    d = choose(views, "x")
    assert d is not None and d.index == 1
    d = choose(views, "x", exclude=frozenset({1}))
    assert d is not None and d.index == 2 and d.reason == "load"
    assert choose(views, "x", exclude=frozenset({1, 2})) is None
    assert choose([], "x") is None


def test_round_robin_and_least_loaded() -> None:
    views = [rv("a", {"x": "device"}), rv("b", running=3), rv("c", waiting=1)]
    rr = [choose(views, "x", policy="round-robin", turn=t).index for t in range(6)]  # type: ignore[union-attr]
    assert rr == [0, 1, 2, 0, 1, 2]
    views = [rv("a", {"x": "device"}, running=4), rv("b", running=3), rv("c", running=1)]
    d = choose(views, "x", policy="least-loaded")
    assert d is not None and (d.index, d.reason) == (2, "load")
    # equal loads: the turn rotates the winner
    eq = [rv("a"), rv("b"), rv("c")]
    picks = [choose(eq, "x", policy="least-loaded", turn=t).index for t in range(3)]  # type: ignore[union-attr]
    assert sorted(picks) == [0, 1, 2]
    with pytest.raises(ValueError, match="unknown policy"):
        choose(views, "x", policy="fastest")


def test_base_model_requests_go_by_load() -> None:
    views = [rv("a", running=5), rv("b", running=1)]
    d = choose(views, None)
    assert d is not None and (d.index, d.reason) == (1, "load")


def test_weights_are_configurable() -> None:
    views = [rv("a", {"x": "host"}, running=10), rv("b")]
    assert choose(views, "x").index == 0  # type: ignore[union-attr]
    heavy = Weights(running=0.1)  # ten running requests now outweigh a host copy
    assert choose(views, "x", weights=heavy).index == 1  # type: ignore[union-attr]
    assert load(views[0], heavy) == pytest.approx(1.0)
    ev = [rv("a", {"x": "disk"}, evictions_per_s=5.0), rv("b", {"x": "disk"})]
    assert choose(ev, "x").index == 1  # type: ignore[union-attr]  # thrashing replica avoided


def test_weights_and_thresholds_validate() -> None:
    with pytest.raises(ValueError, match="device >= host"):
        Weights(device=0.1, host=0.5).validate()
    with pytest.raises(ValueError, match="waiting"):
        Weights(waiting=-1).validate()
    with pytest.raises(ValueError, match="max_kv_usage"):
        Thresholds(max_kv_usage=0).validate()
    with pytest.raises(ValueError, match="max_waiting"):
        Thresholds(max_waiting=0).validate()
    Weights().validate()
    Thresholds().validate()


def test_disk_copy_preferred_when_nobody_holds_it_in_memory() -> None:
    # an object-store adapter already in b's disk cache: b, unless b is much busier
    views = [rv(f"http://r{i}", {"x": "disk"} if i == 1 else {}) for i in range(4)]
    d = choose(views, "x")
    assert d is not None and (d.index, d.reason) == (1, "load")
    busy = [rv(v.url, dict(v.tiers), in_flight=(10 if i == 1 else 0)) for i, v in enumerate(views)]
    d = choose(busy, "x", thresholds=Thresholds(max_in_flight=32))
    assert d is not None and d.index == 1  # the only disk copy: least loaded among candidates


def test_home_holds_within_the_load_bound() -> None:
    w = Weights()
    urls = [f"http://r{i}" for i in range(4)]
    idle = [rv(u) for u in urls]
    h = home(idle, "x", [0, 1, 2, 3], w)
    # the home one request busier than the rest is still within (1 + balance) * mean + 1 req
    one = [rv(u, in_flight=(1 if i == h else 0)) for i, u in enumerate(urls)]
    assert choose(one, "x").index == h  # type: ignore[union-attr]
    # three requests busier is not
    three = [rv(u, in_flight=(3 if i == h else 0)) for i, u in enumerate(urls)]
    assert choose(three, "x").index != h  # type: ignore[union-attr]


def test_warm_copy_loses_to_a_much_less_loaded_replica() -> None:
    th = Thresholds(max_in_flight=100)
    near = [rv("a", {"x": "device"}, in_flight=10), rv("b")]
    assert choose(near, "x", thresholds=th).index == 0  # type: ignore[union-attr]
    far = [rv("a", {"x": "device"}, in_flight=25), rv("b")]
    d = choose(far, "x", thresholds=th)  # 25 * 0.05 > device weight 1.0
    assert d is not None and (d.index, d.reason) == (1, "load")
