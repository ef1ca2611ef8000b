"""Who is calling: bearer keys to :class:`Principal` s, and the FastAPI dependencies of the
inference routes (:func:`inference_principal`), the admin routes (:func:`admin_principal`),
vLLM's runtime load/unload (:func:`runtime_lora_principal`) and ``/metrics``
(:func:`metrics_principal`).

Keys are ``--api-key`` (operator inference keys), ``--admin-api-key`` (every admin scope),
``--metrics-api-key`` (``/metrics`` only) and the registry's keys (a tenant, scopes). Without
any key the server is open, as vLLM is. It fails closed: once ``--api-key`` is set or the
registry has ever held a key or a tenant (revoked keys count), every route but ``/health`` (and
the dashboard's page, which holds no data: :mod:`~loraplex.server.dashboard`) needs a valid key — revoking every key never turns the server anonymous. ``/metrics`` takes the
metrics key or an operator key (``--api-key``, ``--admin-api-key``, a tenant-less registry key);
a tenant key gets 403 there (metrics name every tenant's adapters). Keys are compared in constant
time per key.

The decision "is this a valid key" is taken from the headers before the body is read (the
:mod:`~loraplex.server.gate` middleware); the dependencies then reuse the principal it found.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping

from fastapi import Request

from loraplex.registry import Principal
from loraplex.server.catalog import ADMIN_KEY, ANONYMOUS, METRICS_KEY, STATIC_KEY, has_scope
from loraplex.server.errors import APIError
from loraplex.server.state import ServerState

SCOPE_KEY = "loraplex.auth"
"""The request scope entry where the gate leaves ``(bearer key, its principal or None)``."""


def bearer_of(headers: Mapping[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    auth = headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def bearer(request: Request) -> str | None:
    """The key of the request's ``Authorization: Bearer <key>`` header, or None."""
    return bearer_of(request.headers)


def matches(key: str | None, keys: list[str]) -> bool:
    """Whether ``key`` is one of ``keys`` (constant time per key, and no early exit)."""
    ok = False
    for k in keys:
        ok |= key is not None and hmac.compare_digest(key.encode(), k.encode())
    return ok


def static_principal(state: ServerState, key: str | None) -> Principal | None:
    """The principal of a key given on the command line (no registry lookup), or None."""
    config = state.config
    if key is None:
        return None
    if matches(key, config.api_keys):
        return STATIC_KEY
    if config.admin_api_key and matches(key, [config.admin_api_key]):
        return ADMIN_KEY
    if config.metrics_api_key and matches(key, [config.metrics_api_key]):
        return METRICS_KEY
    return None


def key_principal(state: ServerState, key: str | None) -> Principal | None:
    """The principal of any key this server knows, None for no key or an unknown or revoked
    one. May query the registry (a key not cached): call it off the event loop."""
    p = static_principal(state, key)
    if p is not None or key is None:
        return p
    return state.catalog.authenticate(key)


def auth_required(state: ServerState) -> bool:
    """Fail closed: whether every route but ``/health`` needs a valid key (``--api-key`` set,
    or the registry has ever held a key or a tenant)."""
    return bool(state.config.api_keys) or state.catalog.requires_auth()


def principal_of(state: ServerState, request: Request) -> Principal | None:
    """The principal of the request's key: the one the gate found before the body was read,
    else looked up now."""
    key = bearer(request)
    found = request.scope.get(SCOPE_KEY)
    if found is not None and found[0] == key:
        return found[1]  # type: ignore[no-any-return]
    return key_principal(state, key)


def _unauthorized(key: str | None, what: str = "API key") -> APIError:
    return APIError(
        401,
        f"missing {what}" if key is None else f"invalid {what}",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _forbidden(message: str) -> APIError:
    return APIError(403, message, "permission_error", code="insufficient_permissions")


def check_inference_auth(state: ServerState, request: Request) -> Principal:
    """The caller of an inference route; 401 when auth is required and no valid inference key
    was given, 403 for the metrics key."""
    p = principal_of(state, request)
    if p == METRICS_KEY:
        raise _forbidden("this API key may only read /metrics")
    if p is not None and (p.allows("inference") or p.tenant is None):
        return p
    if not auth_required(state):  # vLLM: open without keys
        return ANONYMOUS
    raise _unauthorized(bearer(request))


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
    p = principal_of(state, request)
    if p == ADMIN_KEY or (p is not None and has_scope(p, scope)):
        return p
    if p is not None:
        raise _forbidden(f"this API key may not call this route (it needs the {scope!r} scope)")
    raise _unauthorized(bearer(request), "admin API key")


def check_runtime_lora_auth(state: ServerState, request: Request) -> Principal:
    """The caller of vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

    With an admin key (``--admin-api-key`` or a registry admin key) they are admin routes
    (``admin:load``), whatever ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` says. Without one they
    answer 404 as vLLM does while that variable is off; with it on they are open as in vLLM,
    but only while the server has no key at all: once inference keys exist they fail closed
    (403: no inference key may load; 401 for a missing or unknown key)."""
    config = state.config
    if config.admin_api_key or state.catalog.has_admin_keys():
        return check_admin_auth(state, request, "admin:load")
    if not config.allow_runtime_lora_updating:
        raise APIError(
            404,
            "runtime LoRA loading is disabled; set VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (or "
            "--allow-runtime-lora-updating) on a server without keys, or start it with "
            "--admin-api-key",
            "NotFoundError",
            code="admin_api_disabled",
        )
    if not auth_required(state):  # no key anywhere: open, as vLLM with the variable on
        return ANONYMOUS
    p = principal_of(state, request)
    if p is None:
        raise _unauthorized(bearer(request))
    raise _forbidden(
        "runtime LoRA loading needs an admin key on a server with API keys; start it with "
        "--admin-api-key (inference keys never load adapters)"
    )


def check_metrics_auth(state: ServerState, request: Request) -> Principal:
    """The caller of ``/metrics``: the metrics key or an operator key; 403 for a tenant key
    (the metrics name every tenant's adapters); open only while the server is open and no
    metrics key is set."""
    p = principal_of(state, request)
    if p is not None and p.tenant is None:
        return p
    if p is not None:
        raise _forbidden("a tenant API key may not read /metrics")
    if state.config.metrics_api_key or auth_required(state):
        raise _unauthorized(bearer(request))
    return ANONYMOUS


def inference_principal(request: Request) -> Principal:
    """Dependency of the inference routes: the caller (401 as :func:`check_inference_auth`)."""
    return check_inference_auth(request.app.state.loraplex, request)


def metrics_principal(request: Request) -> Principal:
    """Dependency of ``/metrics``: the caller (as :func:`check_metrics_auth`)."""
    return check_metrics_auth(request.app.state.loraplex, request)


def runtime_lora_principal(request: Request) -> Principal:
    """Dependency of vLLM's load/unload routes (as :func:`check_runtime_lora_auth`)."""
    return check_runtime_lora_auth(request.app.state.loraplex, request)


def admin_principal(scope: str) -> Callable[[Request], Principal]:
    """Dependency of an admin route that needs ``scope`` (``admin:`` alone: any admin scope)."""

    def check(request: Request) -> Principal:
        return check_admin_auth(request.app.state.loraplex, request, scope)

    return check
