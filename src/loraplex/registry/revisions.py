"""Adapter revisions: registering an adapter directory as a validated revision of a name,
re-validating it later, and reading manifests back.

Slow work (hashing the adapter's files) happens before the write transaction opens. A refused
registration or failed validation raises :class:`ValidationError` and records only an audit entry.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import select

from loraplex.lora.digest import AdapterFiles
from loraplex.registry.audit import add_entry
from loraplex.registry.checks import NAME_RE, REVISION_RE, TENANT_RE, check_name
from loraplex.registry.db import ADAPTER_STATUSES, ReleaseRow, RevisionRow, TenantRow
from loraplex.registry.errors import (
    ConflictError,
    NotFoundError,
    RegistryError,
    ValidationError,
)
from loraplex.registry.inspect import AdapterInfo, BaseModelInfo, inspect_adapter, inspect_files
from loraplex.registry.lifecycle import check_transition
from loraplex.registry.policy import RegistryPolicy, check_signature, check_source
from loraplex.registry.records import Manifest, check_concurrency
from loraplex.registry.rows import (
    manifest_of,
    release_row,
    revision_row,
    revision_row_of,
    row_or_active,
)
from loraplex.registry.sessions import Database
from loraplex.types import is_pushed_source, pushed_source
from loraplex.warm import WARM_POLICIES, WarmSchedule, parse_warm

_AUTO_REV_RE = re.compile(r"r(\d+)")


class Revisions:
    """Manifests per ``(name, revision)``, checked against the operator's policy."""

    def __init__(self, db: Database, policy: RegistryPolicy) -> None:
        self._db = db
        self.policy = policy

    def get(self, name: str, revision: str | None = None) -> Manifest:
        """One revision's manifest (``revision`` None: the active one)."""
        with self._db.read() as s:
            return manifest_of(row_or_active(s, release_row(s, name), revision))

    def list(
        self, *, tenant: str | None = None, include_shared: bool = True, status: str | None = None
    ) -> list[Manifest]:
        """Manifests by name and registration order; ``tenant`` None lists every tenant's."""
        q = select(RevisionRow)
        if tenant is not None:
            cond = RevisionRow.tenant == tenant
            q = q.where(cond | RevisionRow.tenant.is_(None) if include_shared else cond)
        if status is not None:
            if status not in ADAPTER_STATUSES:
                raise RegistryError(
                    f"unknown status {status!r} (one of {', '.join(ADAPTER_STATUSES)})"
                )
            q = q.where(RevisionRow.status == status)
        with self._db.read() as s:
            rows = s.execute(q.order_by(RevisionRow.name, RevisionRow.id)).scalars().all()
            return [manifest_of(r) for r in rows]

    def prepare(
        self,
        path: str | Path,
        name: str,
        *,
        base: BaseModelInfo,
        tenant: str | None = None,
        source_uri: str | None = None,
        allow_any_source: bool = False,
    ) -> tuple[Manifest, Path]:
        """Validate an adapter directory (all checks but the signature) and return the manifest
        it would get (``revision`` "", status "uploaded") with its resolved path; records
        nothing. ``manifest.signed_payload()`` is what to sign."""
        check_name("adapter name", name, NAME_RE)
        if tenant is not None:
            check_name("tenant name", tenant, TENANT_RE)
        resolved, src = check_source(self.policy, path, source_uri, allow_any_source)
        info = inspect_adapter(resolved, base, max_rank=self.policy.max_rank)
        return _draft(name, tenant, info, base, src, str(resolved)), resolved

    def register(
        self,
        path: str | Path,
        name: str,
        *,
        base: BaseModelInfo,
        revision: str | None = None,
        tenant: str | None = None,
        source_uri: str | None = None,
        priority: int = 0,
        slo_class: str | None = None,
        warm_policy: str = "on-demand",
        signature: str | None = None,
        actor: str,
        allow_any_source: bool = False,
        sha256: str | None = None,
        max_concurrent_requests: int | None = None,
        warm: object = None,
    ) -> Manifest:
        """Validate the adapter in ``path`` and record it as a ``validated`` revision of
        ``name``. ``sha256`` (optional) is the digest the caller expects;
        ``max_concurrent_requests`` caps the revision's calls in flight per replica. ``warm``
        (optional, instead of ``warm_policy``) is a warm policy string or a window schedule
        (``{"device": "Mon-Fri 08:00-18:00", "tz": "Europe/Berlin"}``, see
        :func:`loraplex.warm.parse_warm`). Re-registering the same content under ``name``
        returns the existing revision. A failed validation raises ValidationError and records
        only an audit entry."""
        if revision is not None:
            check_name("revision", revision, REVISION_RE)
        if warm_policy not in WARM_POLICIES:
            raise RegistryError(
                f"warm_policy must be one of {', '.join(WARM_POLICIES)}, got {warm_policy!r}"
            )
        warm_policy, warm_schedule = _warm_of(warm_policy, warm)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RegistryError(f"priority must be an integer, got {priority!r}")
        if slo_class is not None and (
            not isinstance(slo_class, str) or not 0 < len(slo_class) <= 64
        ):
            raise RegistryError(f"slo_class must be a short string, got {slo_class!r}")
        check_concurrency("max_concurrent_requests", max_concurrent_requests)
        try:
            draft, _ = self.prepare(
                path,
                name,
                base=base,
                tenant=tenant,
                source_uri=source_uri,
                allow_any_source=allow_any_source,
            )
            if sha256 is not None and sha256 != draft.sha256:
                raise ValidationError(
                    "sha256_mismatch", f"expected digest {sha256}, the files have {draft.sha256}"
                )
            signer = check_signature(self.policy, draft.signed_payload(), signature)
        except ValidationError as e:
            with self._db.write() as s:
                add_entry(
                    s,
                    actor,
                    "register.refused",
                    name if isinstance(name, str) else repr(name),
                    None,
                    {"reason": e.reason, "error": str(e), "path": str(path), "tenant": tenant},
                )
            raise
        extra = {
            "priority": priority,
            "slo_class": slo_class,
            "warm_policy": warm_policy,
            "warm_schedule": warm_schedule,
            "max_concurrent_requests": max_concurrent_requests,
            "signature": signature,
            "signed_by": signer,
        }
        return self._record(draft, revision, actor, base.quantization, extra)[0]

    def _record(
        self,
        draft: Manifest,
        revision: str | None,
        actor: str,
        quantization: str | None,
        extra: dict[str, Any],
        action: str = "register",
    ) -> tuple[Manifest, bool]:
        """Record ``draft`` (validated) as a revision of its name in one transaction, audited
        as ``action``: ``(the manifest, whether it is new)``. The same content already recorded
        is returned as is when no other label is asked for; a label naming other content, or
        other label for the same content, is a :class:`ConflictError`. ``extra``: manifest
        fields set by the caller."""
        name, tenant = draft.name, draft.tenant
        now = time.time()
        with self._db.write() as s:
            if tenant is not None and s.get(TenantRow, tenant) is None:
                raise NotFoundError(f"unknown tenant {tenant!r}")
            rel = s.execute(
                select(ReleaseRow).where(ReleaseRow.name == name).with_for_update()
            ).scalar_one_or_none()
            if rel is None:
                rel = ReleaseRow(name=name, tenant=tenant, canary_weight=0.0, created_at=now)
                rel.updated_at = now
                s.add(rel)
                s.flush()
            elif rel.tenant != tenant:
                owner = "shared" if rel.tenant is None else "owned by another tenant"
                raise RegistryError(f"adapter name {name!r} is already taken ({owner})")
            same = (
                s.execute(
                    select(RevisionRow)
                    .where(RevisionRow.name == name, RevisionRow.sha256 == draft.sha256)
                    .order_by(RevisionRow.id)
                )
                .scalars()
                .first()
            )
            if same is not None:
                if revision is None or revision == same.revision:
                    # idempotent: the same content is already this revision (no audit noise,
                    # but the transaction still bumped the generation harmlessly)
                    return manifest_of(same), False
                raise ConflictError(
                    f"adapter {name!r}: this content is already registered as revision "
                    f"{same.revision!r}"
                )
            if revision is None:
                revs = s.execute(select(RevisionRow.revision).where(RevisionRow.name == name))
                nums = [int(m[1]) for (r,) in revs if (m := _AUTO_REV_RE.fullmatch(r))]
                revision = f"r{max(nums, default=0) + 1}"
            elif s.execute(
                select(RevisionRow.id).where(
                    RevisionRow.name == name, RevisionRow.revision == revision
                )
            ).first():
                raise ConflictError(
                    f"adapter {name!r} already has a revision {revision!r} with other content"
                )
            check_transition("uploaded", "validated", f"{name}@{revision}")
            row = revision_row_of(
                replace(draft, revision=revision, status="validated", created_at=now, **extra)
            )
            s.add(row)
            rel.updated_at = now
            s.flush()
            manifest = manifest_of(row)
            after = {**manifest.to_dict(), "base_quantization": quantization}
            add_entry(s, actor, action, f"{name}@{revision}", None, after)
            return manifest, True

    def register_pushed(
        self,
        files: AdapterFiles,
        name: str,
        *,
        base: BaseModelInfo,
        revision: str | None = None,
        tenant: str | None = None,
        actor: str,
    ) -> tuple[Manifest, bool]:
        """Validate pushed adapter bytes (``files``: read from memory, not a directory) with
        the same rules as :meth:`register` and record them as a ``validated`` revision of
        ``name`` whose source is ``pushed://<sha256>`` (audited as ``push``): ``(manifest,
        whether it is new)``. The same bytes pushed again return their revision; a refusal
        raises ValidationError (audited as ``push.refused``) and records nothing else. A
        registry that requires signatures refuses pushes (they carry none)."""
        check_name("adapter name", name, NAME_RE)
        if tenant is not None:
            check_name("tenant name", tenant, TENANT_RE)
        if revision is not None:
            check_name("revision", revision, REVISION_RE)
        try:
            info = inspect_files(files, base, max_rank=self.policy.max_rank)
            draft = _draft(name, tenant, info, base, pushed_source(files.digest), "")
            check_signature(self.policy, draft.signed_payload(), None)
        except ValidationError as e:
            with self._db.write() as s:
                after = {"reason": e.reason, "error": str(e), "tenant": tenant}
                add_entry(s, actor, "push.refused", name, None, after)
            raise
        return self._record(draft, revision, actor, base.quantization, {}, "push")

    def prune_pushed(
        self, name: str, keep: int, *, protect: Collection[str] = (), actor: str
    ) -> list[Manifest]:
        """Delete the pushed revisions of ``name`` beyond the ``keep`` newest, except the
        active one, the canary, the rollback target and those whose digest is in ``protect``
        (in flight somewhere); each deletion is audited (``prune``). The manifests deleted."""
        with self._db.write() as s:
            rel = release_row(s, name, lock=True)
            rows = (
                s.execute(
                    select(RevisionRow)
                    .where(RevisionRow.name == name)
                    .order_by(RevisionRow.id.desc())
                )
                .scalars()
                .all()
            )
            pushed = [r for r in rows if is_pushed_source(r.source_uri)]
            held = {rel.active_revision, rel.canary_revision, rel.previous_revision}
            held |= {r.rollback_revision for r in rows if r.revision == rel.active_revision}
            gone = []
            for r in pushed[keep:]:
                if r.revision in held or r.sha256 in protect:
                    continue
                gone.append(manifest_of(r))
                s.delete(r)
                add_entry(s, actor, "prune", f"{name}@{r.revision}", {"sha256": r.sha256}, None)
            return gone

    def validate(self, name: str, revision: str, *, base: BaseModelInfo, actor: str) -> Manifest:
        """Re-check a revision's files now against its manifest and ``base``: base digest,
        shapes, digests and file hashes, signature. ``uploaded`` becomes ``validated``; a
        failure is audited and raised (the status is left for the operator to decide)."""
        m = self.get(name, revision)
        target = f"{name}@{revision}"
        try:
            if base.digest != m.base_model_digest:
                raise ValidationError(
                    "base_model_mismatch",
                    f"{target} was registered for base {m.base_model_name} "
                    f"({m.base_model_digest[:12]}), this base {base.name} is {base.digest[:12]}",
                )
            now_path = Path(m.path).resolve()
            if str(now_path) != m.path:
                raise ValidationError(
                    "source_not_allowed",
                    f"{m.path!r} now resolves to {str(now_path)!r} (a link was swapped in)",
                )
            info = inspect_adapter(now_path, base, max_rank=self.policy.max_rank)
            got = (info.files.digest, info.files.weights_sha256, info.files.config_sha256)
            if got[1:] == (m.weights_sha256, m.config_sha256) and got[0] != m.sha256:
                # the same files under another digest: registered by an earlier digest version
                raise ValidationError(
                    "sha256_mismatch",
                    f"{target}: the files are unchanged, but its digest {m.sha256[:12]} is of an "
                    f"earlier digest version (now {info.files.digest[:12]}); register it again",
                )
            if got != (m.sha256, m.weights_sha256, m.config_sha256):
                raise ValidationError(
                    "sha256_mismatch",
                    f"{target}: the files in {m.path} no longer match the manifest "
                    f"(digest {info.files.digest[:12]} != {m.sha256[:12]})",
                )
            check_signature(self.policy, m.signed_payload(), m.signature)
        except ValidationError as e:
            with self._db.write() as s:
                add_entry(
                    s, actor, "validate.failed", target, None, {"reason": e.reason, "error": str(e)}
                )
            raise
        with self._db.write() as s:
            row = revision_row(s, name, revision)
            before = manifest_of(row)
            if row.status == "uploaded":
                check_transition(row.status, "validated", target)
                row.status = "validated"
            s.flush()
            after = manifest_of(row)
            checked = {
                "sha256": m.sha256,
                "base_model_digest": base.digest,
                "base_quantization": base.quantization,
                "signed_by": m.signed_by,
            }
            add_entry(
                s, actor, "validate", target, {"status": before.status},
                {"status": after.status, "verified": checked},
            )  # fmt: skip
            return after


