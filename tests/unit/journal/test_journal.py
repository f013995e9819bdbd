"""The journal's guarantees, on SQLite and PostgreSQL: idempotent intents, a one-use
authorization under thread and process races, fencing, at most one allocation per intent,
recovery of expired leases."""

from __future__ import annotations

import functools
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, insert, select
from sqlalchemy.exc import IntegrityError

from sandlot.errors import Conflict, InvalidRequest, InvalidState, NotFound
from sandlot.journal import (
    IntentState,
    Journal,
    Lease,
    StaleLease,
    allocation_name,
)
from sandlot.journal.schema import authorizations, intents, provider_allocations
from sandlot.receipts.canonical import JsonValue, canonical_json, sha256_ref

S = IntentState
_MAX = 2**53 - 1

# Requests as the Manager would journal them: JSON without floats (which RFC 8785 handles, but
# which JSON databases may hand back as another type, so equality after a round trip would be
# about the driver rather than the journal).
json_values: st.SearchStrategy[JsonValue] = st.recursive(
    st.none() | st.booleans() | st.integers(-_MAX, _MAX) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
requests = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
keys = st.text(min_size=1, max_size=40).filter(lambda k: "\x00" not in k)
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _begin(
    j: Journal, request: dict[str, JsonValue], key: str | None, *, tenant: str = "t"
) -> tuple[str, bool]:
    b = j.begin(tenant=tenant, principal="alice", op="sandbox.exec", request=request,
                idempotency_key=key)  # fmt: skip
    return b.intent.intent_id, b.replay


def _authorized(j: Journal, key: str | None = None) -> Lease:
    b = j.begin(
        tenant="t",
        principal="alice",
        op="sandbox.create",
        request={"n": secrets.token_hex(4)},
        idempotency_key=key,
    )
    return j.authorize(b.intent.intent_id, decision="sha256:" + secrets.token_hex(32))


# -- idempotency ------------------------------------------------------------------------------


@PROPERTY
@given(request=requests, key=keys)
def test_same_key_same_request_is_the_same_intent(
    journal: Journal, request: dict[str, JsonValue], key: str
) -> None:
    tenant = secrets.token_hex(6)
    first, replay1 = _begin(journal, request, key, tenant=tenant)
    # The same request built in another key order is the same canonical request.
    reordered = dict(reversed(list(request.items())))
    second, replay2 = _begin(journal, reordered, key, tenant=tenant)
    assert (replay1, replay2) == (False, True)
    assert first == second
    intent = journal.get(first)
    assert intent.request == request
    assert intent.state is S.PREPARED
    assert intent.request_hash == sha256_ref(
        canonical_json({"op": "sandbox.exec", "tenant": tenant, "request": request})
    )
    assert journal.find(tenant, key) == intent


@PROPERTY
@given(data=st.data(), key=keys)
def test_same_key_different_request_is_refused(
    journal: Journal, data: st.DataObject, key: str
) -> None:
    tenant = secrets.token_hex(6)
    a = data.draw(requests)
    b = data.draw(requests.filter(lambda r: canonical_json(r) != canonical_json(a)))
    first, _ = _begin(journal, a, key, tenant=tenant)
    with pytest.raises(Conflict, match="reused with a different request") as err:
        _begin(journal, b, key, tenant=tenant)
    assert err.value.details["idempotency_key"] == key
    # The refusal changed nothing: the key still answers with the first intent.
    again, replay = _begin(journal, a, key, tenant=tenant)
    assert (again, replay) == (first, True)
    assert len(journal.list(tenant=tenant)) == 1


@PROPERTY
@given(request=requests)
def test_without_a_key_identical_requests_are_distinct(
    journal: Journal, request: dict[str, JsonValue]
) -> None:
    one, r1 = _begin(journal, request, None)
    two, r2 = _begin(journal, request, None)
    assert one != two
    assert not r1
    assert not r2


def test_keys_are_scoped_by_tenant_and_distinct_keys_are_distinct(journal: Journal) -> None:
    req: dict[str, JsonValue] = {"cmd": ["ls"]}
    a, _ = _begin(journal, req, "k", tenant="acme")
    b, replay = _begin(journal, req, "k", tenant="globex")
    assert a != b
    assert not replay
    # Two keys carrying the same request are two operations (two `ls` runs).
    c, replay = _begin(journal, req, "k2", tenant="acme")
    assert c != a
    assert not replay


def test_replay_returns_the_finished_result(journal: Journal) -> None:
    lease = _authorized(journal, key="create-1")
    lease = journal.allocating(lease, backend="fake", name=allocation_name(lease.intent_id))
    lease = journal.allocated(lease, provider_ref="fake-1")
    journal.record_result(lease, result={"id": "sb-1", "status": "running"}, receipt_seq=7)
    again = journal.begin(
        tenant="t",
        principal="bob",
        op="sandbox.create",
        request=journal.get(lease.intent_id).request,
        idempotency_key="create-1",
    )
    assert again.replay
    assert again.intent.state is S.RESULT_RECORDED
    assert again.intent.result == {"id": "sb-1", "status": "running"}
    assert again.intent.result_hash == sha256_ref(
        canonical_json({"id": "sb-1", "status": "running"})
    )
    assert again.intent.receipt_seq == 7
    assert again.intent.allocation is not None
    assert again.intent.allocation.provider_ref == "fake-1"


def test_uncanonical_request_is_invalid(journal: Journal) -> None:
    with pytest.raises(InvalidRequest):
        _begin(journal, {"n": 2**60}, "k")
    assert journal.list() == []


# -- one-use authorization --------------------------------------------------------------------


def test_authorization_is_consumed_once(journal: Journal) -> None:
    b = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key=None)
    intent_id = b.intent.intent_id
    lease = journal.authorize(intent_id, decision="sha256:allow-1")
    assert (lease.state, lease.fence, lease.owner) == (S.AUTHORIZED, 1, "worker-a")
    with pytest.raises(Conflict, match="already consumed by worker-a"):
        journal.authorize(intent_id, decision="sha256:allow-1")
    with pytest.raises(Conflict, match="already authorized by decision"):
        journal.authorize(intent_id, decision="sha256:allow-2")
    assert journal.get(intent_id).fence == 1
    with pytest.raises(NotFound):
        journal.authorize("sha256:missing", decision="sha256:allow-3")


