"""Errors of the tiered adapter cache that callers act on (no torch: the controller raises them)."""

from __future__ import annotations

from loraplex.types import AdapterError

__all__ = ["AdapterCapacityError", "AdapterInUseError"]


class AdapterCapacityError(AdapterError):
    """No room for an adapter in a tier without breaking a hard constraint (every resident
    adapter in use or pinned), even after waiting. Transient: servers answer 503 + Retry-After."""

    def __init__(self, message: str, *, tier: str = "") -> None:
        super().__init__(message)
        self.tier = tier


class AdapterInUseError(AdapterError):
    """An admin eviction was refused: the adapter has in-flight requests or is pinned (409)."""
