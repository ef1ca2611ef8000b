"""The eviction-policy protocol, what it knows of an adapter, and the simple baselines.

A policy is pure bookkeeping and scoring, no constraints (those live in ``residency``). It
watches requests (``on_access``), tier membership (``on_insert`` / ``on_evict``) and measured
load times (``record_load_cost``), and when a tier needs room it orders the evictable candidates
from the lowest keep-score (first victim) to the highest (``order_victims``). It never decides
*whether* something may be evicted: in-flight, pinned, too-new entries and tenant budgets are
enforced by :class:`loraplex.cache.residency.TierIndex` around any policy.

One policy instance may serve every tier of a cache: per-key statistics (recency, frequency) are
global to the request stream, per-tier state (load costs, membership) is keyed by the tier name.
The owner calls ``on_access`` exactly once per request; a ``TierIndex`` calls the other hooks.

Baselines: ``lru`` evicts the least recently requested adapter (what vLLM/LoRAX/SGLang users
have), ``fifo`` the adapter that entered the tier first, ``lfu`` the adapter with the fewest
requests ever (ties: least recent). The default, ``hybrid``, is in :mod:`.hybrid`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What residency decisions know about an adapter. ``key`` is its content digest."""

    key: str
    size_bytes: int
    tenant: str | None = None
    priority: int = 0
    """Higher = more important (SLO class maps to it)."""
    rank: int = 0

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("AdapterInfo.key must be a non-empty digest string")
        if self.size_bytes < 0:
            raise ValueError(f"AdapterInfo.size_bytes must be >= 0, got {self.size_bytes}")


@runtime_checkable
class EvictionPolicy(Protocol):
    """Bookkeeping + scoring for victim selection; see the module docstring."""

    name: str

    def on_access(self, key: str, info: AdapterInfo, now: float) -> None:
        """One request for ``key`` at ``now`` (called once per request, hit or miss)."""

    def on_insert(self, key: str, info: AdapterInfo, tier: str, now: float) -> None:
        """``key`` became resident in ``tier``."""

    def on_evict(self, key: str, tier: str, now: float) -> None:
        """``key`` left ``tier`` (evicted or removed)."""

    def record_load_cost(self, tier: str, key: str, seconds: float) -> None:
        """A load of ``key`` into ``tier`` took ``seconds`` (measured)."""

    def keep_score(self, key: str, tier: str, now: float, *, by_bytes: bool = True) -> float:
        """How much keeping ``key`` in ``tier`` is worth; higher = keep."""

    def order_victims(
        self, candidates: Sequence[str], tier: str, now: float, *, by_bytes: bool = True
    ) -> list[str]:
        """``candidates`` sorted lowest keep-score first (the first one is the first victim).

        ``by_bytes`` tells whether the tier is byte-budgeted (size matters) or slot-counted.
        """

    def worth_waiting(
        self,
        victims: Sequence[str],
        busy: Sequence[str],
        tier: str,
        now: float,
        *,
        by_bytes: bool = True,
    ) -> bool:
        """Better to wait until one of ``busy`` (in flight / too new) can go than evict ``victims``?

        Only consulted by patient admissions; a policy that never waits returns False.
        """


# --------------------------------------------------------------------------- simple baselines


class TrackingPolicy:
    """Shared bookkeeping: info, per-tier membership, bounded ghost state for non-resident keys."""

    name = "base"

    def __init__(self, *, max_tracked: int = 100_000) -> None:
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
        self.max_tracked = max_tracked
        self._info: dict[str, AdapterInfo] = {}
        self._tiers: dict[str, set[str]] = {}  # key -> tiers holding it
        self._inserted: dict[tuple[str, str], float] = {}  # (tier, key) -> time
        self._last: dict[str, float] = {}

    # hooks -----------------------------------------------------------------------------------
    def on_access(self, key: str, info: AdapterInfo, now: float) -> None:
        self._info[key] = info
        self._last[key] = now
        self._observe(key, now)
        if len(self._info) > self.max_tracked:
            self._prune()

    def on_insert(self, key: str, info: AdapterInfo, tier: str, now: float) -> None:
        self._info[key] = info
        self._last.setdefault(key, now)
        self._tiers.setdefault(key, set()).add(tier)
        self._inserted[(tier, key)] = now

    def on_evict(self, key: str, tier: str, now: float) -> None:
        tiers = self._tiers.get(key)
        if tiers is not None:
            tiers.discard(tier)
            if not tiers:
                del self._tiers[key]
        self._inserted.pop((tier, key), None)

    def record_load_cost(self, tier: str, key: str, seconds: float) -> None:
        return None

    def order_victims(
        self, candidates: Sequence[str], tier: str, now: float, *, by_bytes: bool = True
    ) -> list[str]:
        return sorted(
            candidates,
            key=lambda k: (
                self.keep_score(k, tier, now, by_bytes=by_bytes),
                self._last.get(k, -math.inf),
                k,
            ),
        )

    def keep_score(self, key: str, tier: str, now: float, *, by_bytes: bool = True) -> float:
        raise NotImplementedError

    def worth_waiting(
        self,
        victims: Sequence[str],
        busy: Sequence[str],
        tier: str,
        now: float,
        *,
        by_bytes: bool = True,
    ) -> bool:
        return False

    # internals -------------------------------------------------------------------------------
    def _observe(self, key: str, now: float) -> None:
        """Per-policy statistics update on a request."""

    def _forget(self, key: str) -> None:
        self._info.pop(key, None)
        self._last.pop(key, None)

    def _prune(self) -> None:
        """Drop the least recently seen tenth of the non-resident keys (ghosts)."""
        ghosts = [k for k in self._info if k not in self._tiers]
        ghosts.sort(key=lambda k: self._last.get(k, -math.inf))
        for k in ghosts[: max(1, len(self._info) // 10)]:
            self._forget(k)

    def info_of(self, key: str) -> AdapterInfo | None:
        """What the last request or insertion of ``key`` said about it (None: not tracked)."""
        return self._info.get(key)

    def resident_tiers(self, key: str) -> frozenset[str]:
        """The tiers this policy has been told hold ``key``."""
        return frozenset(self._tiers.get(key, ()))


class LRUPolicy(TrackingPolicy):
    """Least recently requested first. The keep-score is the last request time."""

    name = "lru"

    def keep_score(self, key: str, tier: str, now: float, *, by_bytes: bool = True) -> float:
        return self._last.get(key, -math.inf)

    def order_victims(
        self, candidates: Sequence[str], tier: str, now: float, *, by_bytes: bool = True
    ) -> list[str]:
        last = self._last
        return sorted(candidates, key=lambda k: (last.get(k, -math.inf), k))


class FIFOPolicy(TrackingPolicy):
    """First in (to this tier), first out. The keep-score is the insertion time."""

    name = "fifo"

    def keep_score(self, key: str, tier: str, now: float, *, by_bytes: bool = True) -> float:
        return self._inserted.get((tier, key), -math.inf)


class LFUPolicy(TrackingPolicy):
    """Fewest requests ever first (no decay: the textbook LFU, polluted by old hot keys)."""

    name = "lfu"

    def __init__(self, *, max_tracked: int = 100_000) -> None:
        super().__init__(max_tracked=max_tracked)
        self._count: dict[str, int] = {}

    def _observe(self, key: str, now: float) -> None:
        self._count[key] = self._count.get(key, 0) + 1

    def _forget(self, key: str) -> None:
        super()._forget(key)
        self._count.pop(key, None)

    def keep_score(self, key: str, tier: str, now: float, *, by_bytes: bool = True) -> float:
        return float(self._count.get(key, 0))
