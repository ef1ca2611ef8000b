"""Tenants and their limits (``max_waiting``, ``rate_limit_rps``, ``host_bytes_budget``)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from sqlalchemy import select

from loraplex.registry.audit import add_entry
from loraplex.registry.checks import TENANT_RE, check_limit, check_name
from loraplex.registry.db import TenantRow
from loraplex.registry.errors import NotFoundError, RegistryError
from loraplex.registry.records import TENANT_LIMITS, Tenant
from loraplex.registry.rows import tenant_of
from loraplex.registry.sessions import Database


class Tenants:
    """Creating, changing and reading tenants; every change is audited."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_tenant(
        self,
        name: str,
        *,
        max_waiting: int | None = None,
        rate_limit_rps: float | None = None,
        host_bytes_budget: int | None = None,
        actor: str,
    ) -> Tenant:
        check_name("tenant name", name, TENANT_RE)
        limits = {
            "max_waiting": check_limit("max_waiting", max_waiting),
            "rate_limit_rps": check_limit("rate_limit_rps", rate_limit_rps),
            "host_bytes_budget": check_limit("host_bytes_budget", host_bytes_budget),
        }
        with self._db.write() as s:
            if s.get(TenantRow, name) is not None:
                raise RegistryError(f"tenant {name!r} already exists")
            row = TenantRow(name=name, created_at=time.time(), **limits)
            s.add(row)
            s.flush()
            tenant = tenant_of(row)
            add_entry(s, actor, "tenant.create", f"tenant:{name}", None, asdict(tenant))
            return tenant

    def update_tenant(self, name: str, *, actor: str, **limits: Any) -> Tenant:
        """Change limits (``max_waiting``, ``rate_limit_rps``, ``host_bytes_budget``; None clears)."""
        unknown = set(limits) - set(TENANT_LIMITS)
        if unknown:
            raise RegistryError(
                f"unknown tenant limit(s) {sorted(unknown)} (one of {', '.join(TENANT_LIMITS)})"
            )
        checked = {k: check_limit(k, v) for k, v in limits.items()}
        with self._db.write() as s:
            row = s.get(TenantRow, name)
            if row is None:
                raise NotFoundError(f"unknown tenant {name!r}")
            before = asdict(tenant_of(row))
            for k, v in checked.items():
                setattr(row, k, v)
            s.flush()
            tenant = tenant_of(row)
            add_entry(s, actor, "tenant.update", f"tenant:{name}", before, asdict(tenant))
            return tenant

    def get_tenant(self, name: str) -> Tenant:
        with self._db.read() as s:
            row = s.get(TenantRow, name)
            if row is None:
                raise NotFoundError(f"unknown tenant {name!r}")
            return tenant_of(row)

    def list_tenants(self) -> list[Tenant]:
        with self._db.read() as s:
            return [
                tenant_of(r)
                for r in s.execute(select(TenantRow).order_by(TenantRow.name)).scalars()
            ]
