"""The adapter registry: manifests per revision, releases (active + canary), tenants, API keys
and the audit log, behind one :class:`Registry` object over SQLite or PostgreSQL.

Every mutating method runs in one transaction that (1) bumps ``generation`` first, which
serialises writers (a row lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), (2) changes the
state through :mod:`loraplex.registry.lifecycle`, and (3) writes its audit entry. Slow work
(hashing adapter files) happens before the transaction opens.

:class:`Registry` is the one object callers hold; it delegates each group of methods to a small
store over the same :class:`~loraplex.registry.sessions.Database`: :class:`Revisions`
(registration, validation, manifests), :class:`Releases` (the lifecycle), :class:`Tenants`,
:class:`ApiKeys` and :class:`AuditLog`. Each store method has the same name and signature as
the Registry method that calls it, and carries its docstring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplex.registry.audit import AuditLog
from loraplex.registry.db import default_url
from loraplex.registry.inspect import BaseModelInfo
from loraplex.registry.keys import ApiKeys
from loraplex.registry.policy import RegistryPolicy
from loraplex.registry.records import (
    AuditEntry,
    CanaryPolicy,
    Manifest,
    Principal,
    Release,
    Tenant,
)
from loraplex.registry.releases import Releases
from loraplex.registry.revisions import Revisions
from loraplex.registry.sessions import Database, safe_url
from loraplex.registry.tenants import Tenants


class Registry:
    """The registry over one database URL; thread-safe (a session per call)."""

    def __init__(self, url: str, policy: RegistryPolicy) -> None:
        """Use :meth:`open`."""
        self.url = url
        self.policy = policy
        self._db = Database(url)
        self._revisions = Revisions(self._db, policy)
        self._releases = Releases(self._db)
        self._tenants = Tenants(self._db)
        self._keys = ApiKeys(self._db)
        self._audit_log = AuditLog(self._db)

    @classmethod
    def open(cls, url: str | None = None, *, policy: RegistryPolicy | None = None) -> Registry:
        """Open (and migrate) the registry at ``url`` (default: ``$LORAPLEX_REGISTRY_URL`` or
        ``sqlite:///<LORAPLEX_HOME>/registry.db``; ``sqlite://`` is in-memory)."""
        return cls(url or default_url(), policy or RegistryPolicy())

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Registry({safe_url(self.url)!r})"

    def generation(self) -> int:
        """A counter bumped by every mutation: poll it to know when to re-read."""
        return self._db.generation()

    # ------------------------------------------------------------------ revisions

    def get(self, name: str, revision: str | None = None) -> Manifest:
        return self._revisions.get(name, revision)

    def list(
        self, *, tenant: str | None = None, include_shared: bool = True, status: str | None = None
    ) -> list[Manifest]:
        return self._revisions.list(tenant=tenant, include_shared=include_shared, status=status)

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
        return self._revisions.prepare(
            path,
            name,
            base=base,
            tenant=tenant,
            source_uri=source_uri,
            allow_any_source=allow_any_source,
        )

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
        return self._revisions.register(
            path,
            name,
            base=base,
            revision=revision,
            tenant=tenant,
            source_uri=source_uri,
            priority=priority,
            slo_class=slo_class,
            warm_policy=warm_policy,
            signature=signature,
            actor=actor,
            allow_any_source=allow_any_source,
            sha256=sha256,
            max_concurrent_requests=max_concurrent_requests,
            warm=warm,
        )

    def validate(self, name: str, revision: str, *, base: BaseModelInfo, actor: str) -> Manifest:
        return self._revisions.validate(name, revision, base=base, actor=actor)

    # ------------------------------------------------------------------ releases and lifecycle

    def release(self, name: str) -> Release:
        return self._releases.release(name)

    def visible(self, *, tenant: str | None) -> list[Release]:
        return self._releases.visible(tenant=tenant)

    def stage(self, name: str, revision: str, *, actor: str) -> Manifest:
        return self._releases.stage(name, revision, actor=actor)

    def promote(self, name: str, revision: str | None = None, *, actor: str) -> Release:
        return self._releases.promote(name, revision, actor=actor)

    def activate(self, name: str, revision: str, *, actor: str) -> Release:
        return self._releases.activate(name, revision, actor=actor)

    def canary(
        self,
        name: str,
        revision: str,
        weight: float,
        *,
        actor: str,
        policy: CanaryPolicy | None = None,
    ) -> Release:
        return self._releases.canary(name, revision, weight, actor=actor, policy=policy)

    def rollback(self, name: str, *, actor: str, reason: str = "manual") -> Release:
        return self._releases.rollback(name, actor=actor, reason=reason)

    def rollback_canary(
        self, name: str, revision: str, *, actor: str, reason: str
    ) -> Release | None:
        return self._releases.rollback_canary(name, revision, actor=actor, reason=reason)

    def disable(self, name: str, revision: str | None = None, *, actor: str) -> Manifest:
        return self._releases.disable(name, revision, actor=actor)

    # ------------------------------------------------------------------ tenants

    def create_tenant(
        self,
        name: str,
        *,
        max_waiting: int | None = None,
        rate_limit_rps: float | None = None,
        host_bytes_budget: int | None = None,
        actor: str,
    ) -> Tenant:
        return self._tenants.create_tenant(
            name,
            max_waiting=max_waiting,
            rate_limit_rps=rate_limit_rps,
            host_bytes_budget=host_bytes_budget,
            actor=actor,
        )

    def update_tenant(self, name: str, *, actor: str, **limits: Any) -> Tenant:
        return self._tenants.update_tenant(name, actor=actor, **limits)

    def get_tenant(self, name: str) -> Tenant:
        return self._tenants.get_tenant(name)

    def list_tenants(self) -> list[Tenant]:
        return self._tenants.list_tenants()

    # ------------------------------------------------------------------ API keys

    def create_key(
        self,
        tenant: str | None,
        *,
        scopes: tuple[str, ...] | list[str] = ("inference",),
        actor: str,
        label: str | None = None,
    ) -> tuple[str, str]:
        return self._keys.create_key(tenant, scopes=scopes, actor=actor, label=label)

    def list_keys(self, tenant: str | None = None) -> list[dict]:
        return self._keys.list_keys(tenant)

    def revoke_key(self, key_id: str, *, actor: str) -> None:
        self._keys.revoke_key(key_id, actor=actor)

    def authenticate(self, secret: str) -> Principal | None:
        return self._keys.authenticate(secret)

    def has_keys(self) -> bool:
        return self._keys.has_keys()

    # ------------------------------------------------------------------ audit

    def audit(
        self,
        actor: str,
        action: str,
        target: str,
        before: dict | None = None,
        after: dict | None = None,
    ) -> None:
        self._audit_log.audit(actor, action, target, before, after)

    def audit_log(self, *, limit: int = 100, target: str | None = None) -> list[AuditEntry]:
        return self._audit_log.audit_log(limit=limit, target=target)
