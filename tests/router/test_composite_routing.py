"""A request composing several adapters goes to the replica that holds most of them (issue 49).

Before, the router routed by ``model`` alone: a ``merged_adapters`` request naming the base
model routed by load, one naming ``alpha`` went where alpha was, wherever its other components
were. Now affinity is the mean of the components' tier weights, and a replica that served a
composition holds every component in the router's view.
"""

from __future__ import annotations

import httpx
import pytest

from loraplex.router.app import Router, route_adapters
from loraplex.router.config import RouterConfig
from loraplex.router.homes import Picker
from loraplex.router.scoring import ReplicaView, Weights, choose
from loraplex.types import MAX_COMPOSED_ADAPTERS

PAIR = ("a", "b")


def rv(url: str, tiers: dict[str, str] | None = None, **kw: object) -> ReplicaView:
    return ReplicaView(url=url, tiers=tiers or {}, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["residency", "home"])
def test_the_replica_holding_most_components_wins(policy: str) -> None:
    views = [
        rv("r0", {"a": "device"}),  # one of two, on the device
        rv("r1", {"a": "host", "b": "host"}),  # both, in host memory
        rv("r2", {"b": "device", "c": "device"}),
        rv("r3"),
    ]
    d = choose(views, "a", components=PAIR, policy=policy, home=[0])
    assert d is not None and (d.index, d.reason) == (1, "affinity"), d
    # both on the device beats both in host memory, and one of them alone
    views.append(rv("r4", {"a": "device", "b": "device"}))
    d = choose(views, "a", components=PAIR, policy=policy, home=[0])
    assert d is not None and d.index == 4, d
    # a single-adapter request still goes where its adapter is best
    d = choose(views[:4], "a", policy=policy, home=[0])
    assert d is not None and d.index == 0, d


def test_held_everywhere_equally_load_decides_and_saturation_releases() -> None:
    both = {"a": "device", "b": "device"}
    views = [rv("r0", both, waiting=3), rv("r1", both)]
    d = choose(views, "a", components=PAIR)
    assert d is not None and d.index == 1
    views = [rv("r0", both, waiting=10), rv("r1", {"a": "host"})]  # r0 saturated
    d = choose(views, "a", components=PAIR)
    assert d is not None and (d.index, d.reason) == (1, "affinity")


@pytest.mark.parametrize("policy", ["residency", "home"])
def test_a_composition_held_nowhere_goes_where_its_primary_would(policy: str) -> None:
    views = [rv(f"r{i}", {"a": "disk"} if i == 2 else {}) for i in range(5)]
    home = [3, 1] if policy == "home" else None
    alone = choose(views, "a", policy=policy, home=home)
    composed = choose(views, "a", components=PAIR, policy=policy, home=home)
    assert alone is not None and composed is not None
    assert (composed.index, composed.reason) == (alone.index, alone.reason)


def test_scores_rank_by_components_held() -> None:
    w = Weights(hash=0)
    views = [rv("n"), rv("one", {"b": "host"}), rv("two", {"a": "host", "b": "host"})]
    d = choose(views, "a", components=PAIR, weights=w)
    assert d is not None
    assert d.scores[0] < d.scores[1] < d.scores[2]
    assert d.scores[2] == pytest.approx(w.host) and d.scores[1] == pytest.approx(w.host / 2)


def test_route_adapters_reads_compositions_boundedly() -> None:
    def base(n: str) -> bool:
        return n == "tiny"

    assert route_adapters({"model": "a"}, base) == ("a", ())
    assert route_adapters({"model": "tiny"}, base) == (None, ())
    assert route_adapters(None, base) == (None, ())
    merged = {"model": "tiny", "merged_adapters": {"ids": ["a", "b"], "weights": [1, 2]}}
    assert route_adapters(merged, base) == ("a", ("a", "b"))
    merged["model"] = "b"  # model among the ids: the primary
    assert route_adapters(merged, base) == ("b", ("b", "a"))
    listed = {"model": "tiny", "lora_requests": [{"lora_name": "x"}, {"name": "y", "scale": 2}]}
    assert route_adapters(listed, base) == ("x", ("x", "y"))
    assert route_adapters({"model": "a", "lora_scale": 0.5}, base) == ("a", ())
    one = {"model": "tiny", "merged_adapters": {"ids": ["a", "a", "tiny"]}}
    assert route_adapters(one, base) == ("a", ())
    many = {"model": "tiny", "merged_adapters": {"ids": [f"n{i}" for i in range(10_000)]}}
    _, names = route_adapters(many, base)
    assert len(names) == MAX_COMPOSED_ADAPTERS
    for junk in ({"ids": "a"}, {"ids": [1, None, {}]}, "a", [1]):
        assert route_adapters({"model": "m", "merged_adapters": junk}, base) == ("m", ())


def test_a_served_composition_marks_every_component_on_the_device() -> None:
    router = Router(RouterConfig(replicas=["http://r0", "http://r1"]))
    rep = router.replicas.ordered()[0]
    rep.tiers.update({"a": "absent", "b": "disk"})
    resp = httpx.Response(200, headers={"x-loraplex-adapter-state": "cold"})
    router._observe_headers(rep, "a", resp, ("a", "b"))
    assert rep.tiers["a"] == rep.tiers["b"] == "device"
    views = [r.view() for r in router.replicas.ordered()]
    d = Picker("residency").pick(views, "b", components=("b", "a"))
    assert d is not None and d.index == 0 and d.reason == "affinity"
