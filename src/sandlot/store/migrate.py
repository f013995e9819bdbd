"""Bring a database to the current schema with Alembic, cheaply when it already is.

Every sandlot process opens the store, so the common case (schema current) must cost one tiny
query, not an Alembic import. Concurrent first opens are serialised by a lock (a file lock
beside a SQLite database, an advisory lock on PostgreSQL) so two processes never race to
create the same tables. This module must not import backends.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

__all__ = ["HEAD_REVISION", "upgrade"]

HEAD_REVISION = "0004"
"""The newest migration; a test checks it matches Alembic's head."""

_PG_LOCK_KEY = 0x5A4E_D107  # arbitrary, constant: the advisory lock id for migrations


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    try:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
    except SQLAlchemyError:
        return None
    return None if row is None else str(row[0])


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    if engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:"):
        lock_path = Path(str(engine.url.database) + ".migrate.lock")
        with open(lock_path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    elif engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
                conn.commit()
    else:
        yield


def upgrade(engine: Engine) -> None:
    """Migrate ``engine``'s database to :data:`HEAD_REVISION` if it is not there yet."""
    if current_revision(engine) == HEAD_REVISION:
        return
    with _migration_lock(engine):
        if current_revision(engine) == HEAD_REVISION:
            return
        from alembic import command  # slow import, needed only to migrate
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", "sandlot.store:migrations")
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