def test_a_decision_authorizes_one_intent(journal: Journal) -> None:
    one = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key=None)
    two = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key=None)
    journal.authorize(one.intent.intent_id, decision="sha256:d")
    with pytest.raises(Conflict, match="already authorizes another intent"):
        journal.authorize(two.intent.intent_id, decision="sha256:d")
    assert journal.get(two.intent.intent_id).state is S.PREPARED


def test_expired_authorization_cannot_be_consumed(journal: Journal) -> None:
    b = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key=None)
    journal.grant(b.intent.intent_id, decision="sha256:d", ttl=0.05)
    journal.grant(b.intent.intent_id, decision="sha256:d", ttl=0.05)  # a retried grant: no-op
    time.sleep(0.2)
    with pytest.raises(Conflict, match="expired"):
        journal.consume(b.intent.intent_id, decision="sha256:d")
    assert journal.get(b.intent.intent_id).state is S.PREPARED


def test_denied_intent_cannot_be_authorized_and_the_consumption_rolls_back(
    journal: Journal, engine: Engine
) -> None:
    b = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key="k")
    journal.deny(b.intent.intent_id, decision="sha256:deny", reason="POLICY_VIOLATION")
    with pytest.raises(Conflict, match="DENIED, not PREPARED"):
        journal.authorize(b.intent.intent_id, decision="sha256:allow")
    with engine.connect() as conn:
        assert conn.execute(select(authorizations)).all() == []  # grant and consume undone
    replay = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key="k")
    assert replay.replay
    assert replay.intent.state is S.DENIED
    assert replay.intent.error == "POLICY_VIOLATION"


def test_sixteen_threads_race_for_one_authorization(engine: Engine) -> None:
    owner = Journal(engine, owner="setup")
    intent_id = owner.begin(
        tenant="t", principal="p", op="o", request={"x": 1}, idempotency_key="race"
    ).intent.intent_id
    barrier = threading.Barrier(16)
    won: list[Lease] = []
    lost: list[str] = []

    def racer(i: int) -> None:
        j = Journal(engine, owner=f"thread-{i}")
        barrier.wait()
        try:
            won.append(j.authorize(intent_id, decision="sha256:allow"))
        except Conflict as e:
            lost.append(str(e))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1
    assert len(lost) == 15
    intent = owner.get(intent_id)
    assert (intent.state, intent.fence, intent.lease_owner) == (S.AUTHORIZED, 1, won[0].owner)
    with engine.connect() as conn:
        consumers = conn.execute(select(authorizations.c.consumed_by)).scalars().all()
    assert consumers == [won[0].owner]


RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from sandlot.errors import Conflict
    from sandlot.journal import Journal
    from sandlot.store.sql import open_engine

    url, intent_id, go = sys.argv[1:4]
    engine = open_engine(url)
    journal = Journal(engine, owner=f"proc-{os.getpid()}")
    journal.get(intent_id)  # connected and warm before the start line
    Path(go + f".ready{os.getpid()}").touch()
    while not Path(go).exists():
        time.sleep(0.001)
    try:
        lease = journal.authorize(intent_id, decision="sha256:allow")
        print("won", lease.fence, lease.owner)
    except Conflict:
        print("lost")
    engine.dispose()
    """
)


def test_eight_processes_race_for_one_authorization(
    journal: Journal, db_url: str, tmp_path: Path
) -> None:
    intent_id = journal.begin(
        tenant="t", principal="p", op="o", request={}, idempotency_key="race"
    ).intent.intent_id
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, db_url, intent_id, str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("go.ready*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    outcomes = [p.communicate(timeout=90)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1, outcomes
    assert outcomes.count("lost") == 7
    intent = journal.get(intent_id)
    assert intent.fence == 1
    assert winners[0] == f"won 1 {intent.lease_owner}"


# -- fencing and take-over --------------------------------------------------------------------


def test_stale_lease_cannot_transition(engine: Engine) -> None:
    a = Journal(engine, owner="a", lease_seconds=0.2)
    b = Journal(engine, owner="b", lease_seconds=30)
    lease_a = _authorized(a)
    lease_a = a.allocating(lease_a, backend="fake", name=allocation_name(lease_a.intent_id))
    with pytest.raises(Conflict, match="leased to a"):
        b.take_over(lease_a.intent_id)  # not expired yet
    time.sleep(0.3)
    assert [i.intent_id for i in b.stale()] == [lease_a.intent_id]
    lease_b = b.take_over(lease_a.intent_id)
    assert lease_b.fence == lease_a.fence + 1
    assert b.stale() == []
    before = a.get(lease_a.intent_id)
    for attempt in (
        lambda: a.allocated(lease_a, provider_ref="ref-a"),
        lambda: a.fail(lease_a, error="gave up"),
        lambda: a.renew(lease_a),
        lambda: a.attach_sandbox(lease_a, "sb-a"),
        lambda: a.advance(lease_a, S.FAILED),
    ):
        with pytest.raises(StaleLease, match="stale") as err:
            attempt()
        assert err.value.code == "conflict"
    after = a.get(lease_a.intent_id)
    assert (after.state, after.fence, after.lease_owner, after.sandbox_id) == (
        before.state,
        before.fence,
        "b",
        None,
    )
    assert after.allocation is not None
    assert after.allocation.provider_ref is None
    # The new holder carries on with the allocation the old one recorded.
    done = b.allocated(lease_b, provider_ref="ref-b")
    assert done.state is S.ALLOCATED
    assert b.get(done.intent_id).allocation.provider_ref == "ref-b"  # type: ignore[union-attr]


def test_transitions_follow_the_state_machine(journal: Journal) -> None:
    lease = _authorized(journal)
    with pytest.raises(InvalidRequest):
        journal.advance(lease, S.CLEANED)
    with pytest.raises(InvalidRequest):
        journal.advance(lease, S.ALLOCATED)  # only allocated() records an allocation
    with pytest.raises(InvalidRequest):
        journal.allocated(lease, provider_ref="x")
    running = journal.advance(lease, S.RUNNING)
    assert running.expires_at is not None
    done = journal.record_result(running, result={"exit_code": 0}, receipt_seq=None)
    assert done.expires_at is None  # a resting state holds no lease
    with pytest.raises(InvalidRequest):
        journal.fail(done, error="late")
    cleaning = journal.advance(done, S.CLEANING)
    journal.advance(cleaning, S.CLEANED)
    assert [(e.from_state, e.to_state) for e in journal.events(lease.intent_id)] == [
        (None, S.PREPARED),
        (S.PREPARED, S.AUTHORIZED),
        (S.AUTHORIZED, S.RUNNING),
        (S.RUNNING, S.RESULT_RECORDED),
        (S.RESULT_RECORDED, S.CLEANING),
        (S.CLEANING, S.CLEANED),
    ]


def test_take_over_only_where_there_is_a_lease(journal: Journal) -> None:
    b = journal.begin(tenant="t", principal="p", op="o", request={}, idempotency_key=None)
    with pytest.raises(InvalidState, match="PREPARED"):
        journal.take_over(b.intent.intent_id)
    with pytest.raises(NotFound):
        journal.take_over("sha256:nope")
    lease = _authorized(journal)
    failed = journal.fail(lease, error="boom")
    with pytest.raises(InvalidState, match="FAILED"):
        journal.take_over(failed.intent_id)


# -- allocations ------------------------------------------------------------------------------


def test_the_database_refuses_a_second_allocation(journal: Journal, engine: Engine) -> None:
    lease = _authorized(journal)
    name = allocation_name(lease.intent_id)
    journal.allocating(lease, backend="fake", name=name)
    row = {"intent_id": lease.intent_id, "backend": "fake", "fence": 1, "created_at": 0.0}
    # Straight to the table, bypassing every code path: the constraint itself says no.
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(insert(provider_allocations).values(**row, deterministic_name="other"))
    with engine.connect() as conn:
        count = conn.execute(select(provider_allocations.c.intent_id)).all()
    assert len(count) == 1


def test_allocation_names_and_refs_are_unique_across_intents(journal: Journal) -> None:
    one = _authorized(journal)
    two = _authorized(journal)
    one = journal.allocating(one, backend="fake", name="same-name")
    with pytest.raises(Conflict, match="already has an allocation, or the name"):
        journal.allocating(two, backend="fake", name="same-name")
    assert journal.get(two.intent_id).state is S.AUTHORIZED  # the whole step rolled back
    two = journal.allocating(two, backend="fake", name="other-name")
    journal.allocated(one, provider_ref="ref-1")
    with pytest.raises(Conflict, match="already another intent's"):
        journal.allocated(two, provider_ref="ref-1")
    assert journal.get(two.intent_id).state is S.ALLOCATING


def test_allocating_twice_for_one_intent_fails(engine: Engine) -> None:
    """A replayed step and a recovered worker both reach allocating(): only one records it."""
    a = Journal(engine, owner="a", lease_seconds=0.1)
    b = Journal(engine, owner="b")
    lease = _authorized(a)
    time.sleep(0.2)
    taken = b.take_over(lease.intent_id)
    b.allocating(taken, backend="fake", name=allocation_name(lease.intent_id))
    with pytest.raises(StaleLease):
        a.allocating(lease, backend="fake", name=allocation_name(lease.intent_id))
    with pytest.raises(StaleLease):
        b.allocating(taken, backend="fake", name=allocation_name(lease.intent_id))


def test_release_and_prune(journal: Journal) -> None:
    lease = _authorized(journal, key="k")
    lease = journal.allocating(lease, backend="fake", name=allocation_name(lease.intent_id))
    lease = journal.allocated(lease, provider_ref="r")
    journal.record_result(lease, result={"id": "sb"}, receipt_seq=None)
    failed = journal.fail(_authorized(journal), error="x")
    later = datetime.now(UTC) + timedelta(seconds=5)
    # The live allocation keeps its intent; the failed one goes.
    assert journal.prune(before=later) == 1
    with pytest.raises(NotFound):
        journal.get(failed.intent_id)
    assert journal.release(backend="fake", provider_ref="r")
    assert not journal.release(backend="fake", provider_ref="r")
    assert journal.prune(before=later) == 1
    assert journal.find("t", "k") is None


# -- recovery ---------------------------------------------------------------------------------


def test_stale_lists_only_expired_leases(engine: Engine) -> None:
    short = Journal(engine, owner="short", lease_seconds=0.1)
    long = Journal(engine, owner="long", lease_seconds=60)
    expired = _authorized(short)
    held = _authorized(long)
    resting = short.record_result(_authorized(short), result={}, receipt_seq=None)
    short.begin(tenant="t", principal="p", op="o", request={}, idempotency_key=None)
    time.sleep(0.2)
    assert [i.intent_id for i in long.stale()] == [expired.intent_id]
    future = datetime.now(UTC) + timedelta(seconds=120)
    assert {i.intent_id for i in long.stale(now=future)} == {expired.intent_id, held.intent_id}
    assert resting.intent_id not in {i.intent_id for i in long.stale(now=future)}


def test_needs_reconcile_fences_out_the_worker_and_waits_for_an_operator(
    journal: Journal,
) -> None:
    lease = _authorized(journal)
    lease = journal.allocating(lease, backend="fake", name=allocation_name(lease.intent_id))
    journal.needs_reconcile(lease.intent_id, why="backend did not answer")
    journal.needs_reconcile(lease.intent_id, why="again")  # idempotent
    with pytest.raises(StaleLease):
        journal.allocated(lease, provider_ref="late")
    intent = journal.get(lease.intent_id)
    assert intent.state is S.NEEDS_RECONCILE
    assert intent.final
    assert intent.error == "backend did not answer"
    assert [i.intent_id for i in journal.list(states=[S.NEEDS_RECONCILE])] == [lease.intent_id]
    with pytest.raises(InvalidState):
        journal.take_over(lease.intent_id)
    done = journal.resolve(lease.intent_id, outcome="CLEANED", note="removed by hand")
    assert done.state is S.CLEANED
    assert done.allocation is not None
    assert done.allocation.released_at is not None
    with pytest.raises(InvalidState):
        journal.resolve(lease.intent_id, outcome="FAILED", note="twice")


async def test_wait_returns_when_the_worker_finishes(engine: Engine) -> None:
    worker = Journal(engine, owner="w")
    lease = worker.advance(_authorized(worker, key="k"), S.RUNNING)

    def finish() -> None:
        time.sleep(0.2)
        worker.record_result(lease, result={"exit_code": 0}, receipt_seq=1)

    t = threading.Thread(target=finish)
    t.start()
    start = time.monotonic()
    intent = await Journal(engine, owner="replayer").wait(lease.intent_id, timeout=10)
    t.join()
    assert intent.state is S.RESULT_RECORDED
    assert intent.result == {"exit_code": 0}
    assert time.monotonic() - start < 5


async def test_a_repeat_waits_for_the_caller_at_the_gate_then_takes_over(engine: Engine) -> None:
    first = Journal(engine, owner="first")
    repeat = Journal(engine, owner="repeat")
    intent_id, _ = _begin(first, {"n": 1}, "k")
    # The caller that began it is deciding: a repeat may not take it, and waits.
    assert not repeat.claim(intent_id)
    assert repeat.taken("t", "k")
    start = time.monotonic()
    waited = await repeat.wait(intent_id, timeout=0.3)
    assert waited.state is S.PREPARED
    assert time.monotonic() - start >= 0.3
    # Its gate failed without a decision: the first repeat to ask takes it, only one.
    first.release_claim(intent_id)
    assert not repeat.taken("t", "k")
    assert (await repeat.wait(intent_id, timeout=10)).state is S.PREPARED
    assert repeat.claim(intent_id)
    assert not first.claim(intent_id)
    # A holder proved dead loses its claim at once.
    assert first.claim(intent_id, dead_owner="repeat")
    assert not first.taken("t", "other-key")


async def test_a_wake_ends_a_slow_poll_at_once(engine: Engine) -> None:
    worker = Journal(engine, owner="w")
    lease = worker.advance(_authorized(worker, key="k"), S.RUNNING)
    wake = anyio.Event()

    async def finish() -> None:
        await anyio.sleep(0.2)
        await anyio.to_thread.run_sync(
            functools.partial(worker.record_result, lease, result={"ok": 1}, receipt_seq=None)
        )
        wake.set()

    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(finish)
        # Polls 30 s apart: only the wake can end this wait in time.
        intent = await worker.wait(lease.intent_id, timeout=60, wake=wake, poll=30, max_poll=30)
    assert intent.state is S.RESULT_RECORDED
    assert time.monotonic() - start < 5


def test_free_text_with_nul_is_stored(journal: Journal) -> None:
    failed = journal.fail(_authorized(journal), error="bad\x00byte")
    assert journal.get(failed.intent_id).error == "bad\ufffdbyte"


def test_intents_table_has_what_get_shows(journal: Journal, engine: Engine) -> None:
    lease = _authorized(journal)
    journal.attach_sandbox(lease, "sb-123")
    with engine.connect() as conn:
        row = conn.execute(select(intents).where(intents.c.intent_id == lease.intent_id)).one()
    assert row.sandbox_id == "sb-123"
    assert journal.list(sandbox_id="sb-123")[0].intent_id == lease.intent_id
