"""Per-revision concurrency limits and canary health: ``adapter_revisions.max_concurrent_requests``,
``releases.canary_policy`` (JSON: the canary's health bounds and cap) and
``releases.last_rollback`` (JSON: the latest rollback of the release, for ``/v1/adapters``).

Revision ID: 0002_canary_limits
Revises: 0001_initial
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_canary_limits"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the three nullable columns (existing rows: no limit, no policy, no rollback)."""
    with op.batch_alter_table("adapter_revisions") as t:
        t.add_column(sa.Column("max_concurrent_requests", sa.Integer, nullable=True))
    with op.batch_alter_table("releases") as t:
        t.add_column(sa.Column("canary_policy", sa.Text, nullable=True))
        t.add_column(sa.Column("last_rollback", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("releases") as t:
        t.drop_column("last_rollback")
        t.drop_column("canary_policy")
    with op.batch_alter_table("adapter_revisions") as t:
        t.drop_column("max_concurrent_requests")
