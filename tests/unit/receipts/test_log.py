"""The receipt log against a real SQLite database (and PostgreSQL where one is reachable)."""

from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, insert, select

from sandlot.errors import Conflict, InvalidRequest, InvalidState, NotFound
from sandlot.receipts import (
    Decision,
    Ed25519Signer,
    Entry,
    ReceiptLog,
    approval_entry,
    execution_entry,
    merkle,
    parse_note,
    sha256_ref,
    verify_log,
)
from sandlot.receipts.canonical import GENESIS_HASH
from sandlot.receipts.schema import create_tables, receipts


def test_append_chains_seq_prev_hash_and_lamport(log, decision):
    first = log.append(decision(1))
    second = log.append(decision(2, Decision.DENY))
    assert (first.seq, second.seq) == (1, 2)
    assert first.prev_hash == GENESIS_HASH
    assert second.prev_hash == first.entry_hash
    assert (first.lamport, second.lamport) == (1, 2)
    assert second.decision is Decision.DENY
    assert second.reason_code == "POLICY_DENY"
    assert second.key_id == log.signer.key_id


def test_receipts_read_back_byte_for_byte(log, decision):
    written = log.append_many([decision(n) for n in range(5)])
    assert [r.line for r in log.iterate()] == [r.line for r in written]
    assert log.get(3).entry_hash == written[2].entry_hash
    assert [r.seq for r in log.tail(2)] == [4, 5]
    assert log.size() == 5
    with pytest.raises(NotFound):
        log.get(6)


def test_receipts_are_stamped_in_utc_to_the_microsecond(log, decision):
    before = datetime.now(UTC)
    stamps = [r.body["ts"] for r in [log.append(decision(1)), *log.append_many([decision(2)])]]
    after = datetime.now(UTC)
    for ts in stamps:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", ts)
        assert before <= datetime.fromisoformat(ts) <= after
    assert stamps == sorted(stamps)


def test_iterate_pages_through_the_whole_log(log, decision):
    log.append_many([decision(n) for n in range(25)])
    assert [r.seq for r in log.iterate(from_seq=3, page=7)] == list(range(3, 26))


@pytest.mark.parametrize("size", [10, 33, 100])  # 33, 100: signed on two threads
def test_batch_is_one_chain(log, decision, size):
    batch = log.append_many([decision(n) for n in range(size)])
    for prev, cur in itertools.pairwise(batch):
        assert cur.prev_hash == prev.entry_hash
        assert cur.seq == prev.seq + 1
    result = verify_log(log.lines(), log.export_trust_root())
    assert result.ok, result.failure
    assert result.receipts == size
    log.close()  # also stops the signing thread


def test_lamport_moves_past_a_seen_clock(log, decision):
    log.append(decision(1))
    r = log.append(decision(2), seen_lamport=100)
    assert r.lamport == 101
    assert log.append(decision(3)).lamport == 102


def test_execution_references_its_allow_decision(log, decision):
    allow = log.append(decision(1))
    done = log.append(execution_entry(allow, output_hash=sha256_ref(b"hi\n"), exit_code=0))
    assert done.body["decision_ref"] == allow.entry_hash
    assert done.request_hash == allow.request_hash
    assert done.body["exit_code"] == 0


def test_a_deny_cannot_be_executed(log, decision):
    deny = log.append(decision(1, Decision.DENY))
    with pytest.raises(InvalidRequest, match="not an ALLOW"):
        execution_entry(deny)


def test_an_execution_must_reference_a_decision_in_this_log(log, decision, engine):
    foreign = ReceiptLog(engine, Ed25519Signer.generate(), log_id="other.example/log")
    elsewhere = foreign.append(decision(1))
    with pytest.raises(InvalidRequest, match="not in log"):
        log.append(execution_entry(elsewhere))
    assert log.size() == 0


