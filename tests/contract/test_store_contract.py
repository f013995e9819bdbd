"""The contract every Store must keep, run against each implementation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from sandlot.errors import Conflict, NotFound
from sandlot.models import SandboxInfo, SandboxSpec, SandboxStatus, SnapshotInfo, new_id, utcnow
from sandlot.store.base import SandboxQuery
from sandlot.store.sql import SqlStore

S = SandboxStatus


def _record(**spec: object) -> SandboxInfo:
    tenant = str(spec.pop("tenant", "default"))
    created = spec.pop("created", None)
    info = SandboxInfo(
        id=new_id("sb"),
        backend=str(spec.pop("backend", "fake")),
        status=S.RUNNING,
        spec=SandboxSpec.model_validate(spec),
        tenant=tenant,
    )
    if created is not None:
        info.created_at = created  # type: ignore[assignment]
    return info


async def test_insert_get_round_trip(store: SqlStore) -> None:
    rec = _record(
        labels={"a": "1"}, env={"K": "v"}, setup=["echo 1", {"cmd": "ls", "args": ["-l"]}]
    )
    await store.insert(rec)
    got = await store.get(rec.id)
    assert got.model_dump() == rec.model_dump()
    with pytest.raises(Conflict):
        await store.insert(rec)
    with pytest.raises(NotFound, match="sb-missing"):
        await store.get("sb-missing")


async def test_tenant_scoping(store: SqlStore) -> None:
    mine = _record(tenant="a")
    await store.insert(mine)
    with pytest.raises(NotFound):
        await store.get(mine.id, tenant="b")
    assert (await store.get(mine.id, tenant="a")).id == mine.id
    assert await store.list(SandboxQuery(tenant="b")) == []


async def test_update_is_compare_and_set(store: SqlStore) -> None:
    rec = await store.insert(_record())
    v1 = await store.update(rec.id, 0, {"status": S.STOPPING, "error": "x"})
    assert (v1.version, v1.status, v1.error) == (1, S.STOPPING, "x")
    with pytest.raises(Conflict):
        await store.update(rec.id, 0, {"status": S.STOPPED})
    assert (await store.get(rec.id)).status is S.STOPPING
    with pytest.raises(NotFound):
        await store.update("sb-missing", 0, {"status": S.STOPPED})


async def test_touch_moves_activity_without_version(store: SqlStore) -> None:
    rec = await store.insert(_record())
    later = utcnow() + timedelta(seconds=5)
    await store.touch(rec.id, later)
    got = await store.get(rec.id)
    assert got.version == 0
    assert abs((got.last_active_at - later).total_seconds()) < 0.001
    # An update built from an older read never moves activity back.
    await store.update(rec.id, 0, {"status": S.STOPPED, "last_active_at": rec.last_active_at})
    assert abs(((await store.get(rec.id)).last_active_at - later).total_seconds()) < 0.001
    await store.touch(rec.id, rec.last_active_at)
    assert abs(((await store.get(rec.id)).last_active_at - later).total_seconds()) < 0.001


async def test_list_filters_order_and_paging(store: SqlStore) -> None:
    base = utcnow()
    recs = [
        _record(labels={"team": "a", "env": "dev"}, owner="alice", created=base),
        _record(labels={"team": "a"}, backend="local", created=base + timedelta(seconds=1)),
        _record(labels={"team": "b"}, created=base + timedelta(seconds=2)),
    ]
    for r in recs:
        await store.insert(r)
    await store.update(recs[2].id, 0, {"status": S.DESTROYED})
    ids = lambda items: [i.id for i in items]  # noqa: E731
    assert ids(await store.list(SandboxQuery())) == [recs[1].id, recs[0].id]
    assert ids(await store.list(SandboxQuery(include_destroyed=True))) == [
        r.id for r in reversed(recs)
    ]
    assert ids(await store.list(SandboxQuery(labels={"team": "a"}))) == [recs[1].id, recs[0].id]
    assert ids(await store.list(SandboxQuery(labels={"team": "a", "env": "dev"}))) == [recs[0].id]
    assert ids(await store.list(SandboxQuery(labels={"nope": "x"}))) == []
    assert ids(await store.list(SandboxQuery(owner="alice"))) == [recs[0].id]
    assert ids(await store.list(SandboxQuery(backend="local"))) == [recs[1].id]
    assert ids(await store.list(SandboxQuery(statuses=frozenset({S.DESTROYED})))) == [recs[2].id]
    assert ids(await store.list(SandboxQuery(limit=1))) == [recs[1].id]
    assert ids(await store.list(SandboxQuery(limit=1, offset=1))) == [recs[0].id]


async def test_expired_query(store: SqlStore) -> None:
    rec = _record()
    rec.expires_at = utcnow() - timedelta(seconds=1)
    await store.insert(rec)
    await store.insert(_record())
    assert [r.id for r in await store.list(SandboxQuery(expired_before=utcnow()))] == [rec.id]


async def test_delete(store: SqlStore) -> None:
    rec = await store.insert(_record())
    await store.delete(rec.id)
    await store.delete(rec.id)
    with pytest.raises(NotFound):
        await store.get(rec.id)


async def test_snapshots(store: SqlStore) -> None:
    snap = SnapshotInfo(
        id=new_id("snap"), sandbox_id="sb-1", backend="fake", ref="r1", spec=SandboxSpec()
    )
    await store.insert_snapshot(snap, tenant="t")
    assert (await store.get_snapshot(snap.id)).ref == "r1"
    with pytest.raises(NotFound):
        await store.get_snapshot(snap.id, tenant="other")
    assert [s.id for s in await store.list_snapshots(sandbox_id="sb-1")] == [snap.id]
    assert await store.list_snapshots(tenant="other") == []
    await store.delete_snapshot(snap.id)
    with pytest.raises(NotFound):
        await store.get_snapshot(snap.id)


async def test_concurrent_updates_in_one_process_exactly_one_wins(store: SqlStore) -> None:
    rec = await store.insert(_record())
    winners: list[int] = []

    async def attempt(i: int) -> None:
        try:
            await store.update(rec.id, 0, {"status": S.STOPPING, "error": str(i)})
            winners.append(i)
        except Conflict:
            pass

    async with anyio.create_task_group() as tg:
        for i in range(16):
            tg.start_soon(attempt, i)
    assert len(winners) == 1
    assert (await store.get(rec.id)).error == str(winners[0])


RACER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from pathlib import Path
    from sandlot.errors import Conflict
    from sandlot.models import SandboxStatus
    from sandlot.store.sql import SqlStore

    async def main():
        store = SqlStore(sys.argv[1])
        rec = await store.get(sys.argv[2])
        Path(sys.argv[3] + f".ready{os.getpid()}").touch()
        while not Path(sys.argv[3]).exists():
            time.sleep(0.001)
        try:
            await store.update(rec.id, rec.version, {"status": SandboxStatus.RESUMING, "error": str(os.getpid())})
            print("won")
        except Conflict:
            print("lost")
        await store.aclose()

    asyncio.run(main())
    """
)


async def test_multi_process_cas_race_exactly_one_wins(
    store: SqlStore, store_url: str, tmp_path: Path
) -> None:
    rec = await store.insert(_record())
    await store.update(rec.id, 0, {"status": S.STOPPED})
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, store_url, rec.id, str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.ready*"))) < len(procs) and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    go.touch()
    outcomes = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(outcomes) == ["lost"] * 7 + ["won"]
    final = await store.get(rec.id)
    assert final.status is S.RESUMING
    assert final.version == 2
