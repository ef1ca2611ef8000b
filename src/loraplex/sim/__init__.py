"""Cache simulator: replay request traces through the adapter tiers and eviction policies.

Pure Python (no torch): ``workloads`` (trace format, seeded generators), ``simulate`` (the replay
through :class:`loraplex.cache.residency.TierIndex` stacks) and ``cli`` (``loraplex sim``).
"""
