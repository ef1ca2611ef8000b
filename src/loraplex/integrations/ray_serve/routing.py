"""Where an adapter request goes among the engine replicas: the residency router's decision,
as a pure function of what the router knows (no Ray import; :mod:`.router` feeds it).

What it knows about each replica: its last residency report (every adapter it holds in a device
slot or host memory or is serving a request with, its host-tier capacity, the report's time;
sent by the replica's ``record_routing_stats``), the requests it has ongoing (Ray's queue-length cache), and when
this router last sent (or chose to send) each adapter there: a send the report cannot show yet
(made after it, or up to ``pending_s`` before it: a load takes a moment) is a pending load.

The rules, for a request naming ``adapter``::

    saturated(r)  = ongoing(r) >= min(saturation, max_ongoing(r))
    pending(a, r) = a not in report(r) and last_sent(a, r) + pending_s > reported_at(r)
    warm(r)       = adapter in report(r) or pending(adapter, r)
    free(r)       = host_capacity(r) - held(r) - #{a : pending(a, r)}
                    (a replica not reported yet: the largest capacity reported, see below)

    1. warm, not saturated                     -> rank 0 (Ray picks the shortest queue in it)
    2. warm somewhere but all of those saturated (a hot adapter spills):
           not saturated with free > 0, then the other not saturated, then the rest
    3. warm nowhere (a cold load): its home alone in rank 0, the not-saturated replica with
           the most free host memory (ties: the rendezvous hash of (adapter, replica)); then
           the other not-saturated ones, then the saturated ones

A cold adapter fills the emptiest host memory before anything is evicted, so in a fleet whose
host tiers can hold every adapter each one is loaded once, and the adapters spread evenly; once
every tier is full the hash makes the home stable (the same replica from every router). The
router records the home it chose as a pending send at once, so concurrent cold requests see
each other's loads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Ranking", "ReplicaView", "rank_replicas", "rendezvous"]

WARM_TIERS = ("device", "host", "serving")
"""Report entries the router routes to: in a device slot, in host memory, or held by a request
the replica is serving now (loaded, or being loaded, for it)."""
UNREPORTED_CAPACITY = 1 << 20
"""The host capacity assumed of a replica that has not reported yet when none has (just
deployed): all equally empty, so cold loads spread by their pending counts. Once some replica
has reported, an unreported one is assumed to have the largest capacity reported."""


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows about one replica (see the module docstring)."""

    id: str
    ongoing: int | None = None  # None: not known (counts as idle)
    max_ongoing: int = 64
    adapters: Mapping[str, str] = field(default_factory=dict)  # name -> device|host|serving
    host_capacity: int = 0
    reported_at: float = 0.0  # 0: never reported (its capacity is not known yet)


@dataclass(frozen=True)
class Ranking:
    """Replica ids in ranks, most preferred first; ``home``: the replica chosen for a cold
    load (rule 3), None when the adapter is warm somewhere."""

    ranks: list[list[str]]
    home: str | None = None


def rendezvous(adapter: str, replica: str) -> int:
    """A stable pseudo-random weight of (adapter, replica): the same in every process."""
    digest = hashlib.sha256(f"{adapter}\0{replica}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rank_replicas(
    adapter: str,
    replicas: Sequence[ReplicaView],
    last_sent: Mapping[str, float],
    pending_loads: Mapping[str, int],
    *,
    saturation: int,
    pending_s: float = 0.5,
) -> Ranking:
    """The module docstring's rules. ``last_sent``: replica id -> when this router last sent
    ``adapter`` there; ``pending_loads``: replica id -> adapters pending there (sent, not in
    its report); ``pending_s``: how long before a report a send still counts as not shown."""

    def saturated(r: ReplicaView) -> bool:
        return r.ongoing is not None and r.ongoing >= min(saturation, r.max_ongoing)

    def warm(r: ReplicaView) -> bool:
        sent = last_sent.get(r.id)
        return r.adapters.get(adapter) in WARM_TIERS or (
            sent is not None and sent + pending_s > r.reported_at
        )

    reported = [r.host_capacity for r in replicas if r.reported_at]
    unreported = max(reported) if reported else UNREPORTED_CAPACITY

    def free(r: ReplicaView) -> int:
        held = sum(1 for t in r.adapters.values() if t in WARM_TIERS)
        capacity = r.host_capacity if r.reported_at else unreported
        return capacity - held - pending_loads.get(r.id, 0)

    hot = [r for r in replicas if warm(r)]
    idle = [r for r in replicas if not saturated(r)]
    busy = [r for r in replicas if saturated(r)]
    home = None
    if any(not saturated(r) for r in hot):
        first = [r for r in hot if not saturated(r)]
        ranks = [first, [r for r in idle if r not in first], busy]
    elif hot:
        spill = [r for r in idle if r not in hot]
        ranks = [
            [r for r in spill if free(r) > 0],
            [r for r in spill if free(r) <= 0],
            hot,
            [r for r in busy if r not in hot],
        ]
    else:
        by_home = sorted(idle, key=lambda r: (-max(free(r), 0), -rendezvous(adapter, r.id)))
        ranks = [by_home[:1], by_home[1:], busy]
        home = by_home[0].id if by_home else None
    return Ranking([[r.id for r in rank] for rank in ranks if rank], home)
