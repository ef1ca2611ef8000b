"""The adapter registry: manifests per revision, releases (active + canary), tenants, API keys
and the audit log, behind one :class:`Registry` object over SQLite or PostgreSQL.

Every mutating method runs in one transaction that (1) bumps ``generation`` first, which
serialises writers (a row lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), (2) changes the
state through :mod:`loraplex.registry.lifecycle`, and (3) writes its audit entry. Slow work
(hashing adapter files) happens before the transaction opens.

:class:`Registry` is the one object callers hold; each group of its methods is a small store
over the same :class:`~loraplex.registry.sessions.Database`: :class:`Revisions` (registration,
validation, manifests), :class:`Releases` (the lifecycle), :class:`Tenants`, :class:`ApiKeys` and
:class:`AuditLog`. The Registry methods are those stores' methods, forwarded (:func:`_forward`):
each is declared once, in its store, whose signature and docstring the Registry method shows;
a new parameter or manifest field is an edit of the store alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from loraplex.registry.audit import AuditLog
from loraplex.registry.db import default_url
from loraplex.registry.keys import ApiKeys
from loraplex.registry.policy import RegistryPolicy
from loraplex.registry.releases import Releases
from loraplex.registry.revisions import Revisions
from loraplex.registry.sessions import Database, safe_url
from loraplex.registry.tenants import Tenants

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _forward(
    store: str, method: Callable[Concatenate[Any, _P], _R]
) -> Callable[Concatenate[Registry, _P], _R]:
    """A Registry method that calls ``method`` on the store in attribute ``store``: same name,
    signature (``inspect.signature`` follows ``__wrapped__``) and docstring, declared once."""
    name = method.__name__

    @functools.wraps(method)
    def forwarded(self: Registry, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return getattr(getattr(self, store), name)(*args, **kwargs)

    return forwarded


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
    get = _forward("_revisions", Revisions.get)
    list = _forward("_revisions", Revisions.list)
    prepare = _forward("_revisions", Revisions.prepare)
    register = _forward("_revisions", Revisions.register)
    register_pushed = _forward("_revisions", Revisions.register_pushed)
    prune_pushed = _forward("_revisions", Revisions.prune_pushed)
    validate = _forward("_revisions", Revisions.validate)

    # ------------------------------------------------------------------ releases and lifecycle
    release = _forward("_releases", Releases.release)
    visible = _forward("_releases", Releases.visible)
    stage = _forward("_releases", Releases.stage)
    promote = _forward("_releases", Releases.promote)
    activate = _forward("_releases", Releases.activate)
    canary = _forward("_releases", Releases.canary)
    rollback = _forward("_releases", Releases.rollback)
    rollback_canary = _forward("_releases", Releases.rollback_canary)
    disable = _forward("_releases", Releases.disable)

    # ------------------------------------------------------------------ tenants
    create_tenant = _forward("_tenants", Tenants.create_tenant)
    update_tenant = _forward("_tenants", Tenants.update_tenant)
    get_tenant = _forward("_tenants", Tenants.get_tenant)
    list_tenants = _forward("_tenants", Tenants.list_tenants)

    # ------------------------------------------------------------------ API keys
    create_key = _forward("_keys", ApiKeys.create_key)
    list_keys = _forward("_keys", ApiKeys.list_keys)
    revoke_key = _forward("_keys", ApiKeys.revoke_key)
    authenticate = _forward("_keys", ApiKeys.authenticate)
    has_keys = _forward("_keys", ApiKeys.has_keys)

    # ------------------------------------------------------------------ audit
    audit = _forward("_audit_log", AuditLog.audit)
    audit_log = _forward("_audit_log", AuditLog.audit_log)
