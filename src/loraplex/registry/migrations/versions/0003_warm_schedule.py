"""Warm windows: ``adapter_revisions.warm_schedule`` (JSON: the revision's window schedule,
``{"device": "Mon-Fri 08:00-18:00", "tz": "Europe/Berlin"}``; ``warm_policy`` stays the
String(32) policy).

Revision ID: 0003_warm_schedule
Revises: 0002_canary_limits
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_warm_schedule"
down_revision = "0002_canary_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the nullable column (existing rows: no schedule, their warm_policy only)."""
    with op.batch_alter_table("adapter_revisions") as t:
        t.add_column(sa.Column("warm_schedule", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_revisions") as t:
        t.drop_column("warm_schedule")
