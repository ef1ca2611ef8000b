"""API keys: creating, listing and revoking them, and authenticating a secret to a
:class:`Principal`. The registry keeps only each secret's sha256; a secret is shown once."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from typing import Any

from sqlalchemy import func, select

from loraplex.registry.audit import add_entry
from loraplex.registry.db import ApiKeyRow, TenantRow
from loraplex.registry.errors import NotFoundError, RegistryError
from loraplex.registry.records import SCOPES, Principal
from loraplex.registry.sessions import Database


class ApiKeys:
    """The API keys of every tenant and the admin keys (no tenant); changes are audited."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_key(
        self,
        tenant: str | None,
        *,
        scopes: tuple[str, ...] | list[str] = ("inference",),
        actor: str,
        label: str | None = None,
    ) -> tuple[str, str]:
        """A new API key as ``(key_id, secret)``; the secret is shown only now (the registry
        keeps its sha256). Tenant keys may only hold ``inference``; admin keys have no tenant."""
        scope_set = frozenset(scopes)
        if not scope_set:
            raise RegistryError("a key needs at least one scope")
        bad = sorted(scope_set - set(SCOPES))
        if bad:
            raise RegistryError(f"unknown scope(s) {bad} (one of {', '.join(SCOPES)})")
        if tenant is not None and scope_set != {"inference"}:
            raise RegistryError(
                "tenant keys may only hold the 'inference' scope; admin keys have no tenant"
            )
        if label is not None and (not isinstance(label, str) or len(label) > 256):
            raise RegistryError("label must be a string of at most 256 characters")
        secret = "lpx-" + secrets.token_urlsafe(32)
        key_id = "key_" + secrets.token_hex(6)
        with self._db.write() as s:
            if tenant is not None and s.get(TenantRow, tenant) is None:
                raise NotFoundError(f"unknown tenant {tenant!r}")
            s.add(
                ApiKeyRow(
                    key_id=key_id,
                    tenant=tenant,
                    secret_sha256=hashlib.sha256(secret.encode()).hexdigest(),
                    scopes=json.dumps(sorted(scope_set)),
                    label=label,
                    created_at=time.time(),
                    created_by=actor,
                    revoked_at=None,
                )
            )
            after = {
                "key_id": key_id,
                "tenant": tenant,
                "scopes": sorted(scope_set),
                "label": label,
            }
            add_entry(s, actor, "key.create", f"key:{key_id}", None, after)
        return key_id, secret

    @staticmethod
    def _key_dict(row: ApiKeyRow) -> dict[str, Any]:
        return {
            "key_id": row.key_id,
            "tenant": row.tenant,
            "scopes": json.loads(row.scopes),
            "label": row.label,
            "created_at": row.created_at,
            "created_by": row.created_by,
            "revoked": row.revoked_at is not None,
            "revoked_at": row.revoked_at,
        }

    def list_keys(self, tenant: str | None = None) -> list[dict]:
        """Keys (never their secret or hash); ``tenant`` None lists all."""
        q = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.key_id)
        if tenant is not None:
            q = q.where(ApiKeyRow.tenant == tenant)
        with self._db.read() as s:
            return [self._key_dict(r) for r in s.execute(q).scalars()]

    def revoke_key(self, key_id: str, *, actor: str) -> None:
        with self._db.write() as s:
            row = s.get(ApiKeyRow, key_id)
            if row is None:
                raise NotFoundError(f"unknown key {key_id!r}")
            if row.revoked_at is not None:
                raise RegistryError(f"key {key_id!r} is already revoked")
            before = self._key_dict(row)
            row.revoked_at = time.time()
            s.flush()
            add_entry(s, actor, "key.revoke", f"key:{key_id}", before, self._key_dict(row))

    def authenticate(self, secret: str) -> Principal | None:
        """The principal of a live key with this secret, else None."""
        if not isinstance(secret, str) or not secret.startswith("lpx-") or len(secret) > 256:
            return None
        digest = hashlib.sha256(secret.encode()).hexdigest()
        with self._db.read() as s:
            row = s.execute(
                select(ApiKeyRow).where(ApiKeyRow.secret_sha256 == digest)
            ).scalar_one_or_none()
            if row is None or row.revoked_at is not None:
                return None
            if not hmac.compare_digest(row.secret_sha256, digest):
                return None
            return Principal(row.key_id, row.tenant, frozenset(json.loads(row.scopes)))

    def has_keys(self) -> bool:
        """Whether any non-revoked key exists (a server with none may run open)."""
        with self._db.read() as s:
            q = select(func.count()).select_from(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None))
            return bool(s.execute(q).scalar_one())
