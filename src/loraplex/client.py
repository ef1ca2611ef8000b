"""Push an adapter's tensors to a running loraplex server (or router) from a training loop.

``push_adapter(url, name, adapter)`` sends one revision of ``name`` over the wire format of
``POST /v1/admin/adapters/{name}/push``::

    body    = safetensors bytes of the adapter's state dict (PEFT's key names and layout)
    headers = Content-Type: application/octet-stream
              X-Loraplex-Adapter-Config: base64(adapter_config.json)   (<= 64 KiB decoded)
              X-Loraplex-Body-SHA256:    sha256(body), lowercase hex
              X-Loraplex-Revision:       the caller's label (optional)
              Authorization:             Bearer <admin key> (optional)
    query   = persist=disk (optional: the server also writes the disk tier)
    201     -> {"object": "adapter.revision", "name", "revision", "sha256",
                "previous_revision", "persisted", ...}

``adapter`` is a PEFT model (its adapter's state dict, via ``get_peft_model_state_dict``, and
its config), a state dict of tensors (``config`` required), or safetensors bytes already
serialized (``config`` required). Nothing is written to disk. Importing this module imports
neither torch nor peft: they are imported when a model or tensors are pushed.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

__all__ = [
    "CONFIG_HEADER",
    "MAX_CONFIG_BYTES",
    "REVISION_HEADER",
    "SHA256_HEADER",
    "PushError",
    "encode_adapter",
    "push_adapter",
    "push_headers",
    "push_path",
]

CONFIG_HEADER = "X-Loraplex-Adapter-Config"
"""adapter_config.json, UTF-8 JSON, standard (padded) base64."""
SHA256_HEADER = "X-Loraplex-Body-SHA256"
"""The lowercase hex sha256 of the request body (required: the server verifies it)."""
REVISION_HEADER = "X-Loraplex-Revision"
"""The caller's revision label, e.g. ``step-120`` (optional)."""
MAX_CONFIG_BYTES = 64 << 10
"""The largest adapter_config.json a push carries (decoded)."""


