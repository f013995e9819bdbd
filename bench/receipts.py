"""Receipt log throughput: signed appends (single and batched) and offline verification.

Each row is measured in this run next to a plain-Python baseline doing the same bookkeeping
without signatures (the same body through ``json.dumps`` + ``hashlib.sha256`` + a raw
``sqlite3`` INSERT, WAL, synchronous=NORMAL), so the ratio says what signing, canonical JSON and
SQLAlchemy cost. Usage::

    .venv/bin/python bench/receipts.py            # 100,000-receipt verification
    .venv/bin/python bench/receipts.py --quick    # 10,000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, event

from sandlot.receipts import (
    Decision,
    Ed25519Signer,
    PolicyRef,
    ReceiptLog,
    decision_entry,
    prove,
    sha256_ref,
    verify_files,
    verify_proof,
)
from sandlot.receipts.schema import create_tables

POLICY = PolicyRef(engine="cedar", policy_hash=sha256_ref(b"policy"), matched=("deny-rm-rf-root",))


def entry(n: int):
    return decision_entry(
        op="exec",
        request_hash=sha256_ref(f"request {n}".encode()),
        decision=Decision.DENY if n % 3 == 0 else Decision.ALLOW,
        reason_code="POLICY_DENY" if n % 3 == 0 else "OK",
        policy=POLICY,
        tenant="default",
        principal="agent:bench@default",
        sandbox_id="sbx_0123456789abcdef",
    )


def engine_for(path: Path):
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _pragmas(conn, _record):
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")

    create_tables(engine)
    return engine


def baseline_appends(path: Path, n: int, batch: int) -> float:
    """Plain Python: the same body, json.dumps + sha256 + raw sqlite3 INSERT; no signature."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute(
        "CREATE TABLE IF NOT EXISTS r (seq INTEGER PRIMARY KEY, entry_hash TEXT UNIQUE,"
        " prev_hash TEXT, body TEXT)"
    )
    prev = "sha256:" + "0" * 64
    start = time.perf_counter()
    for first in range(0, n, batch):
        rows = []
        for seq in range(first + 1, min(first + batch, n) + 1):
            e = entry(seq)
            body = e.fields() | {"seq": seq, "lamport": seq, "prev_hash": prev}
            payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            prev = "sha256:" + hashlib.sha256(payload).hexdigest()
            rows.append((seq, prev, body["prev_hash"], payload.decode()))
        con.execute("BEGIN")
        con.executemany("INSERT INTO r VALUES (?, ?, ?, ?)", rows)
        con.execute("COMMIT")
    elapsed = time.perf_counter() - start
    con.close()
    return elapsed


def signed_appends(log: ReceiptLog, n: int, batch: int, offset: int) -> float:
    start = time.perf_counter()
    if batch == 1:
        for i in range(n):
            log.append(entry(offset + i))
    else:
        for first in range(0, n, batch):
            log.append_many([entry(offset + i) for i in range(first, min(first + batch, n))])
    return time.perf_counter() - start


def baseline_verify(path: Path) -> float:
    """Plain Python: read each line, parse it, hash the payload, check the prev link by seq."""
    start = time.perf_counter()
    with open(path, "rb") as f:
        for line in f:
            envelope = json.loads(line)
            hashlib.sha256(envelope["payload"].encode()).hexdigest()
    return time.perf_counter() - start


def row(name: str, count: int, seconds: float, base: float | None = None) -> str:
    per_s = count / seconds
    ratio = f"{seconds / base:6.1f}x" if base else "      "
    return f"| {name:<46} | {count:>8,} | {per_s:>10,.0f}/s | {seconds / count * 1e6:>8.1f} µs | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="verify 10,000 receipts, not 100,000")
    args = parser.parse_args()
    n_single, n_batch = (2_000, 10_000) if args.quick else (5_000, 20_000)
    n_verify = 10_000 if args.quick else 100_000

    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        signer = Ed25519Signer.generate()
        lines = [
            "| what                                           |    count |   throughput |   per op   | vs base |",
            "|------------------------------------------------|---------:|-------------:|-----------:|--------:|",
        ]

        base1 = baseline_appends(tmpdir / "base1.db", n_single, 1)
        lines.append(row("baseline append (json+sha256+sqlite3), 1/tx", n_single, base1))
        log = ReceiptLog(engine_for(tmpdir / "single.db"), signer)
        t = signed_appends(log, n_single, 1, 0)
        lines.append(row("signed decision receipt append, 1/tx", n_single, t, base1))

        base100 = baseline_appends(tmpdir / "base100.db", n_batch, 100)
        lines.append(row("baseline append, 100/tx", n_batch, base100))
        log = ReceiptLog(engine_for(tmpdir / "batch.db"), signer)
        t = signed_appends(log, n_batch, 100, 0)
        lines.append(row("signed decision receipt append_many, 100/tx", n_batch, t, base100))

        big = ReceiptLog(engine_for(tmpdir / "big.db"), signer)
        signed_appends(big, n_verify, 1000, 0)
        start = time.perf_counter()
        note = big.checkpoint()
        t_cp = time.perf_counter() - start
        log_path, trust_path, cp_path = (tmpdir / n for n in ("log.jsonl", "trust.json", "cp.txt"))
        with open(log_path, "w") as f:
            big.export_jsonl(f)
        big.export_trust_root().write(trust_path)
        cp_path.write_text(note)

        base_v = baseline_verify(log_path)
        lines.append(row("baseline read (json.loads+sha256 per line)", n_verify, base_v))
        result = verify_files(log_path, trust_path, cp_path)
        assert result.ok, result.failure
        lines.append(row("verify log (all checks + checkpoint)", n_verify, result.seconds, base_v))

        start = time.perf_counter()
        proof = prove(big, n_verify // 2)
        t_prove = time.perf_counter() - start
        start = time.perf_counter()
        assert verify_proof(proof, big.export_trust_root())
        t_vp = time.perf_counter() - start

    print("\n".join(lines))
    print()
    print(f"checkpoint of {n_verify:,} receipts (first, from scratch): {t_cp * 1e3:.0f} ms")
    print(
        f"inclusion proof of one receipt in {n_verify:,}: prove {t_prove * 1e3:.0f} ms, verify {t_vp * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
