"""Releases: which revision of a name serves. Lookups of a name's release, and the lifecycle
moves (stage, promote, activate, canary, rollback, disable), each one transaction that checks
every status change against :mod:`loraplex.registry.lifecycle` and writes its audit entry.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.registry.audit import add_entry
from loraplex.registry.db import ReleaseRow, RevisionRow
from loraplex.registry.errors import RegistryError, TransitionError
from loraplex.registry.lifecycle import check_transition
from loraplex.registry.records import CanaryPolicy, Manifest, Release, RollbackEvent
from loraplex.registry.rows import (
    manifest_of,
    release_of,
    release_row,
    release_state,
    revision_row,
    row_or_active,
)
from loraplex.registry.sessions import Database


class Releases:
    """A name's active, canary and previous revisions, and the moves between them."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def release(self, name: str) -> Release:
        with self._db.read() as s:
            return release_of(release_row(s, name))

    def visible(self, *, tenant: str | None) -> list[Release]:
        """Releases with an active revision that ``tenant`` may see (its own and shared)."""
        q = select(ReleaseRow).where(ReleaseRow.active_revision.is_not(None))
        if tenant is not None:
            q = q.where((ReleaseRow.tenant == tenant) | ReleaseRow.tenant.is_(None))
        with self._db.read() as s:
            return [release_of(r) for r in s.execute(q.order_by(ReleaseRow.name)).scalars()]

    def stage(self, name: str, revision: str, *, actor: str) -> Manifest:
        """validated (or disabled, to re-enable) -> staged."""
        with self._db.write() as s:
            release_row(s, name, lock=True)
            row = revision_row(s, name, revision)
            before = row.status
            check_transition(before, "staged", f"{name}@{revision}")
            row.status = "staged"
            s.flush()
            add_entry(
                s, actor, "stage", f"{name}@{revision}", {"status": before}, {"status": "staged"}
            )
            return manifest_of(row)

    def promote(self, name: str, revision: str | None = None, *, actor: str) -> Release:
        """Make ``revision`` (default: the canary) the active one. The old active revision
        becomes ``deprecated`` and is remembered as previous / the new one's rollback target;
        the canary is cleared."""
        return self._promote(name, revision, actor=actor, reenable=False)

    def activate(self, name: str, revision: str, *, actor: str) -> Release:
        """Make ``revision`` active from any status, walking the table in one transaction
        (disabled -> staged -> active re-enables it); a no-op when it is already active.
        For "load this adapter now" callers (vLLM's load after unload of the same files)."""
        return self._promote(name, revision, actor=actor, reenable=True)

    def _promote(self, name: str, revision: str | None, *, actor: str, reenable: bool) -> Release:
        with self._db.write() as s:
            rel = release_row(s, name, lock=True)
            before = release_state(rel)
            if revision is None:
                if rel.canary_revision is None:
                    raise TransitionError(
                        f"adapter {name!r} has no canary to promote; name a revision"
                    )
                revision = rel.canary_revision
            row = revision_row(s, name, revision)
            target = f"{name}@{revision}"
            if reenable and row.status == "active":
                return release_of(rel)
            if row.status == "validated" or (reenable and row.status == "disabled"):
                check_transition(row.status, "staged", target)  # ... -> staged -> active
                row.status = "staged"
            check_transition(row.status, "active", target)
            old_rev = rel.active_revision
            if old_rev is not None:
                old = revision_row(s, name, old_rev)
                check_transition(old.status, "deprecated", f"{name}@{old_rev}")
                old.status = "deprecated"
                s.flush()  # the one-active index must never see two
            now = time.time()
            row.status = "active"
            row.activated_at = now
            row.rollback_revision = old_rev
            rel.active_revision = revision
            rel.previous_revision = old_rev
            rel.canary_revision = None
            rel.canary_weight = 0.0
            rel.canary_policy = None
            rel.updated_at = now
            s.flush()
            add_entry(s, actor, "promote", name, before, release_state(rel))
            return release_of(rel)

    def canary(
        self,
        name: str,
        revision: str,
        weight: float,
        *,
        actor: str,
        policy: CanaryPolicy | None = None,
    ) -> Release:
        """Send a ``weight`` share of ``name``'s traffic to the staged ``revision``; ``policy``:
        its health bounds and concurrency cap (None: no automatic rollback)."""
        if policy is not None and not isinstance(policy, CanaryPolicy):
            raise RegistryError(f"policy must be a CanaryPolicy, got {type(policy).__name__}")
        if (
            not isinstance(weight, (int, float))
            or isinstance(weight, bool)
            or not math.isfinite(weight)
            or not 0.0 <= weight <= 1.0
        ):
            raise RegistryError(f"canary weight must be a number in [0, 1], got {weight!r}")
        with self._db.write() as s:
            rel = release_row(s, name, lock=True)
            before = release_state(rel)
            if rel.active_revision is None:
                raise TransitionError(
                    f"adapter {name!r} has no active revision to split traffic with; promote first"
                )
            if revision == rel.active_revision:
                raise TransitionError(f"{name}@{revision} is the active revision, not a canary")
            row = revision_row(s, name, revision)
            target = f"{name}@{revision}"
            if row.status == "validated":
                check_transition("validated", "staged", target)
                row.status = "staged"
            if row.status != "staged":
                raise TransitionError(
                    f"{target}: a canary must be staged (or validated), it is {row.status}"
                )
            rel.canary_revision = revision
            rel.canary_weight = float(weight)
            rel.canary_policy = None if policy is None else json.dumps(policy.to_dict())
            rel.updated_at = time.time()
            s.flush()
            add_entry(s, actor, "canary", name, before, release_state(rel))
            return release_of(rel)

    def rollback(self, name: str, *, actor: str, reason: str = "manual") -> Release:
        """While a canary runs: stop it (the canary revision is disabled, the active one keeps
        all traffic). Otherwise disable the active revision and re-activate the previous one at
        once. The new previous is the restored revision's own rollback target. ``reason`` is
        recorded in the audit entry and as the release's latest rollback."""
        reason = _check_reason(reason)
        with self._db.write() as s:
            rel = release_row(s, name, lock=True)
            before = release_state(rel)
            if rel.canary_revision is not None:
                return self._stop_canary(s, rel, before, actor=actor, reason=reason)
            if rel.active_revision is None:
                raise TransitionError(f"adapter {name!r} has no active revision to roll back")
            if rel.previous_revision is None:
                raise TransitionError(f"adapter {name!r} has no previous revision to roll back to")
            cur = revision_row(s, name, rel.active_revision)
            prev = revision_row(s, name, rel.previous_revision)
            check_transition(cur.status, "disabled", f"{name}@{cur.revision}")
            check_transition(prev.status, "active", f"{name}@{prev.revision}")
            cur.status = "disabled"
            s.flush()
            now = time.time()
            prev.status = "active"
            prev.activated_at = now
            back = prev.rollback_revision
            if back is not None:
                back_row = s.execute(
                    select(RevisionRow).where(
                        RevisionRow.name == name, RevisionRow.revision == back
                    )
                ).scalar_one_or_none()
                if back_row is None or back_row.status != "deprecated":
                    back = None
            rel.active_revision = prev.revision
            rel.previous_revision = back
            rel.canary_revision = None
            rel.canary_weight = 0.0
            rel.canary_policy = None
            rel.updated_at = now
            rel.last_rollback = _event(cur.revision, actor, reason, now)
            s.flush()
            add_entry(s, actor, "rollback", name, before, {**release_state(rel), "reason": reason})
            return release_of(rel)

    def rollback_canary(
        self, name: str, revision: str, *, actor: str, reason: str
    ) -> Release | None:
        """Stop the canary ``revision`` of ``name`` if it still is the canary (disabled, the
        active revision keeps all traffic); None when it no longer is (already rolled back,
        promoted or replaced: nothing is written). Idempotent, so replicas that judge the same
        canary unhealthy at once stop it exactly once, and never roll back the active one."""
        reason = _check_reason(reason)
        with self._db.write() as s:
            rel = release_row(s, name, lock=True)
            if rel.canary_revision != revision:
                return None
            before = release_state(rel)
            return self._stop_canary(s, rel, before, actor=actor, reason=reason)

    @staticmethod
    def _stop_canary(
        s: Session, rel: ReleaseRow, before: dict, *, actor: str, reason: str
    ) -> Release:
        name = rel.name
        assert rel.canary_revision is not None
        canary = revision_row(s, name, rel.canary_revision)
        check_transition(canary.status, "disabled", f"{name}@{canary.revision}")
        canary.status = "disabled"
        now = time.time()
        rel.canary_revision, rel.canary_weight, rel.canary_policy = None, 0.0, None
        rel.updated_at = now
        rel.last_rollback = _event(canary.revision, actor, reason, now)
        s.flush()
        add_entry(s, actor, "rollback", name, before, {**release_state(rel), "reason": reason})
        return release_of(rel)

    def disable(self, name: str, revision: str | None = None, *, actor: str) -> Manifest:
        """Stop a revision (default: the active one) from serving; ``stage`` re-enables it."""
        with self._db.write() as s:
            rel = release_row(s, name, lock=True)
            row = row_or_active(s, rel, revision)
            target = f"{name}@{row.revision}"
            before = {"status": row.status, **release_state(rel)}
            check_transition(row.status, "disabled", target)
            row.status = "disabled"
            if rel.active_revision == row.revision:
                rel.active_revision = None
            if rel.canary_revision == row.revision:
                rel.canary_revision, rel.canary_weight, rel.canary_policy = None, 0.0, None
            if rel.previous_revision == row.revision:
                rel.previous_revision = None
            rel.updated_at = time.time()
            s.flush()
            add_entry(
                s, actor, "disable", target, before, {"status": "disabled", **release_state(rel)}
            )
            return manifest_of(row)


def _check_reason(reason: str) -> str:
    if not isinstance(reason, str) or not 0 < len(reason) <= 500:
        raise RegistryError("a rollback reason must be a non-empty string of at most 500 chars")
    return reason


def _event(revision: str, actor: str, reason: str, at: float) -> str:
    return json.dumps(asdict(RollbackEvent(revision, actor, reason, at)), sort_keys=True)
