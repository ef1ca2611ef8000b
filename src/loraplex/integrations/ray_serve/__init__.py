"""loraplex on Ray Serve: engine replicas (each a whole loraplex server with its tiered adapter
cache and registry view) behind an OpenAI-compatible ingress, requests routed to a replica that
holds their adapter.

``pip install loraplex[ray]``, then::

    serve run loraplex.integrations.ray_serve:app \\
        serve_args="/models/llama --enable-lora --registry-url sqlite:////srv/registry.db" \\
        routing=residency num_replicas=2

Modules: :mod:`.builder` (``build_app``, the ``serve run`` builder ``app``, ``RayServeOptions``),
:mod:`.deployments` (``LoraplexEngine``, ``LoraplexIngress``), :mod:`.router`
(``ResidencyRequestRouter``) and :mod:`.routing` (its decision rules), :mod:`.asgi` (running
the loraplex app in the replica's process), :mod:`.local_cluster` (a multi-node Ray cluster on
loopback for tests and benchmarks). See ``docs/ray.md``.
"""

from __future__ import annotations

try:
    import ray.serve  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "loraplex.integrations.ray_serve needs Ray Serve: pip install 'loraplex[ray]'"
    ) from e

from loraplex.integrations.ray_serve.builder import RayServeOptions, app, build_app
from loraplex.integrations.ray_serve.deployments import (
    IngressSettings,
    LoraplexEngine,
    LoraplexIngress,
)
from loraplex.integrations.ray_serve.router import ResidencyRequestRouter

__all__ = [
    "IngressSettings",
    "LoraplexEngine",
    "LoraplexIngress",
    "RayServeOptions",
    "ResidencyRequestRouter",
    "app",
    "build_app",
]
