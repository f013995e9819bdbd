"""Which databases sandlot accepts, how it opens one, and what it says when it cannot.

A database is named by a URL (``sqlite:///PATH``, ``postgresql://USER@HOST/DB``) or a SQLite
file path. Everything that can go wrong reaching it — a server that is down, a database or
role that does not exist, a file that cannot be created, PostgreSQL support not installed —
becomes one :class:`~sandlot.errors.SandboxError` whose one-line message names the fix:
``BackendUnavailable`` when the database cannot be reached or used on this host right now,
``InvalidRequest`` when what was asked for cannot work as given. A URL's password never
appears in a message (:func:`redact_url`). This module must not import backends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DataError,
    DBAPIError,
    IntegrityError,
    NotSupportedError,
    ProgrammingError,
)

from sandlot.errors import BackendUnavailable, InvalidRequest, SandboxError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

__all__ = [
    "SQLITE_SUFFIXES",
    "check_database",
    "database_error",
    "database_errors",
    "open_engine",
    "parse_database",
    "redact_url",
]

SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
"""The file names a bare path may end in to be taken as a SQLite database."""

_SQLITE_SCHEMES = frozenset({"sqlite", "sqlite+pysqlite"})
_POSTGRES_SCHEMES = frozenset({"postgresql", "postgres", "postgresql+psycopg"})
_FORMS = (
    "sqlite:///PATH, postgresql://USER@HOST:PORT/DATABASE, "
    "or a SQLite file path ending in .db, .sqlite or .sqlite3"
)
_CONNECT_TIMEOUT = 10
"""Seconds a PostgreSQL connection attempt may take (unless the URL says otherwise): an
address that drops packets fails in seconds rather than after the kernel's TCP timeout."""
_INSTALL_POSTGRES = "pip install 'sandlot[postgres]'"


