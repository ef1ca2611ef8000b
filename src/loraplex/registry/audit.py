"""The audit log: who did what to which target, with the state before and after (JSON).

Every store writes its entry with :func:`add_entry` inside the transaction of the change itself,
so a change and its entry commit (or roll back) together.
"""

from __future__ import annotations

import json
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.registry.db import AuditRow
from loraplex.registry.errors import RegistryError
from loraplex.registry.records import AuditEntry
from loraplex.registry.sessions import Database


def add_entry(
    s: Session,
    actor: str,
    action: str,
    target: str,
    before: dict | None = None,
    after: dict | None = None,
) -> None:
    """Add one entry to the transaction ``s`` (checked: actor, action and target lengths)."""
    if not isinstance(actor, str) or not 0 < len(actor) <= 256:
        raise RegistryError("actor must be a non-empty string of at most 256 characters")
    if len(action) > 64 or len(target) > 256:
        raise RegistryError("audit action (64) or target (256 characters) too long")
    s.add(
        AuditRow(
            ts=time.time(),
            actor=actor,
            action=action,
            target=target,
            before=None if before is None else json.dumps(before, sort_keys=True),
            after=None if after is None else json.dumps(after, sort_keys=True),
        )
    )


class AuditLog:
    """Recording actions done outside the registry and reading the log back."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def audit(
        self,
        actor: str,
        action: str,
        target: str,
        before: dict | None = None,
        after: dict | None = None,
    ) -> None:
        """Record an admin action done outside the registry (pin, load, ...)."""
        if not isinstance(action, str) or not action or not isinstance(target, str):
            raise RegistryError("audit needs an action and a target")
        with self._db.write() as s:
            add_entry(s, actor, action, target, before, after)

    def audit_log(self, *, limit: int = 100, target: str | None = None) -> list[AuditEntry]:
        """Newest first; ``target`` matches the name itself and its ``name@revision`` entries."""
        if not isinstance(limit, int) or limit <= 0:
            raise RegistryError(f"limit must be a positive integer, got {limit!r}")
        q = select(AuditRow)
        if target is not None:
            q = q.where(
                (AuditRow.target == target)
                | AuditRow.target.startswith(target + "@", autoescape=True)
            )
        with self._db.read() as s:
            rows = s.execute(q.order_by(AuditRow.id.desc()).limit(limit)).scalars().all()
            return [
                AuditEntry(
                    r.id,
                    r.ts,
                    r.actor,
                    r.action,
                    r.target,
                    None if r.before is None else json.loads(r.before),
                    None if r.after is None else json.loads(r.after),
                )
                for r in rows
            ]
