"""Operational routes: ``/health`` (200 while the engine loop runs, else 503; always open, for
probes), ``/version`` and ``/metrics`` (Prometheus text format).

Where auth is required (see :mod:`~loraplex.server.auth`), ``/version`` needs any valid key and
``/metrics`` the ``--metrics-api-key`` or an operator key; a tenant key gets 403 on ``/metrics``,
whose labels name every tenant's adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

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


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": loraplex.__version__}


@router.get("/metrics")
def metrics(
    principal: Principal = Depends(metrics_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
