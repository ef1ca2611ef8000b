"""SQLAlchemy 2 ORM models of the registry and its engine set-up (SQLite embedded, PostgreSQL by
URL). The schema itself is created by the Alembic migrations in ``migrations/``; these models
mirror it (a test checks that a migrated database matches them).

Concurrency: every mutating transaction starts by bumping ``registry_state.generation``. On
PostgreSQL that row lock serialises writers across processes; on SQLite writers open their
transaction with ``BEGIN IMMEDIATE`` (one writer at a time, readers unblocked under WAL).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    text,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import StaticPool

from loraplex.config import ENV_HOME, ENV_REGISTRY_URL, env_value

ADAPTER_STATUSES = ("uploaded", "validated", "staged", "active", "deprecated", "disabled")

MIGRATIONS_DIR = Path(__file__).with_name("migrations")

_STATUS_CHECK = "status IN (" + ", ".join(f"'{s}'" for s in ADAPTER_STATUSES) + ")"


def loraplex_home() -> Path:
    """``$LORAPLEX_HOME`` or ``~/.local/share/loraplex`` (not created here)."""
    env = env_value(ENV_HOME)
    return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "loraplex"


def default_url() -> str:
    """``$LORAPLEX_REGISTRY_URL`` or the SQLite file ``<LORAPLEX_HOME>/registry.db``."""
    return env_value(ENV_REGISTRY_URL) or f"sqlite:///{loraplex_home() / 'registry.db'}"


class Base(DeclarativeBase):
    """Declarative base of the registry tables."""


class RegistryState(Base):
    """One row (id 1): the generation counter, bumped by every mutation."""

    __tablename__ = "registry_state"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class TenantRow(Base):
    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    max_waiting: Mapped[int | None] = mapped_column(Integer, nullable=True)
    rate_limit_rps: Mapped[float | None] = mapped_column(Float, nullable=True)
    host_bytes_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)


class ReleaseRow(Base):
    """A logical adapter name: its owner and which revisions serve (active, canary)."""

    __tablename__ = "releases"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("tenants.name"), nullable=True, index=True
    )
    active_revision: Mapped[str | None] = mapped_column(String(64), nullable=True)
    canary_revision: Mapped[str | None] = mapped_column(String(64), nullable=True)
    canary_weight: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    previous_revision: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)
    canary_policy: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object
    last_rollback: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object
    __table_args__ = (
        CheckConstraint("canary_weight >= 0 AND canary_weight <= 1", name="ck_canary_weight"),
    )


class RevisionRow(Base):
    """One adapter revision: the manifest."""

    __tablename__ = "adapter_revisions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), ForeignKey("releases.name"), nullable=False)
    revision: Mapped[str] = mapped_column(String(64), nullable=False)
    tenant: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    weights_sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    config_sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    base_model_name: Mapped[str] = mapped_column(String(256), nullable=False)
    base_model_digest: Mapped[str] = mapped_column(String(64), nullable=False)
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    alpha: Mapped[float] = mapped_column(Float, nullable=False)
    dtype: Mapped[str] = mapped_column(String(32), nullable=False)
    target_modules: Mapped[str] = mapped_column(Text, nullable=False)  # JSON list
    nbytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    source_uri: Mapped[str] = mapped_column(Text, nullable=False)
    path: Mapped[str] = mapped_column(Text, nullable=False)  # local directory validated
    priority: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    slo_class: Mapped[str | None] = mapped_column(String(64), nullable=True)
    warm_policy: Mapped[str] = mapped_column(String(32), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    activated_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    rollback_revision: Mapped[str | None] = mapped_column(String(64), nullable=True)
    signature: Mapped[str | None] = mapped_column(Text, nullable=True)
    signed_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    warm_schedule: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object
    # JSON list of token ids: an activated LoRA's invocation sequence (NULL: a standard LoRA)
    alora_invocation_tokens: Mapped[str | None] = mapped_column(Text, nullable=True)
    __table_args__ = (
        UniqueConstraint("name", "revision", name="uq_revision"),
        CheckConstraint(_STATUS_CHECK, name="ck_status"),
        Index("ix_revisions_sha256", "sha256"),
        # at most one active revision per name, enforced by the database itself
        Index(
            "uq_one_active",
            "name",
            unique=True,
            sqlite_where=text("status = 'active'"),
            postgresql_where=text("status = 'active'"),
        ),
    )


class ApiKeyRow(Base):
    """An API key: only the sha256 of the secret is stored."""

    __tablename__ = "api_keys"
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("tenants.name"), nullable=True, index=True
    )
    secret_sha256: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    scopes: Mapped[str] = mapped_column(Text, nullable=False)  # JSON list
    label: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    created_by: Mapped[str] = mapped_column(String(256), nullable=False)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AuditRow(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, nullable=False)
    actor: Mapped[str] = mapped_column(String(256), nullable=False)
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    target: Mapped[str] = mapped_column(String(256), nullable=False, index=True)
    before: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object
    after: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object


def make_engine(url: str) -> Engine:
    """An engine for ``url`` set up for the registry's concurrency rules.

    SQLite: ``sqlite://`` is one shared in-memory connection (StaticPool, usable from any
    thread); file databases use WAL and a busy timeout. pysqlite's own implicit transactions
    are turned off so that we emit ``BEGIN`` / ``BEGIN IMMEDIATE`` ourselves (writers ask for
    IMMEDIATE with the ``loraplex_write`` execution option; ``loraplex_read`` sessions run in
    autocommit).
    """
    u = make_url(url)
    kwargs: dict[str, Any] = {"future": True}
    if u.get_backend_name() == "sqlite":
        memory = u.database in (None, "", ":memory:")
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        if memory:
            kwargs["poolclass"] = StaticPool
        else:
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(u, **kwargs)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys = ON")
            cur.execute("PRAGMA busy_timeout = 30000")
            if not memory:
                _enable_wal(cur)
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            options = conn.get_execution_options()
            if options.get("loraplex_read"):
                return  # autocommit reads: every statement sees the latest commit
            conn.exec_driver_sql("BEGIN IMMEDIATE" if options.get("loraplex_write") else "BEGIN")

        return engine
    kwargs["pool_pre_ping"] = True
    return create_engine(u, **kwargs)


def _enable_wal(cur: Any, timeout_s: float = 30.0) -> None:
    """Switch a file database to WAL (persistent: a no-op once any process did it).

    Changing the journal mode needs an exclusive lock and SQLite answers "database is locked"
    at once, without its busy handler, while another process holds the file (two processes
    opening a fresh database together), so retry until ``timeout_s`` like the busy timeout.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


_migrate_lock = threading.Lock()


def run_migrations(engine: Engine) -> None:
    """Upgrade the database of ``engine`` to the newest schema (a no-op when it is current)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # two processes opening a fresh database at once: one migrates, the other waits for it and
    # then finds the schema current (SQLite: a write transaction; PostgreSQL: an advisory lock)
    with _migrate_lock, engine.connect() as plain:
        conn = plain.execution_options(loraplex_write=True)
        with conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7418275301)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision the database is at (None before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    """The newest Alembic revision shipped with this package."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head
