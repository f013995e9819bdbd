"""PostgreSQL specifics: the migrated schema matches the table definitions there too, labels
are JSONB behind a GIN index that the store's label filter really uses, and records keep text
JSONB could not hold."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, event, insert, text

from sandlot.models import DeathCertificate, SandboxInfo, SandboxSpec, SandboxStatus, new_id
from sandlot.store.base import SandboxQuery
from sandlot.store.migrate import HEAD_REVISION, current_revision, upgrade
from sandlot.store.schema import load_all, sandboxes
from sandlot.store.sql import SqlStore, open_engine

pytestmark = pytest.mark.needs_postgres


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = open_engine(pg_url)
    yield eng
    eng.dispose()


def _alembic(engine: Engine, action: str, revision: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", "sandlot.store:migrations")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        getattr(command, action)(cfg, revision)


def test_migrated_schema_matches_table_definitions_on_postgresql(engine: Engine) -> None:
    upgrade(engine)
    assert current_revision(engine) == HEAD_REVISION
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), load_all()) == []
        types = dict(
            conn.execute(
                text(
                    "SELECT table_name || '.' || column_name, data_type "
                    "FROM information_schema.columns "
                    "WHERE table_name IN ('sandboxes', 'snapshots', 'exec_runs') "
                    "AND data_type IN ('json', 'jsonb')"
                )
            ).all()
        )
        index = conn.execute(
            text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_sandboxes_labels'")
        ).scalar_one()
    assert types == {
        "sandboxes.labels": "jsonb",
        "sandboxes.record": "json",
        "snapshots.record": "json",
        "exec_runs.result": "json",
        "exec_runs.error": "json",
    }
    assert "USING gin (labels jsonb_path_ops)" in index


def test_migration_0004_converts_existing_rows_and_reverses(engine: Engine) -> None:
    _alembic(engine, "upgrade", "0003")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sandboxes (id, tenant, backend, status, version, labels, record, "
                "created_at, updated_at, last_active_at, hidden) VALUES "
                "('sb-old', 't', 'fake', 'running', 0, CAST(:labels AS json), '{}', "
                "0, 0, 0, false)"
            ),
            {"labels": '{"team": "a"}'},
        )
    _alembic(engine, "upgrade", "head")
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT id FROM sandboxes WHERE labels @> CAST(:q AS jsonb)"),
            {"q": '{"team":"a"}'},
        ).scalars()
        assert list(found) == ["sb-old"]
    _alembic(engine, "downgrade", "0003")
    assert current_revision(engine) == "0003"
    with engine.connect() as conn:
        kind = conn.execute(
            text(
                "SELECT data_type FROM information_schema.columns "
                "WHERE table_name = 'sandboxes' AND column_name = 'labels'"
            )
        ).scalar_one()
        assert kind == "json"
        assert conn.execute(text("SELECT to_regclass('intents')")).scalar() is None
    upgrade(engine)
    assert current_revision(engine) == HEAD_REVISION


def _record(labels: dict[str, str], **fields: Any) -> SandboxInfo:
    return SandboxInfo(
        id=new_id("sb"),
        backend="fake",
        status=SandboxStatus.RUNNING,
        spec=SandboxSpec(labels=labels),
        **fields,
    )


async def test_label_filter_uses_the_gin_index(pg_url: str) -> None:
    store = SqlStore(pg_url)
    store.ensure_schema()
    # 50,000 filler rows (bare, straight into the table: the store never reads them back, as
    # no filter below matches them) and one real record to find.
    filler = [
        {
            "id": f"sb-{i:05d}",
            "tenant": "t",
            "backend": "fake",
            "status": "running",
            "version": 0,
            "labels": {"team": f"team-{i % 5000}", "env": "staging"},
            "record": {},
            "created_at": float(i),
            "updated_at": float(i),
            "last_active_at": float(i),
            "hidden": False,
        }
        for i in range(50_000)
    ]
    try:
        with store.engine.begin() as conn:
            conn.execute(insert(sandboxes), filler)
            conn.execute(text("ANALYZE sandboxes"))
        wanted = _record({"team": "team-7", "env": "prod"})
        await store.insert(wanted)

        statements: list[tuple[str, Any]] = []

        def capture(_c: object, _cur: object, stmt: str, params: Any, *_: object) -> None:
            statements.append((stmt, params))

        event.listen(store.engine, "before_cursor_execute", capture)
        found = await store.list(SandboxQuery(labels={"team": "team-7", "env": "prod"}))
        event.remove(store.engine, "before_cursor_execute", capture)
        assert [r.id for r in found] == [wanted.id]
        (stmt, params), *_ = statements
        assert "@>" in stmt

        def plan(conn: Any, *, seqscan: bool) -> str:
            conn.exec_driver_sql(f"SET enable_seqscan = {'on' if seqscan else 'off'}")
            return "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + stmt, params))

        with store.engine.connect() as conn:
            # The index serves the store's `@>` (sequential scans off), and at this size the
            # planner takes it by its own choice for a selective filter.
            assert "ix_sandboxes_labels" in plan(conn, seqscan=False)
            assert "ix_sandboxes_labels" in plan(conn, seqscan=True)
            conn.rollback()
    finally:
        await store.aclose()


async def test_records_keep_text_jsonb_could_not_hold(pg_url: str) -> None:
    """A record stays JSON, not JSONB: output with a NUL character must not break a write."""
    store = SqlStore(pg_url)
    try:
        died = _record({"a": "1"})
        died.death = DeathCertificate(cause="exited", last_output=["binary \x00 output"])
        await store.insert(died)
        got = await store.get(died.id)
        assert got.death is not None
        assert got.death.last_output == ["binary \x00 output"]
    finally:
        await store.aclose()
