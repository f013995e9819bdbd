"""Databases the journal tests run on: SQLite always, PostgreSQL when a server answers on
127.0.0.1:5432 (each test gets its own database, dropped afterwards)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from sandlot.journal import Journal
from sandlot.store.migrate import upgrade
from sandlot.store.sql import open_engine


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = open_engine(db_url)
    upgrade(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def journal(engine: Engine) -> Journal:
    return Journal(engine, owner="worker-a", lease_seconds=30.0)
