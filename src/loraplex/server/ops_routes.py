"""Operational routes: ``/health`` and vLLM's ``/ping`` (200 while the engine loop runs, else
503; always open, for probes), ``/version`` and ``/metrics`` (Prometheus text format). Every
GET route of the app answers HEAD too (:func:`allow_head`), as vLLM's do.

Where auth is required (see :mod:`~loraplex.server.auth`), ``/version`` needs any valid key and
``/metrics`` the ``--metrics-api-key`` or an operator key; a tenant key gets 403 on ``/metrics``,
whose labels name every tenant's adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from fastapi.routing import APIRoute

import loraplex
from loraplex.registry import Principal
from loraplex.server.auth import metrics_principal
from loraplex.server.errors import APIError
from loraplex.server.metrics import CONTENT_TYPE
from loraplex.server.state import ServerState, get_state

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(state: ServerState = Depends(get_state)) -> Response:
    if not state.client.is_running:
        return APIError(503, "the engine is not running", "service_unavailable").response()
    return Response(status_code=200)


@router.api_route("/ping", methods=["GET", "HEAD", "POST"])
async def ping(state: ServerState = Depends(get_state)) -> Response:
    """vLLM's (SageMaker's) liveness route: ``/health``'s answer."""
    return await health(state)


@router.api_route("/version", methods=["GET", "HEAD"])
async def version() -> dict[str, str]:
    return {"version": loraplex.__version__}


@router.api_route("/metrics", methods=["GET", "HEAD"])
def metrics(
    principal: Principal = Depends(metrics_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def allow_head(*routers: APIRouter) -> None:
    """Let every GET route of ``routers`` answer HEAD as well (the same handler; the server
    sends the headers without the body). Call before the routers are included in an app
    (idempotent)."""
    for r in routers:
        for route in r.routes:
            if isinstance(route, APIRoute) and "GET" in route.methods:
                route.methods.add("HEAD")
