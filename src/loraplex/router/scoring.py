"""Routing decisions as pure functions: a snapshot of each replica -> a score -> one choice.

Policy ``home`` (the default) adds one input, the adapter's home set (``loraplex.router.homes``:
a stable, traffic-sized set of replicas per adapter) and routes within it: the best-scoring
open member (a warm copy first, until it is saturated or much busier), outside it only when
every member is saturated or down ("spill", by the residency rules below over the rest).

"Affinity until saturated" (policy ``residency``: wherever the adapter is warm right now)::

    saturated(r) = r.waiting >= max_waiting or r.kv_usage >= max_kv_usage
                   or r.in_flight >= max_in_flight
    load(r)      = w_waiting * waiting + w_running * running + w_in_flight * in_flight
                   + w_kv * kv_usage + w_evictions * device evictions per second
    open         = healthy, unsaturated replicas (none: the least loaded one, "fallback")
    if some open replica holds the adapter in memory (device slot or host):
        pick argmax over open r of  tier_weight[tier on r] - load(r) + w_hash * h(adapter, r)
        ("affinity": a warm copy wins until its replica is saturated or much busier)
    else (on local disk or nowhere):
        home = the first replica in rendezvous order h(adapter, .) among those with the best
               tier (disk copies first) whose load <= (1 + w_balance) * mean load + w_in_flight
        ("load": consistent hashing with bounded loads, so a cold adapter always lands on the
        same replica while that replica is not much busier than the others; loading it
        everywhere in turn is what makes round-robin cold)

``h`` is a per-(adapter, replica) hash in [0, 1): removing a replica only moves the adapters
whose first choice it was. No I/O, no clocks, no randomness: the same views give the same
decision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.config.fields import check_fields, setting

TIERS = ("device", "host", "disk", "absent")
"""Where an adapter can sit on a replica, best first (the ``tier`` of ``/v1/adapters``)."""

POLICIES = ("home", "residency", "round-robin", "least-loaded")
REASONS = ("affinity", "home", "spill", "load", "fallback", "round_robin")
"""Decision reasons, the label values of ``loraplex_router_decisions_total``."""


def _weight(default: float, help: str) -> Any:
    return field(default=default, metadata=setting(ge=0, help=help))


@dataclass(frozen=True)
class Weights:
    """Score weights. Affinity is per tier; load terms are per unit (request, fraction, 1/s)."""

    device: float = _weight(1.0, "affinity of a copy in a device slot")
    host: float = _weight(0.6, "affinity of a copy in host memory")
    disk: float = _weight(0.25, "affinity of a copy on local disk")
    absent: float = _weight(0.0, "affinity where the adapter is not held")
    waiting: float = _weight(0.1, "load per queued request")
    running: float = _weight(0.02, "load per running request")
    in_flight: float = _weight(0.05, "load per request this router has outstanding there")
    kv_usage: float = _weight(0.5, "load per unit of KV-cache usage")
    evictions: float = _weight(0.1, "load per device eviction per second")
    hash: float = _weight(0.05, "weight of the per-(adapter, replica) hash")
    balance: float = _weight(0.25, "how much busier than the mean a cold adapter's home may be")

    def tier(self, tier: str) -> float:
        return {"device": self.device, "host": self.host, "disk": self.disk}.get(tier, self.absent)

    def validate(self) -> None:
        """Raise ValueError naming the first bad weight (all >= 0, device >= host >= disk)."""
        check_fields(self)
        if not self.device >= self.host >= self.disk >= self.absent:
            raise ValueError(
                "tier weights must satisfy device >= host >= disk >= absent, got "
                f"{self.device}, {self.host}, {self.disk}, {self.absent}"
            )


@dataclass(frozen=True)
class Thresholds:
    """When a replica counts as saturated (affinity no longer counts there)."""

    max_waiting: int = field(
        default=4,
        metadata=setting(
            "--max-waiting",
            ge=1,
            metavar="N",
            group="routing",
            help="queue depth at which a replica is saturated (default: {default})",
        ),
    )
    max_kv_usage: float = field(
        default=0.9,
        metadata=setting(
            "--max-kv-usage",
            gt=0,
            le=1,
            metavar="FRACTION",
            group="routing",
            help="KV-cache usage at which a replica is saturated (default: {default})",
        ),
    )
    max_in_flight: int = field(
        default=32,
        metadata=setting(
            "--max-in-flight",
            ge=1,
            metavar="N",
            group="routing",
            help="router requests outstanding at which a replica is saturated (default: {default})",
        ),
    )

    def validate(self) -> None:
        """Raise ValueError naming the first bad threshold (the declared bounds)."""
        check_fields(self)


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows about one replica at decision time (an immutable snapshot)."""

    url: str
    healthy: bool = True
    tiers: Mapping[str, str] = field(default_factory=dict)  # adapter name -> tier
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    evictions_per_s: float = 0.0  # device-tier evictions per second, recent
    in_flight: int = 0  # requests this router has outstanding there
    memory: int | None = None  # adapters it holds in memory (device + host) at most; None: unknown

    def tier_of(self, adapter: str) -> str:
        return self.tiers.get(adapter, "absent")


