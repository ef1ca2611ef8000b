"""Cache simulator: replay request traces through the adapter tiers and eviction policies.

Pure Python (no torch): ``workloads`` (trace format, seeded generators), ``simulate`` (the replay
through the server's own :class:`loraplex.cache.controller.TierController`, in simulated time)
and ``cli`` (``loraplex sim``).
"""
