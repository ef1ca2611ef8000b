"""Alembic environment of the registry: always run programmatically with an open connection
(``config.attributes["connection"]``, see :func:`loraplex.registry.db.run_migrations`)."""

from __future__ import annotations

from alembic import context

from loraplex.registry.db import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "the registry migrations run through loraplex.registry.db.run_migrations(engine) "
        "(Registry.open does it), not the alembic command line"
    )
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTER TABLE via copy
)
with context.begin_transaction():
    context.run_migrations()
