"""The residency router's decision rules (``rank_replicas``), without a cluster."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'loraplex[ray]'")

from loraplex.integrations.ray_serve.routing import ReplicaView, rank_replicas, rendezvous


def _rank(
    adapter: str,
    views: list[ReplicaView],
    sent: dict[str, float] | None = None,
    pending: dict[str, int] | None = None,
    **kw: float,
) -> list[list[str]]:
    return rank_replicas(adapter, views, sent or {}, pending or {}, saturation=4, **kw).ranks


def test_a_warm_replica_comes_first() -> None:
    views = [
        ReplicaView("r1", ongoing=3, adapters={"a": "host"}, host_capacity=2, reported_at=10),
        ReplicaView("r2", ongoing=0, host_capacity=2, reported_at=10),
    ]
    assert _rank("a", views) == [["r1"], ["r2"]]
    assert rank_replicas("a", views, {}, {}, saturation=4).home is None


def test_a_send_not_yet_reported_counts_as_warm() -> None:
    views = [ReplicaView("r1", reported_at=10, host_capacity=2), ReplicaView("r2", reported_at=10)]
    assert _rank("a", views, sent={"r2": 11.0})[0] == ["r2"]
    assert _rank("a", views, sent={"r2": 9.5}, pending_s=1.0)[0] == ["r2"]  # just before it
    # sent long before a report that does not list it: evicted since (or never loaded)
    assert _rank("a", views, sent={"r2": 1.0}, pending_s=1.0)[0] == ["r1"]


def test_a_cold_adapter_goes_to_the_most_free_host_memory() -> None:
    full = ReplicaView("r1", adapters={"x": "host", "y": "device"}, host_capacity=3, reported_at=1)
    empty = ReplicaView("r2", host_capacity=3, reported_at=1)
    for name in ("a", "b", "c", "d"):
        ranking = rank_replicas(name, [full, empty], {}, {}, saturation=4)
        assert ranking.ranks[0] == ["r2"] and ranking.home == "r2"
    # pending loads take room too: concurrent cold adapters spread
    assert _rank("a", [full, empty], pending={"r2": 3})[0] == ["r1"]
    # equal room (or none anywhere): the rendezvous hash decides, the same in every process
    views = [ReplicaView(f"r{i}", host_capacity=4, reported_at=1) for i in range(4)]
    home = _rank("a", views)[0]
    assert home == [max(views, key=lambda v: rendezvous("a", v.id)).id]
    assert _rank("a", list(reversed(views)))[0] == home
    full_everywhere = [
        ReplicaView(f"r{i}", adapters={"x": "host"}, host_capacity=1) for i in range(4)
    ]
    assert _rank("b", full_everywhere)[0] == _rank("b", full_everywhere[::-1])[0]


def test_a_saturated_warm_replica_spills_to_the_least_loaded() -> None:
    views = [
        ReplicaView("r1", ongoing=4, adapters={"a": "device"}, host_capacity=2, reported_at=1),
        ReplicaView(
            "r2", ongoing=1, adapters={"x": "host", "y": "host"}, host_capacity=2, reported_at=1
        ),
        ReplicaView("r3", ongoing=2, host_capacity=2, reported_at=1),
    ]
    assert _rank("a", views) == [["r3"], ["r2"], ["r1"]]
    # everything saturated: still a ranking (Ray backs off and retries)
    busy = [ReplicaView("r1", ongoing=9), ReplicaView("r2", ongoing=9)]
    assert sorted(r for rank in _rank("a", busy) for r in rank) == ["r1", "r2"]


def test_before_any_report_a_cold_burst_spreads_by_pending_loads() -> None:
    views = [ReplicaView("r1"), ReplicaView("r2")]  # just deployed: no report yet
    homes = []
    pending: dict[str, int] = {}
    for name in ("a", "b", "c", "d"):
        home = rank_replicas(name, views, {}, pending, saturation=4).home
        assert home is not None
        pending[home] = pending.get(home, 0) + 1
        homes.append(home)
    assert sorted(homes) == ["r1", "r1", "r2", "r2"]


def test_the_ingress_routes_a_composition_by_its_primary_adapter() -> None:
    """``model``, or a composition's primary (``model`` when listed, else the first listed),
    as ``loraplex route`` picks it; the base model and malformed bodies route by nothing."""
    import json

    from loraplex.integrations.ray_serve.asgi import ForwardedRequest
    from loraplex.integrations.ray_serve.deployments import routed_adapter

    def adapter(body: object, method: str = "POST") -> str:
        raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
        return routed_adapter(ForwardedRequest(method, "/v1/completions", body=raw), ("base",))

    assert adapter({"model": "sql"}) == "sql"
    assert adapter({"model": "base"}) == ""
    assert adapter({"model": "base", "merged_adapters": {"ids": ["a", "b"]}}) == "a"
    assert adapter({"model": "b", "merged_adapters": {"ids": ["a", "b"]}}) == "b"
    assert adapter({"model": "base", "lora_requests": [{"lora_name": "c"}, {"name": "d"}]}) == "c"
    assert adapter(b"{not json") == "" and adapter({"model": "sql"}, "GET") == ""
