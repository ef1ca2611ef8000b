"""Initial registry schema: state, tenants, releases, adapter revisions, API keys, audit log.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

_STATUSES = ("uploaded", "validated", "staged", "active", "deprecated", "disabled")


def upgrade() -> None:
    """Create every table; insert the generation row."""
    state = op.create_table(
        "registry_state",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("generation", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(state, [{"id": 1, "generation": 0}])
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("max_waiting", sa.Integer, nullable=True),
        sa.Column("rate_limit_rps", sa.Float, nullable=True),
        sa.Column("host_bytes_budget", sa.BigInteger, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "releases",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.name"), nullable=True),
        sa.Column("active_revision", sa.String(64), nullable=True),
        sa.Column("canary_revision", sa.String(64), nullable=True),
        sa.Column("canary_weight", sa.Float, nullable=False),
        sa.Column("previous_revision", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.CheckConstraint("canary_weight >= 0 AND canary_weight <= 1", name="ck_canary_weight"),
    )
    op.create_index("ix_releases_tenant", "releases", ["tenant"])
    op.create_table(
        "adapter_revisions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), sa.ForeignKey("releases.name"), nullable=False),
        sa.Column("revision", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("weights_sha256", sa.String(64), nullable=False),
        sa.Column("config_sha256", sa.String(64), nullable=False),
        sa.Column("base_model_name", sa.String(256), nullable=False),
        sa.Column("base_model_digest", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("alpha", sa.Float, nullable=False),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("target_modules", sa.Text, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("source_uri", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("slo_class", sa.String(64), nullable=True),
        sa.Column("warm_policy", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("activated_at", sa.Float, nullable=True),
        sa.Column("rollback_revision", sa.String(64), nullable=True),
        sa.Column("signature", sa.Text, nullable=True),
        sa.Column("signed_by", sa.String(128), nullable=True),
        sa.UniqueConstraint("name", "revision", name="uq_revision"),
        sa.CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in _STATUSES) + ")", name="ck_status"
        ),
    )
    op.create_index("ix_revisions_sha256", "adapter_revisions", ["sha256"])
    op.create_index(
        "uq_one_active",
        "adapter_revisions",
        ["name"],
        unique=True,
        sqlite_where=sa.text("status = 'active'"),
        postgresql_where=sa.text("status = 'active'"),
    )
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.name"), nullable=True),
        sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.Text, nullable=False),
        sa.Column("label", sa.String(256), nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("created_by", sa.String(256), nullable=False),
        sa.Column("revoked_at", sa.Float, nullable=True),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(256), nullable=False),
        sa.Column("before", sa.Text, nullable=True),
        sa.Column("after", sa.Text, nullable=True),
    )
    op.create_index("ix_audit_log_target", "audit_log", ["target"])


def downgrade() -> None:
    """Drop every table."""
    for index, table in (
        ("ix_audit_log_target", "audit_log"),
        ("ix_api_keys_tenant", "api_keys"),
        ("uq_one_active", "adapter_revisions"),
        ("ix_revisions_sha256", "adapter_revisions"),
        ("ix_releases_tenant", "releases"),
    ):
        op.drop_index(index, table_name=table)
    for table in ("audit_log", "api_keys", "adapter_revisions", "releases", "tenants"):
        op.drop_table(table)
    op.drop_table("registry_state")
