"""``POST /v1/admin/adapters/{name}/push``: a training loop pushes an adapter's weights (no file,
no round trip through disk) and they become the name's active revision in one step.

The wire format (fixed; ``loraplex route``, the Ray Serve deployment and the client helper send
exactly this):

- body: ``adapter_model.safetensors`` bytes (PEFT's key names and layout),
  ``Content-Type: application/octet-stream``; bounded by ``--max-adapter-push-bytes`` before
  and while it is read (:mod:`~loraplex.server.gate`: 413, never buffered past the bound);
- ``X-Loraplex-Adapter-Config``: ``adapter_config.json``, standard base64 (padded), at most
  64 KiB decoded;
- ``X-Loraplex-Body-SHA256``: lowercase hex sha256 of the body (required; a mismatch is a 400);
- ``X-Loraplex-Revision`` (optional): the caller's label (``step-120``); default ``r<n>``. A
  label that already names other bytes under the name is a 409 (so is the same bytes under a
  second label); the same bytes under their own label again are idempotent;
- ``?persist=disk`` (optional): the disk tier keeps a copy too (needs ``--disk-cache-dir``).

Auth: ``admin:load`` (vLLM's runtime loading is the same act); a tenant-bound key pushes only
its tenant's names, and a new name is created under its tenant. Answer ``201``:
``{"object": "adapter.revision", "name", "revision", "sha256", "previous_revision",
"persisted": ["host"] | ["host", "disk"]}``; every push, and every refusal the registry
judged, is in the audit log.

Order (nothing changes on a refusal): headers checked, body hashed against its header, bytes
parsed and validated against the served base (registry rules, then the engine's), recorded as a
revision (source ``pushed://<sha256>``), admitted into host memory (pinned) and the disk tier
when asked, and only then activated. Requests already admitted finish on the revision they
resolved (each response names it in ``x-loraplex-adapter``); the replaced revision is unpinned
and leaves the device and host tiers once its last request ends. Pushed revisions beyond
``--max-pushed-revisions`` per name that no request uses are deleted from the registry.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from loraplex.lora.adapter import read_pushed
from loraplex.lora.digest import adapter_files_of
from loraplex.lora.push import MAX_CONFIG_BYTES
from loraplex.registry import Principal, RegistryError
from loraplex.server.auth import admin_principal
from loraplex.server.errors import APIError, registry_api_error, scrub
from loraplex.server.state import ServerState, get_state
from loraplex.types import AdapterError

log = logging.getLogger("loraplex.server.app")

router = APIRouter()

push_auth = admin_principal("admin:load")

CONFIG_HEADER = "x-loraplex-adapter-config"
SHA_HEADER = "x-loraplex-body-sha256"
REVISION_HEADER = "x-loraplex-revision"
_SHA_RE = re.compile(r"[0-9a-f]{64}")


def _bad(msg: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, msg, param=param, code=code)


def _config_bytes(request: Request) -> bytes:
    raw = request.headers.get(CONFIG_HEADER)
    if raw is None:
        raise _bad(f"missing header {CONFIG_HEADER} (base64 adapter_config.json)", CONFIG_HEADER)
    if len(raw) > 4 * ((MAX_CONFIG_BYTES + 2) // 3):
        raise _bad(f"{CONFIG_HEADER}: more than {MAX_CONFIG_BYTES} bytes decoded", CONFIG_HEADER)
    try:
        config = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{CONFIG_HEADER} is not standard base64", CONFIG_HEADER) from None
    if len(config) > MAX_CONFIG_BYTES:
        raise _bad(f"{CONFIG_HEADER}: more than {MAX_CONFIG_BYTES} bytes decoded", CONFIG_HEADER)
    return config


def _check_headers(request: Request, persist: str | None) -> tuple[bytes, str, str | None]:
    """(config bytes, body sha256, revision label) from the headers; 400 naming the header."""
    ctype = request.headers.get("content-type", "application/octet-stream")
    if ctype.split(";")[0].strip().lower() != "application/octet-stream":
        raise _bad(f"the body must be application/octet-stream (safetensors), not {ctype!r}")
    if persist not in (None, "disk"):
        raise _bad(f"persist must be 'disk' (or absent), got {persist!r}", "persist")
    sha = request.headers.get(SHA_HEADER)
    if sha is None or not _SHA_RE.fullmatch(sha):
        raise _bad(f"header {SHA_HEADER} must be the body's lowercase hex sha256", SHA_HEADER)
    return _config_bytes(request), sha, request.headers.get(REVISION_HEADER)


@router.post("/v1/admin/adapters/{name}/push", status_code=201)
async def push_adapter(
    name: str,
    request: Request,
    persist: str | None = None,
    principal: Principal = Depends(push_auth),
    state: ServerState = Depends(get_state),
) -> JSONResponse:
    """Make the pushed bytes the active revision of ``name``; see the module docstring."""
    if not state.client.lora_enabled:
        raise APIError(400, "LoRA is disabled on this server; start it with --enable-lora")
    if name in state.base_names:
        raise _bad(f"{name!r} is the base model's name", "name")
    config, sha, revision = _check_headers(request, persist)
    if persist == "disk" and not state.client.has_disk_tier:
        raise _bad("persist=disk needs a disk tier on this server (--disk-cache-dir)", "persist")
    body = await request.body()  # bounded by the gate (--max-adapter-push-bytes)
    # hashing and copying up to a GiB: in the I/O pool, never on the event loop
    out = await state.run_io(
        _push, state, name, principal, config, body, sha, revision, persist == "disk"
    )
    return JSONResponse(out, status_code=201)


def _tenant_of(state: ServerState, name: str, principal: Principal) -> str | None:
    """The tenant the name is (or will be) under: a tenant key's own (404 for another
    tenant's name, as the other admin routes), else the name's owner, else none."""
    owners = {m.tenant for m in state.registry.list() if m.name == name}
    if principal.tenant is not None:
        if owners and owners != {principal.tenant}:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                           param="name", code="model_not_found")  # fmt: skip
        return principal.tenant
    return next(iter(owners)) if len(owners) == 1 else None


def _push(
    state: ServerState,
    name: str,
    principal: Principal,
    config: bytes,
    body: bytes,
    weights_sha256: str,
    revision: str | None,
    persist_disk: bool,
) -> dict[str, Any]:
    """Check the body's digest, then validate, record, admit, activate, prune (I/O pool; one
    push at a time)."""
    actor = principal.key_id
    got = hashlib.sha256(body).hexdigest()
    if got != weights_sha256:
        raise _bad(f"the body's sha256 {got[:16]}... does not match {SHA_HEADER} "
                   f"{weights_sha256[:16]}...", SHA_HEADER, "digest_mismatch")  # fmt: skip
    try:
        read = read_pushed(config, bytearray(body), name=name)
    except AdapterError as e:
        raise _bad(scrub(str(e)), code="unreadable") from e
    with state.push_lock:
        tenant = _tenant_of(state, name, principal)
        try:
            previous = state.registry.release(name).active_revision
        except RegistryError:
            previous = None  # a new name
        try:
            files = adapter_files_of(read.files, weights_sha256)
            m, _ = state.registry.register_pushed(
                files, name, base=state.base, revision=revision, tenant=tenant, actor=actor
            )
        except RegistryError as e:
            raise registry_api_error(e, param="name") from e
        spec = state.adapter_spec(m)
        try:
            state.client.push(spec, read, persist_disk=persist_disk)
        except AdapterError as e:
            raise _bad(scrub(str(e)), code="adapter_refused") from e
        state.pushed_digests.add(m.sha256)
        if previous != m.revision:
            state.registry.activate(name, m.revision, actor=actor)
        busy = {r.ref.sha256 for r in state.client.residency() if r.in_flight}
        pruned = state.registry.prune_pushed(
            name, state.config.max_pushed_revisions, protect=busy, actor=actor
        )
        state.catalog.refresh(force=True)  # the swap: new requests resolve the new revision
    state.pushed_digests.difference_update(p.sha256 for p in pruned)  # gone: bounded set
    for p in pruned:
        log.info("pruned pushed revision %s@%s (%s)", name, p.revision, p.sha256[:12])
    log.info("pushed adapter %s@%s (%s)", name, m.revision, m.sha256[:12])
    return {
        "object": "adapter.revision",
        "name": name,
        "revision": m.revision,
        "sha256": m.sha256,
        "previous_revision": previous if previous != m.revision else None,
        "persisted": ["host", "disk"] if persist_disk else ["host"],
    }
