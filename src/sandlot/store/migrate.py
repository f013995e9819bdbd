"""Bring a database to the current schema with Alembic, cheaply when it already is.

Every sandlot process opens the store, so the common case (schema current) must cost one tiny
query, not an Alembic import. Concurrent first opens are serialised by a lock (a file lock
beside a SQLite database, an advisory lock on PostgreSQL) so two processes never race to
create the same tables. A database that cannot be reached, opened or locked raises the
sandlot error :mod:`sandlot.store.connect` makes of it. This module must not import backends.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from sandlot.store.connect import database_error, database_errors

__all__ = ["HEAD_REVISION", "upgrade"]

HEAD_REVISION = "0004"
"""The newest migration; a test checks it matches Alembic's head."""

_PG_LOCK_KEY = 0x5A4E_D107  # arbitrary, constant: the advisory lock id for migrations


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database.

    A database that cannot be reached raises (the driver's error): only a missing
    ``alembic_version`` table means "empty".
    """
    with engine.connect() as conn:
        try:
            row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
        except DBAPIError as e:
            # SQLite says "no such table: alembic_version", PostgreSQL 'relation
            # "alembic_version" does not exist'; anything else is a real failure.
            if "alembic_version" not in str(e.orig):
                raise
            return None
    return None if row is None else str(row[0])


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    if engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:"):
        lock_path = Path(str(engine.url.database) + ".migrate.lock")
        try:
            f = open(lock_path, "w")  # noqa: SIM115 - closed by the with below
        except OSError as e:
            raise database_error(engine.url, e) from e
        with f:
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
    """Migrate ``engine``'s database to :data:`HEAD_REVISION` if it is not there yet.

    Raises:
        BackendUnavailable: The database cannot be reached (or PostgreSQL support is missing).
        InvalidRequest: The database named cannot work as given (no such database or role, a
            SQLite file that cannot be created or is not a database).
    """
    with database_errors(engine):
        _upgrade(engine)


def _upgrade(engine: Engine) -> None:
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
