"""The store under concurrent processes: 8 writers each insert 50 sandboxes while another
process lists over and over. No duplicate id, no lost record, and no list ever shows a torn
record (every listed record is validated against what its writer put in it)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from sandlot.store.base import SandboxQuery
from sandlot.store.sql import SqlStore

WRITERS = 8
PER_WRITER = 50

# Each record carries a fingerprint of itself: its id, labels and a payload, hashed into its
# metadata. A reader that saw half of one write and half of another would see a mismatch.
COMMON = textwrap.dedent(
    """
    import hashlib, json

    def fingerprint(sandbox_id, labels, payload):
        text = json.dumps([sandbox_id, labels, payload], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()
    """
)

WRITER = COMMON + textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from sandlot.models import SandboxInfo, SandboxSpec, SandboxStatus, new_id
    from sandlot.store.sql import SqlStore

    async def main():
        url, writer, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
        store = SqlStore(url)
        store.ensure_schema()
        Path(f"{go}.ready-{writer}").touch()
        while not go.exists():
            time.sleep(0.001)
        for n in range(int(sys.argv[4])):
            sandbox_id = new_id("sb")
            labels = {"writer": writer, "n": str(n)}
            payload = "x" * (n * 37 % 2000)  # records of different sizes
            spec = SandboxSpec(labels=labels, env={"PAYLOAD": payload})
            info = SandboxInfo(id=sandbox_id, backend="fake", status=SandboxStatus.RUNNING,
                               spec=spec, tenant="race")
            info.metadata = {"fp": fingerprint(sandbox_id, labels, payload)}
            await store.insert(info)
            print(sandbox_id, flush=True)
        await store.aclose()

    asyncio.run(main())
    """
)

LISTER = COMMON + textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from sandlot.store.base import SandboxQuery
    from sandlot.store.sql import SqlStore

    async def main():
        url, done = sys.argv[1], Path(sys.argv[2])
        store = SqlStore(url)
        store.ensure_schema()
        Path(f"{done}.lister-ready").touch()
        seen, lists, torn, dups, lost, sizes = set(), 0, [], 0, [], []
        finished = False
        while not finished:
            finished = done.exists()  # one more full list after the writers are done
            records = await store.list(SandboxQuery(tenant="race"))
            lists += 1
            sizes.append(len(records))
            ids = [r.id for r in records]
            if len(ids) != len(set(ids)):
                dups += 1
            for r in records:
                payload = r.spec.env.get("PAYLOAD", "")
                fp = fingerprint(r.id, r.spec.labels, payload)
                if r.metadata.get("fp") != fp or r.tenant != "race" or r.version != 0:
                    torn.append(r.id)
            lost.extend(sorted(seen - set(ids)))  # once visible, a record stays visible
            seen |= set(ids)
        print(json.dumps({"lists": lists, "torn": torn, "dups": dups, "lost": lost,
                          "sizes": sizes, "seen": sorted(seen)}))
        await store.aclose()

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_eight_writers_and_a_lister(db_url: str, tmp_path: Path) -> None:
    store = SqlStore(db_url)
    store.ensure_schema()  # migrate once, before the race, as a server start does
    go = tmp_path / "go"
    done = tmp_path / "done"
    lister = subprocess.Popen(
        [sys.executable, "-c", LISTER, db_url, str(done)], stdout=subprocess.PIPE, text=True
    )
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, db_url, f"w{i}", str(go), str(PER_WRITER)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(WRITERS)
    ]
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (
            len(list(tmp_path.glob("go.ready-*"))) < WRITERS
            or not (tmp_path / "done.lister-ready").exists()
        ):
            await anyio.sleep(0.02)
        go.touch()
        written: list[str] = []
        for w in writers:
            out, _ = w.communicate(timeout=120)
            assert w.returncode == 0
            written.extend(out.split())
        done.touch()
        out, _ = lister.communicate(timeout=120)
        assert lister.returncode == 0
    finally:
        for p in (*writers, lister):
            if p.poll() is None:
                p.kill()
                p.wait()
    report = json.loads(out)

    assert len(written) == WRITERS * PER_WRITER
    assert len(set(written)) == len(written)  # no duplicate ids
    final = await store.list(SandboxQuery(tenant="race"))
    assert sorted(r.id for r in final) == sorted(written)  # no lost record
    assert report["torn"] == []
    assert report["dups"] == 0
    assert report["lost"] == []
    assert report["seen"] == sorted(written)
    # The lister really ran during the writes: it saw the table part-filled.
    assert report["lists"] >= 3
    assert any(0 < n < len(written) for n in report["sizes"]), report["sizes"]
    # Label filters agree with what each writer wrote (on PostgreSQL: through the GIN index).
    mine = await store.list(SandboxQuery(tenant="race", labels={"writer": "w3"}))
    assert len(mine) == PER_WRITER
    assert {r.spec.labels["n"] for r in mine} == {str(n) for n in range(PER_WRITER)}
    await store.aclose()