class PushError(RuntimeError):
    """A push the server (or router) refused or could not complete: ``status`` (HTTP status,
    0 when no answer came), ``message`` (the server's own), ``code`` and the parsed ``body``."""

    def __init__(self, status: int, message: str, *, code: Any = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.body = body


def push_path(name: str) -> str:
    """The route a push of ``name`` goes to (the name percent-encoded as one path segment)."""
    return f"/v1/admin/adapters/{quote(name, safe='')}/push"


def _jsonable(value: Any) -> Any:
    """PEFT config values JSON cannot take as they are: sets (sorted lists) and enums."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"adapter config value of type {type(value).__name__} is not JSON")


def _config_json(config: Any) -> bytes:
    """``config`` (a dict, a PEFT config object, or JSON text/bytes) as adapter_config.json."""
    if isinstance(config, (bytes, bytearray)):
        config = json.loads(bytes(config).decode("utf-8"))
    elif isinstance(config, str):
        config = json.loads(config)
    elif hasattr(config, "to_dict"):  # peft.PeftConfig
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a dict, a PEFT config or JSON text, got {type(config).__name__}"
        )
    text = json.dumps(dict(config), default=_jsonable, sort_keys=True).encode("utf-8")
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"the adapter config is {len(text)} bytes; a push carries at most {MAX_CONFIG_BYTES}"
        )
    return text


def _is_peft_model(obj: Any) -> bool:
    return hasattr(obj, "peft_config") and hasattr(obj, "active_adapter")


def encode_adapter(
    adapter: Any, config: Any = None, *, adapter_name: str | None = None
) -> tuple[bytes, bytes]:
    """``adapter`` -> (safetensors body, adapter_config.json bytes).

    A PEFT model: the state dict of ``adapter_name`` (its active adapter by default) exactly as
    ``save_pretrained`` would write it, and that adapter's config unless ``config`` is given.
    A mapping of tensors or safetensors bytes: ``config`` is required."""
    if _is_peft_model(adapter):
        from peft import get_peft_model_state_dict

        which = adapter_name or adapter.active_adapter
        if not isinstance(which, str):  # several active adapters: the caller must pick one
            raise ValueError(f"the model has several active adapters {which}; pass adapter_name")
        if which not in adapter.peft_config:
            raise ValueError(f"the model has no adapter {which!r}")
        tensors = get_peft_model_state_dict(adapter, adapter_name=which)
        if config is None:  # as save_pretrained writes it: for inference
            config = {**adapter.peft_config[which].to_dict(), "inference_mode": True}
    elif isinstance(adapter, (bytes, bytearray, memoryview)):
        if config is None:
            raise ValueError("pushing safetensors bytes needs config (the adapter_config.json)")
        return bytes(adapter), _config_json(config)
    elif isinstance(adapter, Mapping):
        if config is None:
            raise ValueError("pushing a state dict needs config (the adapter_config.json)")
        tensors = adapter
    else:
        raise TypeError(
            "adapter must be a PEFT model, a state dict of tensors or safetensors bytes, "
            f"got {type(adapter).__name__}"
        )
    if not tensors:
        raise ValueError("the adapter has no tensors")
    from safetensors.torch import save

    # the process's own contiguous CPU copies, as save_pretrained writes them (no views into
    # parameters a training step goes on to change)
    body = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
    return body, _config_json(config)


def push_headers(
    body: bytes,
    config_json: bytes,
    *,
    api_key: str | None = None,
    revision: str | None = None,
) -> dict[str, str]:
    """The headers of a push of ``body`` (see the module docstring)."""
    headers = {
        "Content-Type": "application/octet-stream",
        CONFIG_HEADER: base64.b64encode(config_json).decode("ascii"),
        SHA256_HEADER: hashlib.sha256(body).hexdigest(),
    }
    if revision is not None:
        headers[REVISION_HEADER] = revision
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _error_of(resp: httpx.Response, what: str) -> PushError:
    """The server's error answer as a :class:`PushError` carrying its own message (and, from a
    router, which replicas failed and why)."""
    try:
        body: Any = resp.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        message, code = err["message"], err.get("code")
    else:
        message, code = resp.text[:500] or resp.reason_phrase, None
    failed = body.get("replicas") if isinstance(body, dict) else None
    if isinstance(failed, list):
        bad = [
            f"{r.get('url')}: {r.get('status')} {r.get('error') or ''}".strip()
            for r in failed
            if isinstance(r, dict) and r.get("status") != 201
        ]
        if bad:
            message += " [" + "; ".join(bad) + "]"
    return PushError(
        resp.status_code, f"{what} failed ({resp.status_code}): {message}", code=code, body=body
    )


def push_adapter(
    url: str,
    name: str,
    adapter: Any,
    *,
    config: Any = None,
    api_key: str | None = None,
    revision: str | None = None,
    persist: bool = False,
    timeout: float = 120.0,
    adapter_name: str | None = None,
    client: httpx.Client | None = None,
) -> dict[str, Any]:
    """Push ``adapter`` as the new revision of ``name`` to the server or router at ``url``
    (``http://host:port``); returns the server's 201 answer (the revision it now serves).

    ``persist``: the server writes the disk tier too. ``client``: an ``httpx.Client`` to reuse
    across pushes (a training loop pushing every step keeps its connection). Raises
    :class:`PushError` with the server's message when the push is refused or incomplete (a
    router names the replicas that did not take it), ValueError/TypeError for bad arguments."""
    if not isinstance(name, str) or not name:
        raise ValueError("name must be a non-empty string")
    body, config_json = encode_adapter(adapter, config, adapter_name=adapter_name)
    headers = push_headers(body, config_json, api_key=api_key, revision=revision)
    target = url.rstrip("/") + push_path(name)
    params = {"persist": "disk"} if persist else None
    what = f"push of {name!r} to {url}"
    own = client is None
    http = httpx.Client(timeout=timeout) if client is None else client
    try:
        resp = http.post(target, content=body, headers=headers, params=params, timeout=timeout)
    except httpx.HTTPError as e:
        raise PushError(0, f"{what} failed: {type(e).__name__}: {e}") from e
    finally:
        if own:
            http.close()
    if resp.status_code != 201:
        raise _error_of(resp, what)
    try:
        answer = resp.json()
    except ValueError as e:
        raise PushError(201, f"{what}: the answer is not JSON: {resp.text[:200]!r}") from e
    if not isinstance(answer, dict) or answer.get("sha256") is None:
        raise PushError(201, f"{what}: unexpected answer {answer!r}", body=answer)
    return answer
