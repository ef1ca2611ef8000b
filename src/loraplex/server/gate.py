"""The server's front door (:class:`RequestGate`, an ASGI middleware in front of every route):
nothing a caller sends costs memory or parsing before it is bounded and authenticated.

For each HTTP request, in order:

1. ``Content-Length`` over ``--max-request-bytes`` (``--max-adapter-push-bytes`` for an adapter
   push): 413 at once, body unread.
2. Auth from the headers alone: where auth is required (see :mod:`~loraplex.server.auth`),
   a request to any route but ``/health`` without a valid key gets 401 before one byte of its
   body is read. A key not in the catalog's cache is looked up in the I/O pool, never on the
   event loop. The principal found is left in the request scope for the routes' dependencies.
3. The body is read with a running count (for chunked bodies too) and reading stops at the
   cap, or past a declared ``Content-Length``: 413. Only then do the routes see it (FastAPI parses JSON after this).

Answers given before the body was read close the connection, so an unauthenticated client
cannot make the server read (and discard) a huge body either.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.server.auth import (
    SCOPE_KEY,
    auth_required,
    bearer_of,
    static_principal,
)
from loraplex.server.errors import APIError, as_api_error
from loraplex.server.state import ServerState

log = logging.getLogger("loraplex.server.app")

PUSH_PATH = re.compile(r"/v1/admin/adapters/[^/]+/push")
"""The adapter push route: its body is bounded by ``--max-adapter-push-bytes`` instead."""

OPEN_PATHS = frozenset({"/health", "/dashboard"})
"""Routes that never need a key: liveness probes, and the dashboard's page (it holds no data;
the routes it polls need a key)."""


class RequestGate:
    """Body cap and authentication before any route runs (see the module docstring)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, flag = self.state.config.max_request_bytes, "--max-request-bytes"
        if scope["method"] == "POST" and PUSH_PATH.fullmatch(scope["path"]):
            limit, flag = self.state.config.max_adapter_push_bytes, "--max-adapter-push-bytes"
        headers = Headers(scope=scope)
        unread = _has_body(headers)
        length = headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                await self._refuse(scope, receive, send, APIError(400, "invalid Content-Length"))
                return
            if declared > limit:
                await self._refuse(scope, receive, send, _too_large(limit, flag))
                return
        if scope["path"] not in OPEN_PATHS:
            required = auth_required(self.state)
            try:
                key, principal = await self._authenticate(headers)
            except Exception as e:
                if required:  # the registry cannot be asked: 503, never open
                    await self._refuse(scope, receive, send, as_api_error(e), close=unread)
                    return
                key, principal = bearer_of(headers), None
            if principal is None and required:
                err = APIError(
                    401,
                    "missing API key" if key is None else "invalid API key",
                    "authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await self._refuse(scope, receive, send, err, close=unread)
                return
            scope[SCOPE_KEY] = (key, principal)
        body: list[bytes] = []
        size = 0
        declared_n = int(length) if length is not None else None
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit or (declared_n is not None and size > declared_n):
                await self._refuse(scope, receive, send, _too_large(limit, flag), close=True)
                return
            body.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _authenticate(self, headers: Headers) -> tuple[str | None, Any]:
        """The bearer key and its principal (None: none or not valid), without touching the
        database on the event loop."""
        state = self.state
        key = bearer_of(headers)
        if key is None:
            return None, None
        p = static_principal(state, key)
        if p is not None:
            return key, p
        hit, p = state.catalog.cached_principal(key)
        if not hit:
            p = await state.run_io(state.catalog.authenticate, key)
        return key, p

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, err: APIError, *, close: bool = True
    ) -> None:
        """Answer ``err`` without reading (more of) the body; ``close`` the connection after."""
        self.state.metrics.requests.labels(status=str(err.status)).inc()
        headers = dict(err.headers or {})
        if close:
            headers["Connection"] = "close"
        response = JSONResponse(err.body(), status_code=err.status, headers=headers)
        await response(scope, receive, send)


def _has_body(headers: Headers) -> bool:
    if "transfer-encoding" in headers:
        return True
    try:
        return int(headers.get("content-length", "0")) > 0
    except ValueError:
        return True


def _too_large(limit: int, flag: str = "--max-request-bytes") -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes, {flag}), "
        "or than its Content-Length",
        code="request_too_large",
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` once, then the client's own messages (so a
    disconnect is still seen)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
