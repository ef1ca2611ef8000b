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
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import loraplex
from loraplex.config import EngineConfig, ServerConfig, endpoint_paths
from loraplex.engine.client import EngineClient, LLMEngine, StreamBounds
from loraplex.logs import StatsLogger, StatsSource, configure_logging, startup_summary
from loraplex.registry import Registry
from loraplex.server import (
    admin_routes,
    dashboard,
    openai_routes,
    ops_routes,
    push_routes,
    residency,
    tokenize_routes,
)
from loraplex.server.errors import APIError, as_api_error, validation_api_error
from loraplex.server.gate import RequestGate
from loraplex.server.listener import ACCESS_LOGGER, AccessLogFilter, CertRefresher
from loraplex.server.state import ServerState, open_registry, retire_loop
from loraplex.types import LoraplexError

__all__ = ["ServerState", "create_app", "open_registry", "run_server", "stats_logger"]

log = logging.getLogger("loraplex.server.app")


def reserve_http_core(engine: EngineConfig) -> EngineConfig:
    """``serve`` on a CPU without ``--num-threads``: torch's threads minus one, the core the
    HTTP side (event loop, request preparation, streaming) runs on. Sharing every core between
    the engine's intra-op threads and the HTTP side makes each parallel GEMM wait for a thread
    descheduled by it (measured: docs/benchmarks.md, "The served path at 64 streams"); vLLM's
    CPU backend reserves a core for its front end the same way."""
    auto_cpu = engine.device == "auto" and not torch.cuda.is_available()
    if engine.num_threads or not (auto_cpu or engine.device.startswith("cpu")):
        return engine
    n = torch.get_num_threads()
    if n < 2:
        return engine
    log.info(
        "engine: %d CPU threads (one of %d left to the HTTP side; --num-threads sets it)", n - 1, n
    )
    return replace(engine, num_threads=n - 1)


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
    if engine is None:
        config = replace(config, engine=reserve_http_core(config.engine))
        e = config.engine
        log.info(
            "loading model %s (dtype %s, device %s, max_model_len %s) ...",
            e.model,
            e.dtype,
            e.device,
            e.max_model_len or "from config.json",
        )
        t0 = time.perf_counter()
        client = EngineClient.from_config(config.engine, **options)
        log.info("model and KV cache ready in %.1f s", time.perf_counter() - t0)
    else:
        client = EngineClient(engine, **options)
    if config.chat_template is not None and client.has_tokenizer:
        # --chat-template: the default of every chat request (a request's own template wins)
        client.engine.tokenizer.chat_template = config.chat_template
    state = ServerState(config, client, registry)
    if config.lora_modules:
        log.info("loading and verifying %d start-up adapter(s) ...", len(config.lora_modules))
    state.preload_adapters()
    for line in startup_summary(config, engine_info(state)):
        log.info("%s", line)
    stats = stats_logger(state)
    sampler = dashboard.DashboardSampler(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        retire = asyncio.create_task(retire_loop(state))
        tasks = [retire, asyncio.create_task(dashboard.sampler_loop(sampler))]
        if not config.disable_log_stats:
            tasks.append(asyncio.create_task(_stats_loop(stats, config.log_stats_interval_s)))
        log.info(
            "ready: serving %s on http://%s:%d",
            ", ".join(config.model_names),
            config.host,
            config.port,
        )
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            client.shutdown()
            state.close()

    docs: dict[str, Any] = (
        {"docs_url": None, "redoc_url": None, "openapi_url": None}
        if config.disable_fastapi_docs
        else {}
    )
    app = FastAPI(
        title="loraplex",
        version=loraplex.__version__,
        description="OpenAI-compatible multi-LoRA inference server",
        lifespan=lifespan,
        root_path=config.root_path or "",
        **docs,
    )
    app.state.loraplex = state
    app.state.stats = stats
    app.state.dashboard = sampler
    app.add_middleware(RequestGate, state=state)
    app.add_middleware(ops_routes.HeadAsGet)  # HEAD on every GET route (inside CORS)

    if config.allowed_origins is not None:  # vLLM's CORS flags; outermost, so 4xx carry them
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=json.loads(config.allowed_origins),
            allow_methods=json.loads(config.allowed_methods),
            allow_headers=json.loads(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    _add_error_handlers(app, state)
    app.include_router(ops_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(residency.router)
    app.include_router(admin_routes.router)
    app.include_router(push_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(dashboard.router)
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


def engine_info(state: ServerState) -> dict[str, Any]:
    """What the start-up summary needs from the built engine (white-box, start-up only)."""
    engine, client = state.engine, state.client
    mc = engine.model_config
    blocks, block_size = client.kv_cache_shape()
    return {
        "architecture": mc.architecture,
        "parameters": mc.num_parameters(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "kv_blocks": blocks,
        "block_size": block_size,
        "kv_bytes": engine.cache.nbytes,
        "max_model_len": client.max_model_len,
        "lora": client.lora_enabled,
        "policy": client.policy_name if client.lora_enabled else None,
        "generation_defaults": client.generation_defaults,
        "adapters": [m.name for m in state.config.lora_modules],
    }


def stats_logger(state: ServerState) -> StatsLogger:
    """The periodic stats line of ``state``'s server: token counters from its metrics, the
    engine's gauges, prefix-cache and adapter-tier counters through its client."""
    client, metrics = state.client, state.metrics

    def totals() -> dict[str, float]:
        queries, hits = client.prefix_cache_tokens()
        out = {
            "prompt_tokens": metrics.total("loraplex_prompt_tokens"),
            "generation_tokens": metrics.total("loraplex_generation_tokens"),
            "prefix_queries": float(queries),
            "prefix_hits": float(hits),
            "preemptions": float(client.num_preemptions),
        }
        if client.lora_enabled:
            for tier, c in client.tier_counters().items():
                out[f"{tier}_hits"], out[f"{tier}_misses"] = float(c.hits), float(c.misses)
        return out

    def gauges() -> dict[str, float]:
        return {
            "running": float(client.num_running),
            "waiting": float(client.num_waiting),
            "kv_usage": client.kv_cache_usage(),
        }

    return StatsLogger(StatsSource(totals, gauges))


async def _stats_loop(stats: StatsLogger, interval_s: float) -> None:
    """Log the stats line every ``interval_s`` seconds for the app's lifetime."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            stats.log_once()
        except Exception:  # a metrics hiccup must not end the loop
            log.exception("stats line failed")


def run_server(config: ServerConfig, *, on_ready: Callable[[], None] | None = None) -> None:
    """Configure logging (``--log-level``, ``--log-format``, ``--disable-access-log-for-
    endpoints``), build the app and serve it with uvicorn until interrupted; on SIGTERM open
    requests get ``--shutdown-timeout`` seconds (default: as long as they take); with
    ``--enable-ssl-refresh`` rotated TLS files are reloaded while serving."""
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    setup = configure_logging(
        config.log_level, config.log_format, access_log=not config.disable_uvicorn_access_log
    )
    quiet = AccessLogFilter(endpoint_paths(config.disable_access_log_for_endpoints))
    access = logging.getLogger(ACCESS_LOGGER)
    access.addFilter(quiet)
    refresher: CertRefresher | None = None
    try:
        app = create_app(config, on_ready=on_ready)
        uv = uvicorn.Config(
            app,
            # h11 bounds a request's header block (httptools, uvicorn's "auto" pick when
            # installed, does not); the event loop is uvloop when installed ("auto")
            http="h11",
            loop="auto",
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            log_config=None,  # ours, set above
            access_log=not config.disable_uvicorn_access_log,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
            ssl_ca_certs=config.ssl_ca_certs,
            timeout_graceful_shutdown=(
                None if config.shutdown_timeout_s is None else math.ceil(config.shutdown_timeout_s)
            ),
        )
        uv.load()  # builds the SSL context the refresher reloads in place
        if config.enable_ssl_refresh and uv.ssl is not None and config.ssl_certfile:
            refresher = CertRefresher(
                uv.ssl, config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs
            )
            refresher.start()
        server = uvicorn.Server(uv)
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        if not server.started:  # as uvicorn.run: the socket could not be bound
            raise SystemExit(STARTUP_FAILURE)
    finally:
        if refresher is not None:
            refresher.stop()
        access.removeFilter(quiet)
        setup.close()
