"""Admin routes: vLLM's runtime loading (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``),
pins and evictions, and the registry (``/v1/admin/adapters``: register, merge, promote, canary
with its health policy, rollback, disable; ``/v1/admin/audit``); and the one release route open to
inference keys, ``POST /v1/adapters/{name}/feedback`` (a user's score of a canary's response).

Each route needs an admin scope: ``admin:load``, ``admin:pin``, ``admin:register`` or
``admin:promote`` (reading needs any admin scope); vLLM's load and unload also follow
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (:func:`~loraplex.server.auth.check_runtime_lora_auth`). ``--admin-api-key`` holds them all; registry
keys hold the scopes they were created with, and a tenant-bound admin key acts only on its
tenant's adapters. Every change is in the registry's audit log with the caller's key id.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from loraplex.lora.merging import merge_adapter_dirs
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.merging import MAX_MERGED_ADAPTERS, MergeSpec
from loraplex.lora.peft.merging import PARAMS as MERGE_PARAMS
from loraplex.registry import CanaryPolicy, Manifest, Principal, RegistryError
from loraplex.registry.merges import merge_adapters
from loraplex.server.adapters import check_allowed_path
from loraplex.server.auth import admin_principal, inference_principal, runtime_lora_principal
from loraplex.server.catalog import ADMIN_KEY, Servable
from loraplex.server.errors import APIError, registry_api_error, scrub
from loraplex.server.protocol import (
    AdapterFeedbackRequest,
    CanaryAdapterRequest,
    DisableAdapterRequest,
    EvictLoRAAdapterRequest,
    LoadLoRAAdapterRequest,
    PinLoRAAdapterRequest,
    PromoteAdapterRequest,
    RegisterAdapterRequest,
    RollbackAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from loraplex.server.protocol.base import Text
from loraplex.server.state import ServerState, get_state
from loraplex.types import AdapterError
from loraplex.warm import parse_warm

log = logging.getLogger("loraplex.server.app")  # the server's log lines keep one logger name

router = APIRouter()

pin_auth = admin_principal("admin:pin")
any_admin = admin_principal("admin:")  # reading the registry: any admin scope
register_auth, promote_auth = admin_principal("admin:register"), admin_principal("admin:promote")


# -- helpers ---------------------------------------------------------------------------------------
def _lora_enabled(state: ServerState) -> None:
    if not state.client.lora_enabled:
        raise APIError(400, "LoRA is disabled on this server; start it with --enable-lora")


def _not_found(name: str, param: str = "lora_name") -> APIError:
    return APIError(
        404,
        f"The lora adapter '{name}' cannot be found.",
        "NotFoundError",
        param=param,
        code="model_not_found",
    )


def _servable(state: ServerState, name: str, principal: Principal) -> Servable:
    sv = state.catalog.lookup(name, principal)
    if sv is None:
        raise _not_found(name)
    return sv


def _changed(state: ServerState) -> None:
    state.catalog.refresh(force=True)


def _tenant_of(body_tenant: str | None, principal: Principal, verb: str) -> str | None:
    """The tenant a registry write is for: a tenant-bound key's own (403 for another)."""
    if principal.tenant is None:
        return body_tenant
    if body_tenant not in (None, principal.tenant):
        raise APIError(403, f"a tenant key may {verb} only for its own tenant",
                       "permission_error", param="tenant")  # fmt: skip
    return principal.tenant


def _owned_name(state: ServerState, name: str, principal: Principal) -> None:
    """A tenant-bound admin key may act only on its tenant's names (404 otherwise)."""
    if principal.tenant is None:
        return
    owners = {m.tenant for m in state.registry.list() if m.name == name}
    if owners and owners != {principal.tenant}:  # unknown names: the registry's own 404
        raise _not_found(name, "name")


