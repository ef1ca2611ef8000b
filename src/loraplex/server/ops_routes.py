"""Operational routes: ``/health`` and vLLM's ``/ping`` (200 while the engine loop runs, else
503; always open, for probes), ``/version`` and ``/metrics`` (Prometheus text format). Every
GET route of the app answers HEAD too (:class:`HeadAsGet`), as vLLM's do.

Where auth is required (see :mod:`~loraplex.server.auth`), ``/version`` needs any valid key and
``/metrics`` the ``--metrics-api-key`` or an operator key; a tenant key gets 403 on ``/metrics``,
whose labels name every tenant's adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import loraplex
from loraplex.registry import Principal
from loraplex.server.auth import metrics_principal
from loraplex.server.errors import APIError
from loraplex.server.metrics import CONTENT_TYPE
from loraplex.server.state import ServerState, get_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(get_state)) -> Response:
    if not state.client.is_running:
        return APIError(503, "the engine is not running", "service_unavailable").response()
    return Response(status_code=200)


@router.get("/ping")
async def ping(state: ServerState = Depends(get_state)) -> Response:
    """vLLM's (SageMaker's) liveness route: ``/health``'s answer."""
    return await health(state)


@router.post("/ping")
async def ping_post(state: ServerState = Depends(get_state)) -> Response:
    """``POST /ping``, as SageMaker's health checks send it (one OpenAPI operation each)."""
    return await health(state)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": loraplex.__version__}


@router.get("/metrics")
def metrics(
    principal: Principal = Depends(metrics_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


class HeadAsGet:
    """ASGI middleware: a HEAD request is served by the GET route of its path, its response
    sent without the body (headers, Content-Length included, as for GET). One place for every
    route, and the OpenAPI schema keeps one operation per route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
