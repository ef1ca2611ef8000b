"""Between ORM rows and the registry's value types: conversions both ways and the row lookups
every store shares (each raises :class:`NotFoundError` naming what is missing)."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.registry.db import ReleaseRow, RevisionRow, TenantRow
from loraplex.registry.errors import NotFoundError
from loraplex.registry.records import CanaryPolicy, Manifest, Release, RollbackEvent, Tenant
from loraplex.warm import WarmSchedule, parse_warm

_MANIFEST_FIELDS = tuple(f.name for f in fields(Manifest))


def manifest_of(row: RevisionRow) -> Manifest:
    values = {f: getattr(row, f) for f in _MANIFEST_FIELDS}
    values["target_modules"] = tuple(json.loads(row.target_modules))
    values["warm_schedule"] = _schedule_of(row.warm_schedule)
    inv = row.alora_invocation_tokens
    values["alora_invocation_tokens"] = None if inv is None else tuple(json.loads(inv))
    return Manifest(**values)


def revision_row_of(m: Manifest) -> RevisionRow:
    values = {f: getattr(m, f) for f in _MANIFEST_FIELDS}
    values["target_modules"] = json.dumps(list(m.target_modules))
    ws = m.warm_schedule
    values["warm_schedule"] = None if ws is None else json.dumps(ws.to_dict(), sort_keys=True)
    inv = m.alora_invocation_tokens
    values["alora_invocation_tokens"] = None if inv is None else json.dumps(list(inv))
    return RevisionRow(**values)


def _schedule_of(text: str | None) -> WarmSchedule | None:
    """A stored ``warm_schedule`` column (JSON, written by :func:`revision_row_of`)."""
    if text is None:
        return None
    warm = parse_warm(json.loads(text), "warm_schedule")
    return warm if isinstance(warm, WarmSchedule) else None


def release_of(row: ReleaseRow) -> Release:
    values = {f.name: getattr(row, f.name) for f in fields(Release)}
    policy, event = row.canary_policy, row.last_rollback
    values["canary_policy"] = None if policy is None else CanaryPolicy(**json.loads(policy))
    values["last_rollback"] = None if event is None else RollbackEvent(**json.loads(event))
    return Release(**values)


def tenant_of(row: TenantRow) -> Tenant:
    return Tenant(**{f.name: getattr(row, f.name) for f in fields(Tenant)})


def release_state(row: ReleaseRow) -> dict[str, Any]:
    """A release's revisions, canary weight and policy (what its audit entries record)."""
    skip = ("name", "tenant", "last_rollback")
    return {k: v for k, v in asdict(release_of(row)).items() if k not in skip}


def release_row(s: Session, name: str, *, lock: bool = False) -> ReleaseRow:
    q = select(ReleaseRow).where(ReleaseRow.name == name)
    row = s.execute(q.with_for_update() if lock else q).scalar_one_or_none()
    if row is None:
        raise NotFoundError(f"unknown adapter {name!r}")
    return row


def revision_row(s: Session, name: str, revision: str) -> RevisionRow:
    row = s.execute(
        select(RevisionRow).where(RevisionRow.name == name, RevisionRow.revision == revision)
    ).scalar_one_or_none()
    if row is None:
        raise NotFoundError(f"adapter {name!r} has no revision {revision!r}")
    return row


def row_or_active(s: Session, rel: ReleaseRow, revision: str | None) -> RevisionRow:
    if revision is None:
        if rel.active_revision is None:
            raise NotFoundError(f"adapter {rel.name!r} has no active revision")
        revision = rel.active_revision
    return revision_row(s, rel.name, revision)