def _draft(
    name: str, tenant: str | None, info: AdapterInfo, base: BaseModelInfo, src: str, path: str
) -> Manifest:
    """The manifest an inspected adapter would get (``revision`` "", status "uploaded")."""
    return Manifest(
        name=name,
        tenant=tenant,
        revision="",
        sha256=info.files.digest,
        weights_sha256=info.files.weights_sha256,
        config_sha256=info.files.config_sha256,
        base_model_name=base.name,
        base_model_digest=base.digest,
        rank=info.rank,
        alpha=info.alpha,
        dtype=info.dtype,
        target_modules=info.target_modules,
        nbytes=info.nbytes,
        alora_invocation_tokens=info.alora_invocation_tokens,
        source_uri=src,
        path=path,
    )


def _warm_of(warm_policy: str, warm: object) -> tuple[str, WarmSchedule | None]:
    """(warm policy, window schedule) of register's ``warm_policy`` and ``warm`` arguments: a
    schedule keeps the policy ``on-demand`` (the windows say when it is warm); giving both a
    non-default ``warm_policy`` and ``warm`` is refused."""
    if warm is None:
        return warm_policy, None
    if warm_policy != "on-demand":
        raise RegistryError("give either warm_policy or warm, not both")
    try:
        parsed = parse_warm(warm, "warm")
    except ValueError as e:
        raise RegistryError(str(e)) from None
    if isinstance(parsed, WarmSchedule):
        return "on-demand", parsed
    return parsed, None
