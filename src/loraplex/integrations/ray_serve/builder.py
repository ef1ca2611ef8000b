"""Build the Ray Serve application: ``build_app(config, options)`` in Python, ``app(args)`` for
``serve run`` / a Serve config file.

``serve run loraplex.integrations.ray_serve:app serve_args="MODEL_DIR --enable-lora ..."
routing=residency num_replicas=2``: ``serve_args`` is a ``loraplex serve`` command line (every
flag of ``loraplex serve``, ``--config`` files included; host and port are Ray's), the other
arguments are :class:`RayServeOptions` fields. Replica counts, autoscaling and actor options are
Ray's own deployment options: pass them here, or override the ``LoraplexEngine`` /
``LoraplexIngress`` deployments in a Serve config file.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, fields
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from loraplex.config import ServerConfig
from loraplex.integrations.ray_serve.deployments import (
    ROUTINGS,
    IngressSettings,
    LoraplexEngine,
    LoraplexIngress,
)
from loraplex.integrations.ray_serve.router import ResidencyRequestRouter

__all__ = ["RayServeOptions", "app", "build_app"]


@dataclass(frozen=True)
class RayServeOptions:
    """How the application is deployed (every field is also a ``serve run`` argument)."""

    routing: str = "residency"
    """``residency`` (our router, fed by each replica's residency), ``multiplex`` (Ray's
    default router with ``@serve.multiplexed``) or ``default`` (Ray's power-of-two choices)."""
    num_replicas: int | None = None  # engine replicas; None: Ray's default (1) or the config's
    autoscaling_config: dict[str, Any] | None = None  # Ray's AutoscalingConfig fields
    max_ongoing_requests: int = 64  # per engine replica (loraplex batches and admits itself)
    max_replicas_per_node: int | None = None
    engine_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1})
    ingress_replicas: int = 1
    ingress_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    routing_stats_period_s: float = 1.0  # how often each replica reports its residency
    saturation: int = 16  # ongoing requests at which a warm replica takes no more (residency)
    max_attempts: int = 5  # tries per request across replicas (failover)
    failover_timeout_s: float = 60.0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 10.0
    max_push_bytes: int = 1 << 30  # an adapter push's body (read once, sent to every replica)
    push_timeout_s: float = 300.0  # every engine replica's answer to a push, at most

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        for name in ("max_ongoing_requests", "ingress_replicas", "saturation", "max_attempts",
                     "max_push_bytes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.push_timeout_s <= 0:
            raise ValueError("push_timeout_s must be positive")


def build_app(config: ServerConfig, options: RayServeOptions | None = None) -> Application:
    """The ingress bound to ``LoraplexEngine`` replicas serving ``config``."""
    o = options or RayServeOptions()
    config.validate()
    router = (
        RequestRouterConfig(
            request_router_class=ResidencyRequestRouter,
            request_router_kwargs={"saturation": o.saturation},
            request_routing_stats_period_s=o.routing_stats_period_s,
        )
        if o.routing == "residency"
        else RequestRouterConfig(request_routing_stats_period_s=o.routing_stats_period_s)
    )
    engine_opts: dict[str, Any] = {
        "max_ongoing_requests": o.max_ongoing_requests,
        "ray_actor_options": dict(o.engine_actor_options),
        "request_router_config": router,
        "health_check_period_s": o.health_check_period_s,
        "health_check_timeout_s": o.health_check_timeout_s,
    }
    if o.autoscaling_config is not None:
        engine_opts["autoscaling_config"] = dict(o.autoscaling_config)
    elif o.num_replicas is not None:  # else Ray's default (1), or a Serve config file's
        engine_opts["num_replicas"] = o.num_replicas
    if o.max_replicas_per_node is not None:
        engine_opts["max_replicas_per_node"] = o.max_replicas_per_node
    engine = LoraplexEngine.options(**engine_opts).bind(config, o.routing)
    settings = IngressSettings(
        routing=o.routing,
        base_names=tuple(config.model_names),
        max_request_bytes=config.max_request_bytes,
        max_attempts=o.max_attempts,
        failover_timeout_s=o.failover_timeout_s,
        max_push_bytes=o.max_push_bytes,
        push_api_key=config.admin_api_key,
        push_timeout_s=o.push_timeout_s,
    )
    return LoraplexIngress.options(
        num_replicas=o.ingress_replicas, ray_actor_options=dict(o.ingress_actor_options)
    ).bind(engine, settings)


def app(args: dict[str, Any]) -> Application:
    """``serve run``'s application builder: ``serve_args`` (a ``loraplex serve`` command line,
    a string or a list) plus :class:`RayServeOptions` fields (strings from the command line are
    converted: numbers, ``null``, JSON objects)."""
    from loraplex.server.args import parse_serve_args

    args = dict(args)
    argv = args.pop("serve_args", None)
    if not argv:
        raise ValueError('serve_args is required: serve_args="MODEL_DIR --enable-lora ..."')
    config = parse_serve_args(shlex.split(argv) if isinstance(argv, str) else list(argv))
    return build_app(config, options_from_args(args))


def options_from_args(args: dict[str, Any]) -> RayServeOptions:
    """:class:`RayServeOptions` from ``serve run`` arguments (unknown names refused)."""
    known = {f.name for f in fields(RayServeOptions)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(unknown)}; known: serve_args, {', '.join(sorted(known))}"
        )
    return RayServeOptions(**{k: _value(v) for k, v in args.items()})


def _value(v: Any) -> Any:
    """A command-line string as JSON where it parses (``2``, ``0.5``, ``null``, ``{...}``)."""
    if not isinstance(v, str):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v
