"""Who is calling: bearer keys to :class:`Principal` s, and the FastAPI dependencies of the
inference routes (:func:`inference_principal`) and the admin routes (:func:`admin_principal`).

Keys are ``--api-key`` (operator inference keys), ``--admin-api-key`` (every admin scope) and
the registry's keys (a tenant, scopes). Without any key the inference routes are open, as in
vLLM; once any key exists every route but ``/health`` needs one. Keys are compared in constant
time per key.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from loraplex.registry import Principal
from loraplex.server.catalog import ADMIN_KEY, ANONYMOUS, STATIC_KEY, has_scope
from loraplex.server.errors import APIError
from loraplex.server.state import ServerState


def bearer(request: Request) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def matches(key: str | None, keys: list[str]) -> bool:
    """Whether ``key`` is one of ``keys`` (constant time per key, and no early exit)."""
    ok = False
    for k in keys:
        ok |= key is not None and hmac.compare_digest(key.encode(), k.encode())
    return ok


def _registry_key(state: ServerState, key: str | None) -> Principal | None:
    return state.catalog.authenticate(key) if key is not None else None


def check_inference_auth(state: ServerState, request: Request) -> Principal:
    """The caller of an inference route; 401 when keys are configured and none matches."""
    config = state.config
    key = bearer(request)
    if matches(key, config.api_keys):
        return STATIC_KEY
    if config.admin_api_key and matches(key, [config.admin_api_key]):
        return ADMIN_KEY
    p = _registry_key(state, key)
    if p is not None and (p.allows("inference") or p.tenant is None):
        return p
    if not (config.api_keys or state.catalog.has_keys()):  # vLLM: open without keys
        return ANONYMOUS
    raise APIError(
        401,
        "missing API key" if key is None else "invalid API key",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def check_admin_auth(state: ServerState, request: Request, scope: str) -> Principal:
    """The caller of an admin route holding ``scope``: 404 while the admin API is off, 401
    for an unknown key, 403 for a key without the scope."""
    config = state.config
    if not (config.admin_api_key or state.catalog.has_admin_keys()):
        raise APIError(
            404,
            "the admin API is disabled; start the server with --admin-api-key "
            "(or LORAPLEX_ADMIN_API_KEY), or create an admin key with "
            "`loraplex tenants keys create --admin`",
            "not_found_error",
            code="admin_api_disabled",
        )
    key = bearer(request)
    if config.admin_api_key and matches(key, [config.admin_api_key]):
        return ADMIN_KEY
    p = _registry_key(state, key)
    if p is not None and has_scope(p, scope):
        return p
    if p is not None or matches(key, config.api_keys):
        raise APIError(
            403,
            f"this API key may not call this route (it needs the {scope!r} scope)",
            "permission_error",
            code="insufficient_permissions",
        )
    raise APIError(
        401,
        "missing admin API key" if key is None else "invalid admin API key",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def inference_principal(request: Request) -> Principal:
    """Dependency of the inference routes: the caller (401 as :func:`check_inference_auth`)."""
    return check_inference_auth(request.app.state.loraplex, request)


def admin_principal(scope: str) -> Callable[[Request], Principal]:
    """Dependency of an admin route that needs ``scope`` (``admin:`` alone: any admin scope)."""

    def check(request: Request) -> Principal:
        return check_admin_auth(request.app.state.loraplex, request, scope)

    return check