# -- vLLM's runtime loading, pins ------------------------------------------------------------------
@router.post("/v1/load_lora_adapter")
def load_lora_adapter(
    body: LoadLoRAAdapterRequest,
    principal: Principal = Depends(runtime_lora_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    """vLLM's runtime load: register the directory as a new revision (validated against the
    served base), load and verify it, then make it the active revision of ``lora_name``.
    ``load_inplace`` replaces a loaded name's weights (a new revision, so the next request
    uses the new digest); without it a loaded name is vLLM's 400. Who may call it:
    :func:`~loraplex.server.auth.check_runtime_lora_auth`."""
    _lora_enabled(state)
    name = body.lora_name
    if name in state.base_names:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    if state.catalog.lookup(name, ADMIN_KEY) is not None and not body.load_inplace:
        raise APIError(
            400,
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True.",
            "InvalidUserInput",
            param="lora_name",
        )
    try:
        path = check_allowed_path(body.lora_path, state.config.allowed_lora_roots)
    except AdapterError as e:
        if isinstance(e.__cause__, FileNotFoundError) or "is not a directory" in str(e):
            raise APIError(  # vLLM's LoRAAdapterNotFoundError (the path itself scrubbed)
                404,
                f"Loading lora {name} failed: No adapter found for {scrub(body.lora_path)}",
                "NotFoundError",
                param="lora_path",
            ) from e
        raise APIError(400, scrub(str(e)), param="lora_path") from e
    try:
        manifest = state.registry.register(
            str(path), name, base=state.base, tenant=principal.tenant, actor=principal.key_id
        )
    except RegistryError as e:
        raise registry_api_error(e, param="lora_path") from e
    try:
        ref = state.client.check_loadable(state.adapter_spec(manifest))
    except AdapterError as e:
        raise APIError(400, scrub(str(e)), param="lora_path") from e
    if state.registry.release(name).active_revision != manifest.revision:
        state.registry.activate(name, manifest.revision, actor=principal.key_id)
    _changed(state)
    log.info("loaded adapter %s from %s (%s)", name, path, ref.short)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest,
    principal: Principal = Depends(runtime_lora_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    """Disable the active revision: new requests get 404, requests in flight finish on it."""
    sv = _servable(state, body.lora_name, principal)
    state.registry.disable(sv.name, sv.active.revision, actor=principal.key_id)
    _changed(state)
    log.info("unloaded adapter %s (in-flight requests finish on it)", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/v1/pin_lora_adapter")
def pin_lora_adapter(
    body: PinLoRAAdapterRequest,
    principal: Principal = Depends(pin_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """Load the active revision if needed and pin it in host memory and disk (and its
    device slot with ``device``): pinned adapters are never evicted."""
    _lora_enabled(state)
    sv = _servable(state, body.lora_name, principal)
    digest = state.client.pin(state.adapter_spec(sv.active), device=body.device)
    state.registry.audit(
        principal.key_id, "pin", sv.name,
        after={"revision": sv.active.revision, "sha256": digest, "device": body.device},
    )  # fmt: skip
    log.info("pinned adapter %s (%s, device=%s)", sv.name, digest[:12], body.device)
    return {"lora_name": sv.name, "sha256": digest[:16], "pinned": True, "device": body.device}


@router.post("/v1/unpin_lora_adapter")
def unpin_lora_adapter(
    body: UnloadLoRAAdapterRequest,
    principal: Principal = Depends(pin_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    _lora_enabled(state)
    sv = _servable(state, body.lora_name, principal)
    d = sv.active.sha256
    state.client.unpin(d)
    state.registry.audit(principal.key_id, "unpin", sv.name, after={"sha256": d})
    return {"lora_name": sv.name, "sha256": d[:16], "pinned": False}


@router.post("/v1/evict_lora_adapter")
def evict_lora_adapter(
    body: EvictLoRAAdapterRequest,
    principal: Principal = Depends(pin_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """Drop the active revision's copies from the given tiers (default: device, host, disk).
    Refused with 409 while requests use it or it is pinned."""
    _lora_enabled(state)
    sv = _servable(state, body.lora_name, principal)
    d = sv.active.sha256
    if not state.client.has_copy(d):
        return {"lora_name": sv.name, "sha256": d[:16], "evicted_from": []}
    tiers = body.tiers or ["device", "host", "disk"]
    left = state.client.evict(d, tiers=tiers)
    state.registry.audit(principal.key_id, "evict", sv.name, after={"sha256": d, "tiers": left})
    log.info("evicted adapter %s (%s) from %s", sv.name, d[:12], left)
    return {"lora_name": sv.name, "sha256": d[:16], "evicted_from": left}


# -- the registry ----------------------------------------------------------------------------------
@router.get("/v1/admin/adapters")
def admin_list_adapters(
    status: str | None = None,
    principal: Principal = Depends(any_admin),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    ms = state.registry.list(tenant=principal.tenant, status=status)
    if principal.tenant is not None:
        ms = [m for m in ms if m.tenant == principal.tenant]
    return {"object": "list", "data": [m.to_dict() for m in ms]}


@router.get("/v1/admin/adapters/{name}")
def admin_show_adapter(
    name: str,
    principal: Principal = Depends(any_admin),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    _owned_name(state, name, principal)
    rel = state.registry.release(name)
    revisions = [m.to_dict() for m in state.registry.list() if m.name == name]
    return {"name": name, "release": dataclasses.asdict(rel), "revisions": revisions}


@router.post("/v1/admin/adapters")
def admin_register_adapter(
    body: RegisterAdapterRequest,
    principal: Principal = Depends(register_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """Register one revision (validated against the served base model); ``stage`` or
    ``activate`` it in the same call."""
    if body.name in state.base_names:
        raise APIError(400, f"{body.name!r} is the base model's name", param="name")
    tenant = _tenant_of(body.tenant, principal, "register")
    _owned_name(state, body.name, principal)
    if body.warm is not None:
        try:
            parse_warm(body.warm, "warm")
        except ValueError as e:
            raise APIError(400, str(e), param="warm", code="invalid_warm") from None
    m = state.registry.register(
        body.path,
        body.name,
        base=state.base,
        revision=body.revision,
        tenant=tenant,
        source_uri=body.source_uri,
        priority=body.priority,
        slo_class=body.slo_class,
        warm_policy=body.warm_policy,
        signature=body.signature,
        actor=principal.key_id,
        max_concurrent_requests=body.max_concurrent_requests,
        warm=body.warm,
    )
    if body.activate:
        state.registry.activate(body.name, m.revision, actor=principal.key_id)
    elif body.stage:
        state.registry.stage(body.name, m.revision, actor=principal.key_id)
    _changed(state)
    return state.registry.get(body.name, m.revision).to_dict()


class MergeAdaptersRequest(BaseModel):
    """``POST /v1/admin/adapters/merge``: merge registered adapters (``name`` or
    ``name@revision``) into a new revision of ``name`` with PEFT's ``add_weighted_adapter``
    (``combination_type`` and its parameters, PEFT's names; ``weights`` default to 1 each)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Text = Field(min_length=1, max_length=200)
    adapters: list[Text] = Field(min_length=1, max_length=MAX_MERGED_ADAPTERS)
    weights: list[float] | None = Field(default=None, min_length=1, max_length=MAX_MERGED_ADAPTERS)
    combination_type: Text = Field(min_length=1, max_length=64)
    density: float | None = None
    majority_sign_method: Text | None = Field(default=None, max_length=64)
    svd_rank: int | None = None
    svd_clamp: float | None = None
    svd_full_matrices: bool | None = None
    seed: int | None = None
    tenant: Text | None = None
    revision: Text | None = Field(default=None, min_length=1, max_length=100)
    signature: Text | None = Field(default=None, max_length=512)
    stage: bool = False
    activate: bool = False
    dry_run: bool = False


def _merge_view(m: Manifest) -> dict[str, Any]:
    """A merged revision for the client: its manifest without server paths."""
    d = m.to_dict()
    for k in ("path", "source_uri"):
        d.pop(k, None)
    return {"object": "adapter.revision", **d}


@router.post("/v1/admin/adapters/merge", status_code=201)
def admin_merge_adapters(
    body: MergeAdaptersRequest,
    principal: Principal = Depends(register_auth),
    state: ServerState = Depends(get_state),
) -> Response:
    """Merge registered adapters into a new adapter revision (signed, versioned, with its
    digest, validated against the served base): 201 with its manifest. ``dry_run`` answers
    200 with the manifest it would get and ``signed_payload``, the bytes to sign for a registry
    that wants signatures (then send the same merge with ``signature``)."""
    if body.name in state.base_names:
        raise APIError(400, f"{body.name!r} is the base model's name", param="name")
    tenant = _tenant_of(body.tenant, principal, "merge")
    _owned_name(state, body.name, principal)
    try:
        params = body.model_dump(include=set(MERGE_PARAMS))
        spec = MergeSpec.of(body.combination_type, body.weights, len(body.adapters), **params)
    except FormatError as e:
        param = getattr(e, "param", None)
        raise APIError(400, str(e), param=param, code=e.reason) from None
    if not state.merge_lock.acquire(blocking=False):
        raise APIError(429, "another adapter merge is running on this server; retry when it "
                       "is done", "rate_limit_error", code="merge_in_progress")  # fmt: skip
    try:
        m = merge_adapters(
            state.registry,
            body.adapters,
            spec,
            name=body.name,
            base=state.base,
            tenant=tenant,
            actor=principal.key_id,
            merger=merge_adapter_dirs,
            revision=body.revision,
            signature=body.signature,
            dry_run=body.dry_run,
        )
    except RegistryError as e:
        raise registry_api_error(e, param="adapters") from e
    finally:
        state.merge_lock.release()
    if body.dry_run:
        return JSONResponse({**_merge_view(m), "signed_payload": m.signed_payload().decode()})
    if body.activate:
        state.registry.activate(body.name, m.revision, actor=principal.key_id)
    elif body.stage:
        state.registry.stage(body.name, m.revision, actor=principal.key_id)
    _changed(state)
    log.info("merged %s into %s@%s (%s)", ", ".join(body.adapters), m.name, m.revision,
             m.sha256[:12])  # fmt: skip
    return JSONResponse(_merge_view(state.registry.get(body.name, m.revision)), status_code=201)


@router.post("/v1/admin/adapters/{name}/promote")
def admin_promote(
    name: str,
    body: PromoteAdapterRequest,
    principal: Principal = Depends(promote_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    _owned_name(state, name, principal)
    rel = state.registry.promote(name, body.revision, actor=principal.key_id)
    _changed(state)
    return dataclasses.asdict(rel)


@router.post("/v1/admin/adapters/{name}/canary")
def admin_canary(
    name: str,
    body: CanaryAdapterRequest,
    principal: Principal = Depends(promote_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    _owned_name(state, name, principal)
    policy = None if body.policy is None else CanaryPolicy(**body.policy.model_dump())
    rel = state.registry.canary(
        name, body.revision, body.weight, actor=principal.key_id, policy=policy
    )
    _changed(state)
    return dataclasses.asdict(rel)


@router.post("/v1/admin/adapters/{name}/rollback")
def admin_rollback(
    name: str,
    body: RollbackAdapterRequest | None = None,
    principal: Principal = Depends(promote_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    _owned_name(state, name, principal)
    reason = body.reason if body is not None else "manual"
    rel = state.registry.rollback(name, actor=principal.key_id, reason=reason)
    _changed(state)
    return dataclasses.asdict(rel)


@router.post("/v1/adapters/{name}/feedback")
async def adapter_feedback(
    name: str,
    body: AdapterFeedbackRequest,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """A user's score of a response served by ``body.revision`` of ``name``: counted in the
    canary's quality window on this replica when that revision is the canary (``recorded``);
    404 for a name the caller may not see, as for a name that does not exist."""
    sv = state.catalog.lookup(name, principal)
    if sv is None:
        raise _not_found(name, "name")
    canary, policy = sv.canary, sv.canary_policy
    recorded = canary is not None and canary.revision == body.revision and policy is not None
    if recorded:
        assert policy is not None
        state.canary.feedback(name, body.revision, policy, body.score)
    return {"object": "adapter.feedback", "name": name, "revision": body.revision,
            "recorded": recorded}  # fmt: skip


@router.post("/v1/admin/adapters/{name}/disable")
def admin_disable(
    name: str,
    body: DisableAdapterRequest,
    principal: Principal = Depends(promote_auth),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    _owned_name(state, name, principal)
    m = state.registry.disable(name, body.revision, actor=principal.key_id)
    _changed(state)
    return m.to_dict()


@router.get("/v1/admin/audit")
def admin_audit(
    target: str | None = None,
    limit: int = 100,
    principal: Principal = Depends(any_admin),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    if not 1 <= limit <= 10_000:
        raise APIError(400, "limit must be in [1, 10000]", param="limit")
    if principal.tenant is not None:
        if target is None:
            raise APIError(400, "a tenant admin key must name a target", param="target")
        _owned_name(state, target, principal)
    entries = state.registry.audit_log(limit=limit, target=target)
    return {"object": "list", "data": [dataclasses.asdict(e) for e in entries]}
