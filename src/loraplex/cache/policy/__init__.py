"""Eviction policies by name (bookkeeping and scoring; only the cache controller consults one).

Policies
--------
``lru``     evict the least recently requested adapter (the baseline vLLM/LoRAX/SGLang users have).
``fifo``    evict the adapter that entered the tier first.
``lfu``     evict the adapter with the fewest requests ever (ties: least recent).
``hybrid``  the default (its keep-score: ``hybrid``'s docstring).
``hybrid-forecast``  hybrid plus a demand-forecast term (``forecast``): for tenants with daily
            patterns (office hours); the sim's diurnal workload shows what it buys.

Modules: ``base`` (the :class:`EvictionPolicy` protocol, :class:`AdapterInfo`, the baselines),
``hybrid`` (both hybrids), ``forecast`` (:class:`DemandForecast`) and ``belady`` (the offline
optimum on a trace, for comparison). Here: :data:`POLICIES` and :func:`make_policy`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from loraplex.cache.policy.base import (
    AdapterInfo,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
)
from loraplex.cache.policy.belady import belady_hit_ratio, belady_hits
from loraplex.cache.policy.forecast import DemandForecast
from loraplex.cache.policy.hybrid import ForecastHybridPolicy, HybridPolicy

__all__ = [
    "POLICIES",
    "AdapterInfo",
    "DemandForecast",
    "EvictionPolicy",
    "FIFOPolicy",
    "ForecastHybridPolicy",
    "HybridPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "belady_hit_ratio",
    "belady_hits",
    "make_policy",
]


POLICIES: Mapping[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "hybrid": HybridPolicy,
    "hybrid-forecast": ForecastHybridPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
}
"""Policy names accepted by ``make_policy`` (and ``--adapter-eviction-policy``)."""


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    """A fresh policy by name; ``kwargs`` go to its constructor."""
    try:
        factory = POLICIES[name.strip().lower()]
    except KeyError:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; valid policies: {valid}") from None
    return factory(**kwargs)
