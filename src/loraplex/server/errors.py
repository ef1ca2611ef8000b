"""Errors leave the server in OpenAI's shape, ``{"error": {message, type, param, code}}``, with
the status code their cause calls for: :class:`APIError` and the mappings from domain errors.

Messages of domain errors never carry server paths or URIs out (:func:`scrub`: a known adapter
path becomes the adapter's name, any other path ``<path>``), nor database driver text (a registry
outage is a 503 ``registry_unavailable``); the full text goes to the server's log.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc

from loraplex.engine.client import (
    EngineDeadError,
    EngineStepError,
    PrepareTimeoutError,
    StreamStalledError,
)
from loraplex.registry import (
    ConflictError,
    NotFoundError,
    RegistryError,
    TransitionError,
    ValidationError,
)
from loraplex.registry import errors as registry_errors
from loraplex.types import (
    AdapterCapacityError,
    AdapterCopyError,
    AdapterError,
    AdapterInUseError,
    InvalidRequestError,
    LoraplexError,
    StoreNotFoundError,
    StorePermissionError,
    StoreUnavailableError,
)

log = logging.getLogger("loraplex.server.app")

# The registry raises RegistryUnavailableError when its database cannot be reached; a driver
# error that escapes it some other way (anywhere in the cause chain) is an outage too.
_OUTAGES = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
            sa_exc.DisconnectionError)  # fmt: skip
RETRY = {"Retry-After": "1"}

_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"(),;]*")
_PATH = re.compile(r"(?<![\w.:/~>-])(?:~|\.{1,2})?/[^\s'\"(),;]*")


def scrub(message: str, names: Mapping[str, str] | None = None) -> str:
    """``message`` without server paths or URIs: each path of ``names`` (path -> adapter name)
    becomes ``<name>``, any other absolute path ``<path>`` and any URI ``<uri>``."""
    for path, name in sorted((names or {}).items(), key=lambda kv: -len(kv[0])):
        if path:
            message = message.replace(path, f"<{name}>")
    return _PATH.sub("<path>", _URI.sub("<uri>", message))


class APIError(Exception):
    """An error that leaves the server as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def registry_outage(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says the registry's database cannot be reached."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, registry_errors.RegistryUnavailableError):
            return True
        if isinstance(seen, _OUTAGES):
            return True
        seen = seen.__cause__
    return False


def registry_unavailable() -> APIError:
    return APIError(
        503,
        "the adapter registry is unavailable; retry later",
        "service_unavailable",
        code="registry_unavailable",
        headers=RETRY,
    )


def as_api_error(e: BaseException) -> APIError:
    """The API error of any exception, its message scrubbed of paths (:func:`scrub`)."""
    if isinstance(e, APIError):
        return e
    if registry_outage(e):
        log.warning("registry unavailable: %s", e)
        return registry_unavailable()
    if isinstance(e, sa_exc.SQLAlchemyError):
        log.error("registry database error", exc_info=e)
        return APIError(500, "registry database error", "server_error", code="registry_error")
    if isinstance(e, InvalidRequestError):
        return APIError(400, _public(e), param=e.param)
    if isinstance(e, RegistryError):
        return registry_api_error(e)
    if isinstance(e, AdapterError):
        return adapter_api_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, PrepareTimeoutError):
        return APIError(503, str(e), "service_unavailable", code="prepare_timeout", headers=RETRY)
    if isinstance(e, StreamStalledError):
        return APIError(408, str(e), "timeout_error", code="stream_stalled")
    if isinstance(e, EngineStepError | LoraplexError):
        return APIError(500, _public(e), "server_error")
    log.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", "server_error")


def _public(e: BaseException, names: Mapping[str, str] | None = None) -> str:
    """The message of ``e`` for a client (scrubbed); the full one goes to the log if it
    differed."""
    full = str(e)
    msg = scrub(full, names)
    if msg != full:
        log.info("%s (sent to the client as: %s)", full, msg)
    return msg


def adapter_api_error(e: AdapterError) -> APIError:
    """Adapter failures by cause: capacity and unreachable stores are retryable (503); a bad
    copy of the registered bytes is an upstream fault (502, whichever tier held it), changed
    local files a server error (500); anything else a server error."""
    names = {e.path: e.name} if isinstance(e, AdapterCopyError) and e.path and e.name else None
    msg = _public(e, names)
    retry = RETRY
    if isinstance(e, AdapterCapacityError):
        return APIError(503, msg, "service_unavailable", code="adapter_capacity", headers=retry)
    if isinstance(e, StoreUnavailableError):
        return APIError(
            503, msg, "service_unavailable", code="adapter_store_unavailable", headers=retry
        )
    if isinstance(e, StoreNotFoundError):
        return APIError(404, msg, "NotFoundError", code="adapter_not_found")
    if isinstance(e, StorePermissionError):
        return APIError(403, msg, "permission_error", code="adapter_source_refused")
    if isinstance(e, AdapterCopyError):
        if e.tier == "local":  # the registered files changed: retrying will not help
            return APIError(500, msg, "server_error", code="adapter_integrity_error")
        return APIError(502, msg, "server_error", code="adapter_copy_invalid")
    if isinstance(e, AdapterInUseError):
        return APIError(409, msg, "conflict_error", code="adapter_in_use")
    return APIError(500, msg, "server_error", code="adapter_load_failed")


def validation_api_error(errs: list[Any]) -> APIError:
    """One 400 for pydantic's errors, naming the first bad field as ``param``.

    A value matching no member of a union gets one error per member, located at
    ``field.<member type>``; those are one problem, so ``param`` is the location they share
    (``prompt``, not ``prompt.str``)."""
    locs = [[x for x in err.get("loc", ()) if x != "body"] for err in errs]
    if not locs:
        return APIError(400, "invalid request")
    group = [i for i, loc in enumerate(locs) if loc[:1] == locs[0][:1]]
    shared = locs[0]
    if len(group) > 1:
        n = 0
        while all(len(locs[i]) > n and locs[i][n] == shared[n] for i in group):
            n += 1
        shared = shared[:n]
    param = ".".join(str(x) for x in shared) or None
    msgs = list(dict.fromkeys(str(errs[i].get("msg", "invalid value")) for i in group))
    others = len(errs) - len(group)
    more = f" (and {others} more problems)" if others else ""
    msg = "; or ".join(msgs[:3])
    return APIError(400, f"{param + ': ' if param else ''}{msg}{more}", param=param)


def registry_api_error(e: RegistryError, param: str | None = None) -> APIError:
    """Registry failures: an outage 503 (+ Retry-After), unknown names 404, illegal lifecycle
    moves and revision conflicts 409, refused content 400 (``code`` is the validation reason); other database errors
    500 without the driver's text."""
    if registry_outage(e):
        log.warning("registry unavailable: %s", e)
        return registry_unavailable()
    if isinstance(e.__cause__, sa_exc.SQLAlchemyError):
        log.error("registry database error: %s", e)
        return APIError(500, "registry database error", "server_error", code="registry_error")
    msg = _public(e)
    if isinstance(e, NotFoundError):
        return APIError(404, msg, "NotFoundError", param=param, code="not_found")
    if isinstance(e, ConflictError):
        return APIError(409, msg, "conflict_error", param=param, code="revision_conflict")
    if isinstance(e, TransitionError):
        return APIError(409, msg, "conflict_error", param=param, code="illegal_transition")
    if isinstance(e, ValidationError):
        return APIError(400, msg, param=param, code=e.reason)
    return APIError(400, msg, param=param, code="registry_error")
