"""Alembic environment: runs on the connection :func:`sandlot.store.migrate.upgrade` passes."""

from __future__ import annotations

from alembic import context

from sandlot.store.schema import load_all

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=load_all(),
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