def test_an_allow_is_executed_at_most_once(log, decision):
    allow = log.append(decision(1))
    log.append(execution_entry(allow, exit_code=0))
    with pytest.raises(Conflict):
        log.append(execution_entry(allow, exit_code=0))
    assert log.size() == 2


def test_hold_then_approval_then_execution(log, decision):
    hold = log.append(decision(1, Decision.HOLD, reason_code="NEEDS_APPROVAL"))
    with pytest.raises(InvalidRequest):
        execution_entry(hold)
    approval = log.append(approval_entry(hold, decision=Decision.ALLOW, principal="user:ana"))
    done = log.append(execution_entry(approval, exit_code=0))
    assert done.body["decision_ref"] == approval.entry_hash
    with pytest.raises(Conflict):
        log.append(approval_entry(hold, decision=Decision.DENY, principal="user:bob"))


def test_free_types_carry_detail(log):
    r = log.append(
        Entry(type="network.egress", sandbox_id="sbx_1", detail={"host": "pypi.org", "port": 443})
    )
    assert r.body["detail"] == {"host": "pypi.org", "port": 443}
    assert r.type == "network.egress"


def test_bad_entries_are_refused():
    with pytest.raises(InvalidRequest):
        Entry(type="decision", op="exec")  # no request_hash, decision, reason_code
    with pytest.raises(InvalidRequest):
        Entry(type="x", request_hash="md5:abc")
    with pytest.raises(InvalidRequest):
        Entry(type="x", exit_code=2**60)


def test_on_receipt_callbacks_run_after_commit_and_can_fail(log, decision, caplog):
    seen = []
    remove = log.on_receipt(lambda r: seen.append(r.seq))

    def boom(_r):
        msg = "callback bug"
        raise RuntimeError(msg)

    log.on_receipt(boom)
    log.append(decision(1))
    assert seen == [1]
    assert log.size() == 1
    assert "callback failed" in caplog.text
    remove()
    log.append(decision(2))
    assert seen == [1]


def test_two_logs_in_one_process_interleave_without_forking(engine, signer, decision):
    a = ReceiptLog(engine, signer, log_id="test.example/receipts")
    b = ReceiptLog(engine, signer, log_id="test.example/receipts")
    for n in range(10):
        (a if n % 2 else b).append(decision(n))
    result = verify_log(a.lines(), a.export_trust_root())
    assert result.ok, result.failure
    assert result.receipts == 10


def test_key_rotation_switches_keys_from_the_next_seq(log, decision, engine):
    old = log.signer
    log.append(decision(1))
    new = Ed25519Signer.generate()
    rotation = log.rotate(new)
    after = log.append(decision(2))
    assert rotation.type == "key_rotation"
    assert [s.keyid for s in rotation.envelope.signatures] == [old.key_id, new.key_id]
    assert after.key_id == new.key_id
    trust = log.export_trust_root()
    assert [(k.key_id, k.valid_from_seq, k.valid_to_seq) for k in trust.keys] == [
        (old.key_id, 1, 2),
        (new.key_id, 3, None),
    ]
    stale = ReceiptLog(engine, old, log_id=log.log_id)
    with pytest.raises(InvalidState, match="reopen"):
        stale.append(decision(3))


def test_checkpoint_is_a_signed_note_over_the_merkle_root(log, decision):
    written = log.append_many([decision(n) for n in range(7)])
    note = log.checkpoint()
    checkpoint, sigs = parse_note(note)
    assert checkpoint.origin == log.log_id
    assert checkpoint.size == 7
    assert checkpoint.root == merkle.root([r.leaf_hash for r in written])
    assert len(sigs) == 1
    assert note.splitlines()[3] == ""
    assert note.splitlines()[4].startswith("\u2014 test.example/receipts ")


def test_checkpoints_extend_incrementally(log, decision):
    log.append_many([decision(n) for n in range(5)])
    log.checkpoint()
    written = log.append_many([decision(n) for n in range(5, 13)])
    checkpoint = parse_note(log.checkpoint())[0]
    assert checkpoint.size == 13
    assert checkpoint.root == log.root(13)
    assert log.checkpoint() == log.latest_checkpoint()  # nothing new: the same note
    assert written[-1].seq == 13


