"""Errors leave the server in OpenAI's shape, ``{"error": {message, type, param, code}}``, with
the status code their cause calls for: :class:`APIError` and the mappings from domain errors."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from loraplex.engine.client import EngineDeadError, EngineStepError
from loraplex.registry import NotFoundError, RegistryError, TransitionError, ValidationError
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


def as_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, RegistryError):
        return registry_api_error(e)
    if isinstance(e, AdapterError):
        return adapter_api_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, EngineStepError | LoraplexError):
        return APIError(500, str(e), "server_error")
    log.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", "server_error")


def adapter_api_error(e: AdapterError) -> APIError:
    """Adapter failures by cause: capacity and unreachable stores are retryable (503), a bad
    copy in the object store is an upstream fault (502), anything else a server error."""
    msg = str(e)
    retry = {"Retry-After": "1"}
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
        if e.tier == "object_store":
            return APIError(502, msg, "server_error", code="adapter_copy_invalid")
        return APIError(503, msg, "service_unavailable", code="adapter_copy_invalid", headers=retry)
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
    """Registry failures: unknown names 404, illegal lifecycle moves 409, refused content 400
    (``code`` is the validation reason)."""
    if isinstance(e, NotFoundError):
        return APIError(404, str(e), "NotFoundError", param=param, code="not_found")
    if isinstance(e, TransitionError):
        return APIError(409, str(e), "conflict_error", param=param, code="illegal_transition")
    if isinstance(e, ValidationError):
        return APIError(400, str(e), param=param, code=e.reason)
    return APIError(400, str(e), param=param, code="registry_error")
