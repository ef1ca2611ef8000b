"""What sharing KV across adapters did: per-adapter prefix-cache lookups and hits, the tokens
adapter requests took from base-aligned blocks, and activated-LoRA invocations.

Adapters are counted by digest; past :data:`MAX_TRACKED_ADAPTERS` distinct digests the rest are
counted under :data:`OTHER`, so memory stays bounded whatever the traffic (the metrics export
the top entries only, as the residency gauges do).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

BASE = ""
"""The key of base-model requests."""
OTHER = "other"
"""The key of adapters beyond :data:`MAX_TRACKED_ADAPTERS`."""
MAX_TRACKED_ADAPTERS = 4096


@dataclass
class SharingStats:
    """Counters since start-up (tokens unless named otherwise)."""

    queries: Counter[str] = field(default_factory=Counter)  # prompt tokens looked up, by digest
    hits: Counter[str] = field(default_factory=Counter)  # of those, found in the cache
    base_aligned_hits: int = 0  # adapter requests' hits on base-keyed blocks
    alora_invoked: int = 0  # aLoRA requests whose prompt holds the invocation (requests)
    alora_not_invoked: int = 0  # aLoRA requests without it: the base model ran (requests)

    def _key(self, digest: str | None) -> str:
        key = BASE if digest is None else digest
        if key in self.queries or len(self.queries) < MAX_TRACKED_ADAPTERS:
            return key
        return OTHER

    def record_lookup(self, digest: str | None, query: int, hit: int, base_aligned: int) -> None:
        """One admitted request's prompt: ``query`` tokens looked up, ``hit`` found, of which
        ``base_aligned`` in base-keyed blocks (0 for base requests)."""
        key = self._key(digest)
        self.queries[key] += query
        self.hits[key] += hit
        self.base_aligned_hits += base_aligned

    def record_alora(self, invoked: bool) -> None:
        if invoked:
            self.alora_invoked += 1
        else:
            self.alora_not_invoked += 1