@dataclass(frozen=True)
class Decision:
    """The chosen replica (index into the views), why, and every candidate's score."""

    index: int
    reason: str
    scores: tuple[float, ...]


def is_saturated(v: ReplicaView, th: Thresholds) -> bool:
    return (
        v.waiting >= th.max_waiting
        or v.kv_usage >= th.max_kv_usage
        or (v.in_flight >= th.max_in_flight)
    )


def load(v: ReplicaView, w: Weights) -> float:
    """Higher = busier."""
    return (
        w.waiting * v.waiting
        + w.running * v.running
        + w.in_flight * v.in_flight
        + w.kv_usage * v.kv_usage
        + w.evictions * v.evictions_per_s
    )


def rendezvous(adapter: str, url: str) -> float:
    """A stable pseudo-random number in [0, 1) for (adapter, replica) (highest-random-weight
    hashing: removing a replica only moves the adapters whose top choice it was)."""
    h = hashlib.blake2b(f"{adapter}\0{url}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def score(
    v: ReplicaView,
    adapter: str | None,
    w: Weights,
    th: Thresholds,
    components: Sequence[str] = (),
) -> float:
    """Affinity (zero once saturated) minus load, plus the small stable hash term. A
    composition's affinity is the mean of its ``components``' tier weights there, so the replica
    holding most of them (in the best tiers) scores highest."""
    affinity = 0.0
    if adapter is not None and not is_saturated(v, th):
        names = components or (adapter,)
        affinity = sum(w.tier(v.tier_of(a)) for a in names) / len(names)
    tie = w.hash * rendezvous(adapter, v.url) if adapter is not None else 0.0
    return affinity - load(v, w) + tie


def _warm(v: ReplicaView, adapter: str, components: Sequence[str]) -> bool:
    """Whether ``v`` holds the adapter (or any of a composition's components) in memory."""
    return any(v.tier_of(a) in ("device", "host") for a in (components or (adapter,)))


