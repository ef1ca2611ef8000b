"""The tiered cache's counters: one set, one source per number.

Each tier's :class:`~loraplex.cache.residency.TierIndex` keeps its own :class:`TierCounters`
(lookups that hit or missed, inserts = loads into the tier, policy evictions, reloads soon
after an eviction). :class:`CacheStats` holds those (the same objects, never copies) plus the
few events no tier sees: object-store downloads, failed loads, waits for room, bad disk copies
replaced and waits for another request's load that timed out. Anything
else is derived from them (``cold_requests`` is the host tier's misses). Per-adapter numbers
for the residency view are :class:`AdapterUsage`.

No torch, no threads: the owner (the tier controller, under its cache's lock) updates them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loraplex.cache.policy import AdapterInfo

__all__ = ["AdapterUsage", "CacheStats", "TierCounters"]


@dataclass
class TierCounters:
    """Monotonic counters of one tier (the cache exports them as Prometheus metrics)."""

    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    reload_after_eviction: int = 0
    """Inserts of a key evicted from this tier less than ``thrash_window_s`` before."""

    @property
    def thrash_ratio(self) -> float:
        """Reloads within the window after an eviction / evictions (0 when nothing evicted)."""
        return self.reload_after_eviction / self.evictions if self.evictions else 0.0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class CacheStats:
    """Per-tier counters (by tier name) and the cache-wide events no tier counts."""

    tiers: dict[str, TierCounters] = field(default_factory=dict)
    remote_loads: int = 0  # downloads from the object store (L3)
    load_failures: int = 0  # failed loads (each fails all the requests that shared it)
    capacity_waits: int = 0  # loads that had to wait for room in host memory or on disk
    slot_waits: int = 0  # slot reservations refused (every slot in use, pinned or too new)
    bad_copies_replaced: int = 0  # bad L2 copies deleted and fetched again from L3
    join_timeouts: int = 0  # requests that stopped waiting for a load another one started
    host_tier: str = "host"
    device_tier: str = "device"

    @property
    def cold_requests(self) -> int:
        """Requests whose adapter was in no memory tier on arrival: the host tier's misses."""
        host = self.tiers.get(self.host_tier)
        return host.misses if host is not None else 0

    @property
    def slot_evictions(self) -> int:
        """Adapters the policy evicted from a device slot."""
        device = self.tiers.get(self.device_tier)
        return device.evictions if device is not None else 0

    def snapshot(self) -> dict[str, int]:
        """A flat copy for reports and deltas: the events, ``cold_requests`` and
        ``<tier>_<counter>`` for each tier's counters (e.g. ``disk_hits``, ``host_evictions``)."""
        out = {
            "remote_loads": self.remote_loads,
            "load_failures": self.load_failures,
            "capacity_waits": self.capacity_waits,
            "slot_waits": self.slot_waits,
            "bad_copies_replaced": self.bad_copies_replaced,
            "join_timeouts": self.join_timeouts,
            "cold_requests": self.cold_requests,
        }
        for tier, c in self.tiers.items():
            for f in dataclasses.fields(c):
                out[f"{tier}_{f.name}"] = getattr(c, f.name)
        return out


@dataclass
class AdapterUsage:
    """Per-adapter counters for the residency view (kept for every digest ever loaded).

    ``last_access`` is in the controller's clock (the cache converts it to wall-clock time).
    """

    info: AdapterInfo
    hits: int = 0  # requests that found it in host memory
    loads: int = 0  # loads into host memory
    evictions: int = 0  # times it left host memory or a slot (evicted or removed)
    last_access: float = 0.0