def redact_url(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` parameter) as ``***``."""
    try:
        redacted = make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError, TypeError):
        # Not parseable as a URL: hide whatever sits between "user:" and "@".
        redacted = re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", redacted)


def parse_database(value: str) -> str:
    """The SQLAlchemy URL for a ``--database`` value: a URL, or a SQLite file path.

    A bare path must name an existing file or end in one of :data:`SQLITE_SUFFIXES`, so a
    mistyped URL (``postgres:/db``, ``garbage``) is refused instead of quietly becoming a new
    database file in the current directory; ``sqlite:///PATH`` takes any file name.

    Raises:
        InvalidRequest: ``value`` is none of the accepted forms, or a URL of a database sandlot
            does not support.
    """
    if "://" in value:
        normalize_url(value)
        return value
    if not value.strip():
        msg = f"the database is empty; use {_FORMS}"
        raise InvalidRequest(msg)
    path = Path(value).expanduser().absolute()
    if path.is_dir():
        msg = f"database {value!r} is a directory; name a file in it, such as {path / 'sandlot.db'}"
        raise InvalidRequest(msg)
    if not path.is_file() and path.suffix not in SQLITE_SUFFIXES:
        msg = f"database {redact_url(value)!r} is neither a URL nor a SQLite file; use {_FORMS}"
        raise InvalidRequest(msg)
    return f"sqlite:///{path}"


def normalize_url(url: str) -> URL:
    """``url`` parsed, with the driver sandlot uses for it (psycopg 3 for PostgreSQL).

    Raises:
        InvalidRequest: ``url`` cannot be parsed or names a database sandlot does not support.
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as e:
        msg = f"database URL {redact_url(url)!r} is malformed ({e}); use {_FORMS}"
        raise InvalidRequest(msg) from None
    if parsed.drivername in _SQLITE_SCHEMES:
        return parsed
    if parsed.drivername in _POSTGRES_SCHEMES:
        return parsed.set(drivername="postgresql+psycopg")
    msg = (
        f"unsupported database URL scheme {parsed.drivername + '://'!r}: sandlot stores its "
        f"records in SQLite (sqlite:///PATH) or PostgreSQL (postgresql://…, postgres://…, "
        "postgresql+psycopg://…)"
    )
    raise InvalidRequest(msg)


def open_engine(url: str) -> Engine:
    """An engine for ``url`` with the settings sandlot relies on.

    SQLite gets WAL (readers never block the writer), ``synchronous=NORMAL`` (durable across
    process crashes, which is the failure we guard against), a long busy timeout so that
    concurrent writers queue instead of failing, and ``BEGIN IMMEDIATE`` so a read-then-write
    transaction takes the write lock up front rather than failing at commit (only for
    connections from the writer, see :class:`~sandlot.store.sql.SqlStore`; readers stay
    deferred and concurrent). PostgreSQL goes through psycopg 3 with a connect timeout.

    Nothing is connected yet: a database that cannot be reached fails at first use (see
    :func:`database_errors`).

    Raises:
        InvalidRequest: ``url`` is not a database URL sandlot supports.
        BackendUnavailable: PostgreSQL support (psycopg) is not installed.
    """
    parsed = normalize_url(url)
    if parsed.drivername in _SQLITE_SCHEMES:
        engine = create_engine(parsed, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:  # noqa: ANN401 - DB-API objects are untyped
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            write = conn.get_execution_options().get("sandlot_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine
    connect_args = (
        {} if "connect_timeout" in parsed.query else {"connect_timeout": _CONNECT_TIMEOUT}
    )
    try:
        return create_engine(
            parsed, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args=connect_args
        )
    except ImportError as e:
        # SQLAlchemy imports the driver when the engine is made. psycopg installed without a
        # libpq it can load raises ImportError too, with a name of None.
        why = "" if e.name else f" ({_one_line(str(e))})"
        msg = f"PostgreSQL support is not installed: {_INSTALL_POSTGRES}{why}"
        raise BackendUnavailable(msg) from e


def check_database(url: str) -> None:
    """Connect to ``url`` and run one query; raise what a user of it would see if that fails."""
    engine = open_engine(url)
    try:
        with database_errors(engine), engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()


@contextlib.contextmanager
def database_errors(engine: Engine) -> Iterator[None]:
    """Turn a driver's failure to reach or use ``engine``'s database into a sandlot error.

    Sandlot's own errors pass through unchanged, and so do errors that are about the statement
    rather than the database (a constraint, bad SQL, a bad value): their callers handle them.
    """
    try:
        yield
    except (IntegrityError, ProgrammingError, DataError, NotSupportedError):
        raise
    except DBAPIError as e:
        raise database_error(engine.url, e.orig if e.orig is not None else e) from e


def database_error(url: URL, error: BaseException) -> SandboxError:
    """The sandlot error for a driver's ``error`` on the database at ``url`` (for SQLite, an
    ``OSError`` on a file beside the database counts as one on the database)."""
    if url.get_backend_name() == "sqlite":
        return _sqlite_error(url, error)
    return _postgres_error(url, error)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _postgres_error(url: URL, error: BaseException) -> SandboxError:
    socket_dir = url.query.get("host")
    host = url.host or (socket_dir if isinstance(socket_dir, str) else None) or "localhost"
    where = f"{host}:{url.port or 5432}"
    said = _one_line(str(error))
    if url.password:
        said = said.replace(url.password, "***")
    # libpq's client-side messages have no SQLSTATE; the server's FATAL lines do not reach us
    # with one either. These phrases are libpq's and the server's, stable across versions.
    if m := re.search(r'database "([^"]+)" does not exist', said):
        name = m.group(1)
        msg = (
            f"PostgreSQL at {where} has no database {name!r}; create it "
            f"(createdb -h {host} -p {url.port or 5432} {name}) or name another in the URL"
        )
        return InvalidRequest(msg)
    if m := re.search(r'role "([^"]+)" does not exist', said):
        msg = f"PostgreSQL at {where} has no role {m.group(1)!r}; create it or name another user in the URL"
        return InvalidRequest(msg)
    if re.search(r"password authentication failed|no password supplied", said, re.I):
        who = url.username or "the default user"
        msg = f"PostgreSQL at {where} refused the password for {who}; check the user and password in the URL"
        return InvalidRequest(msg)
    if "no pg_hba.conf entry" in said:
        who = url.username or "the default user"
        msg = f"PostgreSQL at {where} does not let {who} connect from here (no pg_hba.conf entry); allow it there or use another user"
        return InvalidRequest(msg)
    if re.search(r"connection refused", said, re.I):
        msg = f"cannot reach PostgreSQL at {where} (connection refused); is the server running?"
        return BackendUnavailable(msg)
    if re.search(r"timeout expired|timed out", said, re.I):
        msg = f"cannot reach PostgreSQL at {where} (no answer in time); is the server running and the address right?"
        return BackendUnavailable(msg)
    if re.search(r"failed to resolve host|could not translate host name", said, re.I):
        msg = (
            f"cannot reach PostgreSQL at {where} (unknown host {host!r}); check the host in the URL"
        )
        return BackendUnavailable(msg)
    if re.search(r'socket "[^"]*" failed: No such file or directory', said):
        msg = f"cannot reach PostgreSQL at {where} (no server socket there); is the server running?"
        return BackendUnavailable(msg)
    if re.search(r"starting up|shutting down|too many clients|in recovery mode", said):
        msg = f"PostgreSQL at {where} is not accepting connections now ({said.removeprefix('connection failed: ')}); try again later"
        return BackendUnavailable(msg)
    return BackendUnavailable(f"database error (PostgreSQL at {where}): {said}")


def _sqlite_error(url: URL, error: BaseException) -> SandboxError:
    database = url.database
    if not database or database == ":memory:":
        return BackendUnavailable(f"database error (SQLite in memory): {_one_line(str(error))}")
    path = Path(database).absolute()
    said = _one_line(str(error))
    fix = "choose another path with --database or SANDLOT_DATABASE_URL"
    if "file is not a database" in said:
        return InvalidRequest(f"{path} is not a SQLite database; {fix}")
    if "readonly database" in said:
        return InvalidRequest(f"the SQLite database {path} is read-only; make it writable or {fix}")
    if "unable to open database file" in said or isinstance(error, OSError):
        return InvalidRequest(
            f"cannot open the SQLite database {path}: {_why_unopenable(path)}; {fix}"
        )
    return BackendUnavailable(f"database error (SQLite {path}): {said}")


def _why_unopenable(path: Path) -> str:
    """Why SQLite could not open (or create) ``path``, and the journal files beside it."""
    parent = path.parent
    if path.is_dir():
        return "it is a directory"
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"directory {parent} is not writable (SQLite keeps its journal beside the file)"
    existed = path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{parent} does not accept new files ({e.strerror})"
        if e.errno == errno.ENOENT:
            return f"{parent} does not accept new files"
        return e.strerror or str(e)
    os.close(fd)
    if not existed:
        with contextlib.suppress(OSError):
            path.unlink()
    return "SQLite could not open it there"
