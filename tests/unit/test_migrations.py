"""Migrations and table definitions agree, and the fast path knows the newest revision."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from sandlot.store.migrate import HEAD_REVISION, current_revision, upgrade
from sandlot.store.schema import load_all
from sandlot.store.sql import open_engine


def test_head_revision_constant_matches_alembic() -> None:
    cfg = Config()
    cfg.set_main_option("script_location", "sandlot.store:migrations")
    assert ScriptDirectory.from_config(cfg).get_heads() == [HEAD_REVISION]


def test_migrated_schema_matches_table_definitions(tmp_path: Path) -> None:
    engine = open_engine(f"sqlite:///{tmp_path / 'm.db'}")
    upgrade(engine)
    assert current_revision(engine) == HEAD_REVISION
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), load_all())
    assert diffs == []
    engine.dispose()
