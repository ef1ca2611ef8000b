"""Activated LoRA: ``adapter_revisions.alora_invocation_tokens`` (JSON list of token ids; NULL
for a standard LoRA), read from the adapter's config at registration.

Revision ID: 0004_alora_invocation
Revises: 0003_warm_schedule
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_alora_invocation"
down_revision = "0003_warm_schedule"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the nullable column (existing rows: standard LoRAs; an aLoRA was refused before)."""
    with op.batch_alter_table("adapter_revisions") as t:
        t.add_column(sa.Column("alora_invocation_tokens", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_revisions") as t:
        t.drop_column("alora_invocation_tokens")
