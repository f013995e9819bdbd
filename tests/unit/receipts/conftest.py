"""Fixtures for the receipt tests: a real SQLite database (WAL) and, when reachable, PostgreSQL."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, event, text

from sandlot.receipts import (
    Decision,
    Ed25519Signer,
    ReceiptLog,
    TrustRoot,
    approval_entry,
    decision_entry,
    execution_entry,
    sha256_ref,
)
from sandlot.receipts.receipt import seal
from sandlot.receipts.schema import create_tables

PG_ADMIN_URL = os.environ.get(
    "SANDLOT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def sqlite_engine(path: Path) -> Engine:
    """A SQLite engine set up the way sandlot runs it: WAL, synchronous=NORMAL, busy wait."""
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    return engine


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "receipts.db"
    engine = sqlite_engine(path)
    create_tables(engine)
    engine.dispose()
    return path


@pytest.fixture
def engine(db_path: Path) -> Iterator[Engine]:
    engine = sqlite_engine(db_path)
    yield engine
    engine.dispose()


@pytest.fixture
def signer() -> Ed25519Signer:
    return Ed25519Signer.generate()


@pytest.fixture
def log(engine: Engine, signer: Ed25519Signer) -> Iterator[ReceiptLog]:
    log = ReceiptLog(engine, signer, log_id="test.example/receipts")
    yield log
    log.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    pytest.importorskip("psycopg", reason="needs psycopg (pip install 'psycopg[binary]')")
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"sandlot_receipts_{secrets.token_hex(4)}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
    except Exception as e:
        admin.dispose()
        pytest.skip(f"needs a PostgreSQL server at {PG_ADMIN_URL} ({type(e).__name__})")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def _decision(n=0, verdict=Decision.ALLOW, **kw):
    fields = {
        "op": "exec",
        "request_hash": sha256_ref(f"request {n}".encode()),
        "decision": verdict,
        "reason_code": "OK" if verdict is Decision.ALLOW else "POLICY_DENY",
        "sandbox_id": "sbx_test",
        "tenant": "default",
        "principal": "agent:test@default",
    }
    return decision_entry(**{**fields, **kw})


@pytest.fixture
def decision():
    """``decision(n, verdict)``: a decision entry about request number ``n``."""
    return _decision


@dataclass
class ExportedLog:
    """A log exported to files, as a verifier receives it."""

    lines: list[str]
    trust_root: TrustRoot
    checkpoint: str
    signer: Ed25519Signer  # the key current at the end (after the rotation)
    log_path: Path
    trust_path: Path
    checkpoint_path: Path

    def write(self, lines: list[str] | list[bytes]) -> Path:
        data = b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines)
        self.log_path.write_bytes(data)
        return self.log_path


@pytest.fixture
def exported(log, decision, tmp_path) -> ExportedLog:
    """A small log with every receipt type: decisions, executions, a HOLD and its approval,
    a key rotation; checkpointed at its end."""
    allow = log.append(decision(1))
    log.append(execution_entry(allow, output_hash=sha256_ref(b"out"), exit_code=0))
    log.append(decision(2, Decision.DENY))
    hold = log.append(decision(3, Decision.HOLD, reason_code="NEEDS_APPROVAL"))
    approved = log.append(approval_entry(hold, decision=Decision.ALLOW, principal="user:ana"))
    log.append(execution_entry(approved, exit_code=1))
    log.append_many([decision(n) for n in range(4, 9)])
    log.rotate(Ed25519Signer.generate())
    allow = log.append(decision(9))
    log.append(execution_entry(allow, exit_code=0))
    log.append(decision(10, Decision.DENY))
    note = log.checkpoint()
    ex = ExportedLog(
        lines=list(log.lines()),
        trust_root=log.export_trust_root(),
        checkpoint=note,
        signer=log.signer,
        log_path=tmp_path / "receipts.jsonl",
        trust_path=tmp_path / "trust-root.json",
        checkpoint_path=tmp_path / "checkpoint.txt",
    )
    ex.write(ex.lines)
    ex.trust_root.write(ex.trust_path)
    ex.checkpoint_path.write_text(note)
    return ex


def forge(body: dict, signer) -> str:
    """A receipt line with ``body`` signed by ``signer`` (what an attacker or a buggy writer
    holding ``signer`` could produce)."""
    return seal(body, [signer]).line


@pytest.fixture
def forge_line():
    return forge
