"""Operational routes, open to every caller: ``/health`` (200 while the engine loop runs, else
503), ``/version`` and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

import loraplex
from loraplex.server.errors import APIError
from loraplex.server.metrics import CONTENT_TYPE
from loraplex.server.state import ServerState, get_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(get_state)) -> Response:
    if not state.client.is_running:
        return APIError(503, "the engine is not running", "service_unavailable").response()
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": loraplex.__version__}


@router.get("/metrics")
def metrics(state: ServerState = Depends(get_state)) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