def test_maybe_checkpoint_every_n_receipts(engine, signer, decision):
    log = ReceiptLog(engine, signer, checkpoint_every=5, checkpoint_interval=3600)
    log.append_many([decision(n) for n in range(4)])
    assert log.maybe_checkpoint() is None
    log.append(decision(5))
    note = log.maybe_checkpoint()
    assert note is not None
    assert parse_note(note)[0].size == 5
    assert log.maybe_checkpoint() is None


def test_maybe_checkpoint_after_an_interval(engine, signer, decision):
    log = ReceiptLog(engine, signer, checkpoint_every=1000, checkpoint_interval=0.0)
    assert log.maybe_checkpoint() is None  # nothing to checkpoint yet
    log.append(decision(1))
    assert log.maybe_checkpoint() is not None


def test_inclusion_and_consistency_proofs(log, decision):
    written = log.append_many([decision(n) for n in range(11)])
    root = log.root(11)
    for r in written:
        path = log.inclusion_proof(r.seq, 11)
        assert merkle.verify_inclusion(r.leaf_hash, r.seq - 1, 11, path, root)
    proof = log.consistency_proof(4, 11)
    assert merkle.verify_consistency(4, 11, log.root(4), root, proof)


def test_export_jsonl(log, decision):
    log.append_many([decision(n) for n in range(3)])
    out = io.StringIO()
    assert log.export_jsonl(out) == 3
    lines = out.getvalue().splitlines()
    assert lines == list(log.lines())
    assert out.getvalue().endswith("\n")


def test_database_rejects_a_second_row_for_a_seq(log, decision, engine):
    r = log.append(decision(1))
    row = {c.name: None for c in receipts.columns}
    row.update(
        log_id=log.log_id,
        seq=1,
        lamport=9,
        type="decision",
        entry_hash="sha256:" + "1" * 64,
        leaf_hash="0" * 64,
        prev_hash=GENESIS_HASH,
        key_id="x",
        envelope="{}",
        created_at=0.0,
    )
    with pytest.raises(Exception, match=r"(?i)unique|constraint"), engine.begin() as conn:
        conn.execute(insert(receipts), [row])
    with engine.connect() as conn:
        assert conn.execute(select(receipts.c.entry_hash)).scalars().all() == [r.entry_hash]


def test_a_driver_with_named_placeholders_appends_through_sqlalchemy(db_path, signer, decision):
    # Appends write positional SQL for the usual drivers; others take SQLAlchemy's insert.
    engine = create_engine(f"sqlite:///{db_path}", paramstyle="named")
    try:
        log = ReceiptLog(engine, signer, log_id="test.example/receipts")
        allow, *_ = log.append_many([decision(n) for n in range(3)])
        log.append(execution_entry(allow, exit_code=0))
        with pytest.raises(Conflict):
            log.append(execution_entry(allow, exit_code=0))
        assert [r.seq for r in log.iterate()] == [1, 2, 3, 4]
        result = verify_log(log.lines(), log.export_trust_root(), checkpoint=log.checkpoint())
        assert result.ok, result.failure
        log.close()
    finally:
        engine.dispose()


@pytest.mark.needs_postgres
def test_postgres_log_chains_reads_back_and_refuses_a_second_execution(pg_url, signer, decision):
    engine = create_engine(pg_url)
    try:
        create_tables(engine)
        log = ReceiptLog(engine, signer, log_id="test.example/receipts")
        written = log.append_many([decision(n) for n in range(3)])
        written.append(log.append(execution_entry(written[0], exit_code=0)))
        with pytest.raises(Conflict):
            log.append(execution_entry(written[0], exit_code=1))
        log.rotate(Ed25519Signer.generate())
        written.append(log.append(decision(4)))
        assert [r.line for r in log.iterate()][:4] == [r.line for r in written[:4]]
        assert log.get(6).line == written[-1].line
        result = verify_log(log.lines(), log.export_trust_root(), checkpoint=log.checkpoint())
        assert result.ok, result.failure
        assert result.receipts == 6
    finally:
        engine.dispose()


_WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from sqlalchemy import create_engine, event
    from sandlot.receipts import Decision, Ed25519Signer, ReceiptLog, decision_entry, sha256_ref

    import time
    url, key, worker, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    start_at = float(sys.argv[5])
    engine = create_engine(url, connect_args={"timeout": 60} if url.startswith("sqlite") else {})
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(c, _r):
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
    log = ReceiptLog(engine, Ed25519Signer.from_pem(Path(key).read_bytes()), log_id="test.example/receipts")
    def entry(n):
        return decision_entry(op="exec", request_hash=sha256_ref(f"{worker}/{n}".encode()),
                              decision=Decision.ALLOW, reason_code="OK", sandbox_id=worker)
    log.size()  # connect before the start line, so the workers really overlap
    time.sleep(max(0.0, start_at - time.time()))
    for n in range(count):
        if n % 10 == 0:
            log.append_many([entry(f"{n}.{i}") for i in range(5)])
        else:
            log.append(entry(n), seen_lamport=n)
    log.close()
    engine.dispose()
    """
)


def _run_workers(url: str, key: Path, workers: int, count: int) -> None:
    start_at = str(time.time() + 4.0)  # after every interpreter has started and connected
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, url, str(key), f"w{i}", str(count), start_at]
        )
        for i in range(workers)
    ]
    assert [p.wait(timeout=100) for p in procs] == [0] * workers


def _check_unforked(log: ReceiptLog, expected: int) -> None:
    assert log.size() == expected
    written = list(log.iterate())
    assert [r.seq for r in written] == list(range(1, expected + 1))
    # The workers really ran at the same time: their receipts interleave in the chain.
    switches = sum(
        a.body["sandbox_id"] != b.body["sandbox_id"] for a, b in itertools.pairwise(written)
    )
    assert switches >= 3
    result = verify_log(log.lines(), log.export_trust_root(), checkpoint=log.checkpoint())
    assert result.ok, result.failure
    assert result.receipts == expected


@pytest.mark.slow
def test_concurrent_processes_never_fork_the_chain_sqlite(db_path, tmp_path, engine, signer):
    key = tmp_path / "key.pem"
    key.write_bytes(signer.to_pem())
    workers, count = 4, 120  # each: 108 singles + 12 batches of 5
    _run_workers(f"sqlite:///{db_path}", key, workers, count)
    _check_unforked(ReceiptLog(engine, signer, log_id="test.example/receipts"), workers * 168)


@pytest.mark.slow
@pytest.mark.needs_postgres
def test_concurrent_processes_never_fork_the_chain_postgres(pg_url, tmp_path, signer):
    engine = create_engine(pg_url)
    try:
        create_tables(engine)
        key = tmp_path / "key.pem"
        key.write_bytes(signer.to_pem())
        _run_workers(pg_url, key, 4, 120)
        _check_unforked(ReceiptLog(engine, signer, log_id="test.example/receipts"), 4 * 168)
    finally:
        engine.dispose()


def test_reopening_right_after_a_rotation_needs_the_new_key(engine, log, decision):
    log.append(decision(1))
    old, new = log.signer, Ed25519Signer.generate()
    log.rotate(new)
    with pytest.raises(InvalidState):
        ReceiptLog(engine, old, log_id=log.log_id).append(decision(2))
    reopened = ReceiptLog(engine, new, log_id=log.log_id)
    assert reopened.append(decision(2)).key_id == new.key_id
    with pytest.raises(InvalidState):
        ReceiptLog(engine, old, log_id=log.log_id).checkpoint()
    result = verify_log(
        reopened.lines(), reopened.export_trust_root(), checkpoint=reopened.checkpoint()
    )
    assert result.ok, result.failure
