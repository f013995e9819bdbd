"""Journal cost per intent on SQLite and PostgreSQL (not a test: run it by hand).

    .venv/bin/python tests/integration/postgres/bench_journal.py [N]

Times the create path's journal steps, begin + authorize + allocating + allocated (four
transactions), sequentially for N intents, and an idempotent replay of begin; prints a table
with a baseline measured in the same run: one bare ``INSERT`` transaction on the same database.
PostgreSQL is skipped when no server answers on 127.0.0.1:5432.
"""

from __future__ import annotations

import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, text

from sandlot.journal import Journal, allocation_name
from sandlot.store.migrate import upgrade
from sandlot.store.sql import open_engine

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@contextmanager
def _databases() -> Iterator[list[tuple[str, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        dbs = [("sqlite (WAL)", f"sqlite:///{Path(tmp) / 'bench.db'}")]
        name = f"sandlot_bench_{secrets.token_hex(4)}"
        pg = False
        try:
            import psycopg

            with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            dbs.append(("postgresql", PG_ADMIN.rsplit("/", 1)[0] + "/" + name))
            pg = True
        except Exception as e:  # any failure means "no PostgreSQL here"
            print(f"postgresql skipped: {e}", file=sys.stderr)
        try:
            yield dbs
        finally:
            if pg:
                with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _time(n: int, step: Callable[[int], None]) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _bench(engine: Engine, n: int) -> dict[str, list[float]]:
    journal = Journal(engine, owner="bench")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_baseline (k VARCHAR(64) PRIMARY KEY)"))
    writer = engine.execution_options(sandlot_write=True)

    def baseline(i: int) -> None:
        with writer.begin() as conn:
            conn.execute(text("INSERT INTO bench_baseline VALUES (:k)"), {"k": f"{i}"})

    def create_path(i: int) -> None:
        begun = journal.begin(
            tenant="t",
            principal="p",
            op="sandbox.create",
            request={"image": "debian", "n": i},
            idempotency_key=f"key-{i}",
        )
        lease = journal.authorize(begun.intent.intent_id, decision=f"sha256:{i:064x}")
        lease = journal.allocating(
            lease, backend="local", name=allocation_name(begun.intent.intent_id)
        )
        journal.allocated(lease, provider_ref=f"ref-{i}")

    def replay(i: int) -> None:
        journal.begin(
            tenant="t",
            principal="p",
            op="sandbox.create",
            request={"image": "debian", "n": i},
            idempotency_key=f"key-{i}",
        )

    _time(20, lambda i: baseline(10_000_000 + i))  # warm the pool and the caches
    return {
        "bare INSERT txn (baseline)": _time(n, baseline),
        "begin+authorize+allocating+allocated": _time(n, create_path),
        "replay begin (same key)": _time(n, replay),
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    print(f"{'database':14} {'operation':40} {'p50 ms':>8} {'mean ms':>8} {'/s':>7}")
    with _databases() as dbs:
        for label, url in dbs:
            engine = open_engine(url)
            upgrade(engine)
            for op, samples in _bench(engine, n).items():
                mean = statistics.fmean(samples)
                p50 = statistics.median(samples)
                print(f"{label:14} {op:40} {p50:8.2f} {mean:8.2f} {1000 / mean:7.0f}")
            engine.dispose()


if __name__ == "__main__":
    main()
