"""Errors of the tiered adapter cache that callers act on (no torch: the controller raises them).

Defined in :mod:`loraplex.types` (the server maps them without importing the cache); re-exported
here for the cache's own modules and users.
"""

from __future__ import annotations

from loraplex.types import AdapterCapacityError, AdapterInUseError

__all__ = ["AdapterCapacityError", "AdapterInUseError"]
