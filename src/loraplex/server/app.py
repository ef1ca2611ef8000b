"""The OpenAI-compatible HTTP API over one engine: ``create_app(config)`` builds everything.

Routes, one module per resource: OpenAI's ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` (:mod:`~loraplex.server.openai_routes`); ``/v1/adapters``, the
residency view (:mod:`~loraplex.server.residency`); ``/health``, ``/version``, ``/metrics``
(:mod:`~loraplex.server.ops_routes`); the admin routes (:mod:`~loraplex.server.admin_routes`).
Every request passes the :class:`~loraplex.server.gate.RequestGate` first: its body is capped
(``--max-request-bytes``) and, where keys exist, its key checked from the headers before the
body is read. Callers are authenticated to a :class:`Principal` (tenant + scopes) and see only
their tenant's and shared adapters (:mod:`~loraplex.server.auth`); each request is served by the
registry
revision chosen at arrival (active, or canary by weight) and keyed by its sha256
(:mod:`~loraplex.server.state`). Requests are validated, tokenized and their adapter loaded in
worker threads; the engine loop only ever sees prepared requests. The server reaches the engine
only through its :class:`~loraplex.engine.client.EngineClient`. Every error leaves as OpenAI's
JSON shape with the right status code (:mod:`loraplex.server.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import loraplex
from loraplex.config import ServerConfig
from loraplex.engine.client import EngineClient, LLMEngine, StreamBounds
from loraplex.registry import Registry
from loraplex.server import admin_routes, openai_routes, ops_routes, residency, tokenize_routes
from loraplex.server.errors import APIError, as_api_error, validation_api_error
from loraplex.server.gate import RequestGate
from loraplex.server.state import ServerState, open_registry, retire_loop
from loraplex.types import LoraplexError

__all__ = ["ServerState", "create_app", "open_registry", "run_server"]


def create_app(
    config: ServerConfig,
    *,
    engine: LLMEngine | None = None,
    registry: Registry | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the server: the engine (unless given), the registry view, metrics and routes.

    ``registry``: an open registry to share (default: :func:`open_registry` of the config,
    closed with the app). The engine loop starts with the app (lifespan) and stops with it;
    ``on_ready`` runs once the loop is up."""
    config.validate()
    options: dict[str, Any] = {
        "prepare_workers": config.prepare_workers,
        "load_workers": config.load_workers,
        "prepare_timeout_s": config.prepare_timeout_s,
        "stream_bounds": StreamBounds(
            max_unread_tokens=config.stream_max_unread_tokens,
            stall_timeout_s=config.stream_stall_timeout_s,
        ),
    }
    client = (
        EngineClient(engine, **options)
        if engine is not None
        else EngineClient.from_config(config.engine, **options)
    )
    state = ServerState(config, client, registry)
    state.preload_adapters()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        retire = asyncio.create_task(retire_loop(state))
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            retire.cancel()
            with contextlib.suppress(BaseException):
                await retire
            client.shutdown()
            state.close()

    app = FastAPI(
        title="loraplex",
        version=loraplex.__version__,
        description="OpenAI-compatible multi-LoRA inference server",
        lifespan=lifespan,
    )
    app.state.loraplex = state
    app.add_middleware(RequestGate, state=state)
    app.add_middleware(ops_routes.HeadAsGet)  # HEAD on every GET route (outermost)
    _add_error_handlers(app, state)
    app.include_router(ops_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(residency.router)
    app.include_router(admin_routes.router)
    app.include_router(tokenize_routes.router)
    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error leaves in OpenAI's shape and is counted by status."""

    def count(status: int) -> None:
        state.metrics.requests.labels(status=str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        count(e.status)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_api_error(list(e.errors()))
        count(400)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        status = e.status_code
        kind = (
            "NotFoundError"
            if status == 404
            else "invalid_request_error"
            if 400 <= status < 500
            else "server_error"
        )
        count(e.status_code)
        return APIError(e.status_code, str(e.detail), kind, headers=e.headers).response()

    @app.exception_handler(LoraplexError)
    async def _domain_error(request: Request, e: LoraplexError) -> JSONResponse:
        err = as_api_error(e)
        count(err.status)
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        err = as_api_error(e)
        count(err.status)
        return err.response()


def run_server(config: ServerConfig, *, on_ready: Callable[[], None] | None = None) -> None:
    """Build the app and serve it with uvicorn until interrupted."""
    import uvicorn

    app = create_app(config, on_ready=on_ready)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