def choose(
    views: Sequence[ReplicaView],
    adapter: str | None,
    *,
    policy: str = "residency",
    weights: Weights | None = None,
    thresholds: Thresholds | None = None,
    turn: int = 0,
    exclude: frozenset[int] = frozenset(),
    home: Sequence[int] | None = None,
    components: Sequence[str] = (),
) -> Decision | None:
    """Pick a replica for a request naming ``adapter`` (``None``: the base model).

    ``components``: a request composing several adapters names them all here and its first
    (its primary) as ``adapter``. Affinity is then the mean over the components (:func:`score`:
    the replica holding most of them wins, until saturated or much busier), a replica is warm
    when it holds any of them, and a composition held nowhere goes where its primary would
    (its home set, or its rendezvous home).

    ``turn`` is a counter the caller advances per request (round-robin, and the starting point
    that breaks exact ties fairly); ``exclude`` holds indices already tried for this request.
    ``home`` (policy ``home``): the adapter's home set, indices into ``views`` best first
    (``loraplex.router.homes.HomeMap``; None: its first live replica in rendezvous order)::

        members = open (healthy, unsaturated, not excluded) replicas of the home set
        members: argmax over members of score (a warm copy first, until much busier)
                 -> "affinity" if it holds the adapter in memory, else "home"
        none:    the residency policy over the open replicas outside it -> "spill"

    Returns None when no healthy replica is left.
    """
    w = weights or Weights()
    th = thresholds or Thresholds()
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    n = len(views)
    order = [(turn + k) % n for k in range(n)] if n else []
    live = [i for i in order if views[i].healthy and i not in exclude]
    if not live:
        return None
    if policy == "round-robin":
        return Decision(live[0], "round_robin", tuple(0.0 for _ in views))
    if policy == "least-loaded":
        scores = tuple(-load(v, w) for v in views)
        best = max(live, key=lambda i: scores[i])  # first of equals in rotating order
        return Decision(best, "load", scores)
    scores = tuple(score(v, adapter, w, th, components) for v in views)
    open_ = [i for i in live if not is_saturated(views[i], th)]
    if not open_:
        loads = {i: load(views[i], w) for i in live}
        return Decision(min(live, key=lambda i: loads[i]), "fallback", scores)
    if adapter is None:  # the base model: anywhere, by load
        return Decision(min(open_, key=lambda i: load(views[i], w)), "load", scores)
    if policy == "home":
        if home is None:
            home = sorted(live, key=lambda i: rendezvous(adapter, views[i].url), reverse=True)[:1]
        members = [i for i in home if i in open_]
        if members:
            if components:  # a composition: the members or any replica holding more of it
                warm_ = [i for i in open_ if _warm(views[i], adapter, components)]
                members = list(dict.fromkeys([*members, *warm_]))
            best = max(members, key=lambda i: scores[i])  # first of equals: home order
            warm = _warm(views[best], adapter, components)
            return Decision(best, "affinity" if warm else "home", scores)
        outside = [i for i in open_ if i not in home]
        if outside:
            i = _residency(views, adapter, outside, scores, w, components)[0]
            return Decision(i, "spill", scores)
        # every open replica is in the home set, yet none is open: cannot happen
    best, reason = _residency(views, adapter, open_, scores, w, components)
    return Decision(best, reason, scores)


def _residency(
    views: Sequence[ReplicaView],
    adapter: str,
    open_: list[int],
    scores: tuple[float, ...],
    w: Weights,
    components: Sequence[str] = (),
) -> tuple[int, str]:
    """The residency policy among ``open_``: a copy in memory by score, else the bounded-load
    rendezvous home among the best tier (module docstring). A composition: by score wherever
    any component is in memory, else as its primary ``adapter``."""
    if components and any(_warm(views[i], adapter, components) for i in open_):
        best = max(open_, key=lambda i: scores[i])
        return best, "affinity" if _warm(views[best], adapter, components) else "load"
    rank = {i: TIERS.index(views[i].tier_of(adapter)) for i in open_}
    best_rank = min(rank.values())
    if TIERS[best_rank] in ("device", "host"):
        best = max(open_, key=lambda i: scores[i])
        reason = "affinity" if TIERS[rank[best]] in ("device", "host") else "load"
        return best, reason
    return home(views, adapter, [i for i in open_ if rank[i] == best_rank], w), "load"


def home(views: Sequence[ReplicaView], adapter: str, candidates: list[int], w: Weights) -> int:
    """Consistent hashing with bounded loads: the first candidate in the adapter's rendezvous
    order whose load is at most ``(1 + w.balance) * mean load + w.in_flight`` (mean over the
    candidates), else the least loaded candidate."""
    loads = {i: load(views[i], w) for i in candidates}
    bound = (1 + w.balance) * sum(loads.values()) / len(loads) + w.in_flight
    order = sorted(candidates, key=lambda i: rendezvous(adapter, views[i].url), reverse=True)
    for i in order:
        if loads[i] <= bound + 1e-12:
            return i
    return min(candidates, key=lambda i: loads[i])
