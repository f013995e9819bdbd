"""Store implementations the contract suite runs against: SQLite always, PostgreSQL when a
server answers on 127.0.0.1:5432 (CI makes sure one does)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandlot.store.sql import SqlStore


@pytest.fixture
def store_url(db_url: str) -> str:
    """The store contract runs on every database ``db_url`` offers (tests/conftest.py)."""
    return db_url


@pytest.fixture
def store(store_url: str) -> Iterator[SqlStore]:
    s = SqlStore(store_url)
    yield s
    s.engine.dispose()
