"""Exec output logs: the behaviour both keep (memory, database), and what only the database
one gives: readers on other processes, batched writes, ``unknown`` after the server died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import anyio
import pytest
from sqlalchemy import Engine, event, select

from sandlot.errors import NotFound, OutputExpired
from sandlot.journal import ExecRuns
from sandlot.journal.schema import exec_chunks
from sandlot.server.outputlog import (
    DatabaseExecOutputLog,
    ExecOutcome,
    ExecOutputLog,
    MemoryExecOutputLog,
)
from sandlot.store.migrate import upgrade
from sandlot.store.sql import open_engine

OK = ExecOutcome(result={"exit_code": 0, "stdout": "", "stderr": ""})


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgresql", marks=pytest.mark.needs_postgres)]
)
async def output(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ExecOutputLog]:
    if request.param == "memory":
        yield MemoryExecOutputLog(max_bytes=12)
        return
    url = (
        f"sqlite:///{tmp_path / 'out.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    engine = open_engine(url)
    upgrade(engine)
    log = DatabaseExecOutputLog(engine, max_bytes=12, flush_interval=0.02, poll_interval=0.02)
    yield log
    await log.aclose()
    engine.dispose()


async def _write(log: ExecOutputLog, exec_id: str, *parts: tuple[str, bytes]) -> None:
    for stream, data in parts:
        await log.append(exec_id, stream, data)  # type: ignore[arg-type]


# -- the contract both implementations keep ----------------------------------------------------


async def test_output_round_trip_and_resume(output: ExecOutputLog) -> None:
    await output.open("e1", tenant="t", sandbox_id="sb")
    await _write(output, "e1", ("stdout", b"a"), ("stderr", b"b"), ("stdout", b"c"))
    await output.finish("e1", OK)
    page = await output.read("e1", tenant="t", after=-1, wait=1)
    assert [(c.seq, c.stream, c.data) for c in page.chunks] == [
        (0, "stdout", b"a"),
        (1, "stderr", b"b"),
        (2, "stdout", b"c"),
    ]
    assert page.outcome == OK
    resumed = await output.read("e1", tenant="t", after=1, wait=1)
    assert [c.data for c in resumed.chunks] == [b"c"]
    assert resumed.outcome == OK


async def test_reader_waits_for_output(output: ExecOutputLog) -> None:
    await output.open("e1", tenant="t", sandbox_id="sb")
    got: list[bytes] = []

    async def reader() -> None:
        page = await output.read("e1", tenant="t", after=-1, wait=10)
        got.extend(c.data for c in page.chunks)

    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0.1)
        await output.append("e1", "stdout", b"hello")
    assert got == [b"hello"]
    assert time.monotonic() - start < 2
    # Nothing new: the reader gets an empty page after its wait, not an outcome.
    page = await output.read("e1", tenant="t", after=0, wait=0.05)
    assert page.chunks == []
    assert page.outcome is None


async def test_unknown_or_foreign_exec_is_not_found(output: ExecOutputLog) -> None:
    await output.open("e1", tenant="t", sandbox_id="sb")
    with pytest.raises(NotFound):
        await output.read("e1", tenant="other", after=-1, wait=0)
    with pytest.raises(NotFound):
        await output.read("nope", tenant="t", after=-1, wait=0)
    with pytest.raises(NotFound):
        await output.append("nope", "stdout", b"x")


async def test_byte_limit_drops_the_oldest_and_says_so(output: ExecOutputLog) -> None:
    await output.open("e1", tenant="t", sandbox_id="sb")
    await _write(output, "e1", *[("stdout", b"%04d" % i) for i in range(5)])  # 20 bytes > 12
    await output.finish("e1", OK)
    with pytest.raises(OutputExpired) as err:
        await output.read("e1", tenant="t", after=-1, wait=0)
    assert err.value.details["first_seq"] == 2
    page = await output.read("e1", tenant="t", after=1, wait=0)
    assert [c.data for c in page.chunks] == [b"0002", b"0003", b"0004"]
    assert page.outcome == OK


# -- the database log -------------------------------------------------------------------------


@pytest.fixture
async def db_log(engine: Engine) -> AsyncIterator[DatabaseExecOutputLog]:
    log = DatabaseExecOutputLog(engine, owner="server-a", flush_interval=0.02, poll_interval=0.02)
    yield log
    await log.aclose()


async def test_a_reader_on_another_process_resumes_the_output(
    db_log: DatabaseExecOutputLog, db_url: str
) -> None:
    other_engine = open_engine(db_url)  # its own connections, as another process has
    other = DatabaseExecOutputLog(other_engine, owner="server-b", poll_interval=0.02)
    try:
        await db_log.open("e1", tenant="t", sandbox_id="sb", intent_id="sha256:i")
        await _write(db_log, "e1", ("stdout", b"one"), ("stdout", b"two"))
        page = await other.read("e1", tenant="t", after=-1, wait=5)  # flushed within ~20 ms
        assert [c.data for c in page.chunks] == [b"one", b"two"]
        assert page.outcome is None
        await _write(db_log, "e1", ("stderr", b"three"))
        await db_log.finish("e1", OK)
        rest = await other.read("e1", tenant="t", after=1, wait=5)
        assert [c.data for c in rest.chunks] == [b"three"]
        assert rest.outcome == OK
        run = ExecRuns(other_engine, owner="x").get("e1")
        assert (run.state, run.exit_code, run.chunk_count, run.intent_id) == (
            "finished",
            0,
            3,
            "sha256:i",
        )
    finally:
        await db_log.aclose()
        await other.aclose()
        other_engine.dispose()


async def test_appends_are_batched_not_committed_one_by_one(engine: Engine) -> None:
    commits: list[int] = []
    event.listen(engine, "commit", lambda _conn: commits.append(1))
    log = DatabaseExecOutputLog(engine, flush_interval=0.05)
    try:
        await log.open("e1", tenant="t", sandbox_id="sb")
        opened = len(commits)
        for i in range(2000):
            await log.append("e1", "stdout", b"line %d\n" % i)
            if i % 200 == 0:
                await anyio.sleep(0.01)  # let the flusher run now and then, as real output does
        await log.finish("e1", OK)
    finally:
        await log.aclose()
    assert len(commits) - opened <= 12, len(commits) - opened
    with engine.connect() as conn:
        seqs = conn.execute(select(exec_chunks.c.seq).order_by(exec_chunks.c.seq)).scalars()
        assert list(seqs) == list(range(2000))


async def test_finish_writes_every_chunk_before_the_outcome(engine: Engine, db_url: str) -> None:
    log = DatabaseExecOutputLog(engine, flush_interval=3600)  # never flushes on its own
    await log.open("e1", tenant="t", sandbox_id="sb")
    await _write(log, "e1", ("stdout", b"a"), ("stdout", b"b"))
    reader = ExecRuns(engine, owner="reader")
    assert reader.read("e1", tenant="t", after=-1).chunks == []
    await log.finish("e1", OK)
    page = reader.read("e1", tenant="t", after=-1)
    assert [(c.offset, c.data) for c in page.chunks] == [(0, b"a"), (1, b"b")]
    assert page.done
    await log.aclose()


async def test_stream_offsets_count_each_stream(db_log: DatabaseExecOutputLog) -> None:
    await db_log.open("e1", tenant="t", sandbox_id="sb")
    await _write(db_log, "e1", ("stdout", b"abc"), ("stderr", b"zz"), ("stdout", b"de"))
    await db_log.finish("e1", OK)
    page = db_log.runs.read("e1", tenant="t", after=-1)
    assert [(c.stream, c.offset) for c in page.chunks] == [
        ("stdout", 0),
        ("stderr", 0),
        ("stdout", 3),
    ]
    await db_log.aclose()


async def test_retention_sweeps_finished_runs(engine: Engine) -> None:
    log = DatabaseExecOutputLog(engine, retention=0.05)
    await log.open("e1", tenant="t", sandbox_id="sb")
    await log.open("e2", tenant="t", sandbox_id="sb")
    await log.finish("e1", OK)
    await anyio.sleep(0.1)
    assert log.sweep() == 1
    with pytest.raises(NotFound):
        await log.read("e1", tenant="t", after=-1, wait=0)
    assert (await log.read("e2", tenant="t", after=-1, wait=0)).outcome is None  # running: kept
    await log.aclose()


async def test_a_read_past_the_retention_is_expired_then_not_found(engine: Engine) -> None:
    log = DatabaseExecOutputLog(engine, retention=0.2)
    await log.open("e1", tenant="t", sandbox_id="sb")
    await log.append("e1", "stdout", b"hi")
    await log.finish("e1", OK)
    assert (await log.read("e1", tenant="t", after=-1, wait=0)).outcome == OK
    await anyio.sleep(0.3)
    with pytest.raises(OutputExpired, match="expired"):  # not swept yet: still 410, not served
        await log.read("e1", tenant="t", after=-1, wait=0)
    with anyio.move_on_after(1):  # the upkeep the server runs sweeps it
        await log.run_upkeep()
    with pytest.raises(NotFound):
        await log.read("e1", tenant="t", after=-1, wait=0)
    await log.aclose()


async def test_a_result_with_output_over_the_cap_is_not_served_cut(
    engine: Engine, db_url: str
) -> None:
    log = DatabaseExecOutputLog(engine, max_bytes=12, flush_interval=0.02)
    big = {"exit_code": 3, "stdout": "x" * 10, "stderr": "y" * 10}
    await log.open("e1", tenant="t", sandbox_id="sb")
    await log.append("e1", "stdout", b"x" * 10)
    await log.append("e1", "stderr", b"y" * 10)
    await log.finish("e1", ExecOutcome(result=big))
    # The client of this server, reading its stream to the end, gets the whole result.
    live = await log.read("e1", tenant="t", after=0, wait=0)
    assert live.outcome == ExecOutcome(result=big)
    # A reader elsewhere (or later) is told the outcome was not kept, with its exit code.
    other_engine = open_engine(db_url)
    other = DatabaseExecOutputLog(other_engine)
    try:
        with pytest.raises(OutputExpired, match="20 bytes") as err:
            await other.read("e1", tenant="t", after=0, wait=0)
        assert err.value.details["exit_code"] == 3
    finally:
        await other.aclose()
        other_engine.dispose()
        await log.aclose()
    stored = ExecRuns(engine, owner="x").get("e1").result
    assert stored is not None
    assert (stored["stdout"], stored["stderr"]) == ("", "")


SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from sandlot.server.outputlog import DatabaseExecOutputLog
    from sandlot.store.sql import open_engine

    async def main():
        log = DatabaseExecOutputLog(open_engine(sys.argv[1]), flush_interval=3600)
        await log.open("crashed", tenant="t", sandbox_id="sb")
        for i in range(3):
            await log.append("crashed", "stdout", b"line %d\\n" % i)
        await log.flush()
        await log.append("crashed", "stdout", b"never flushed")
        print("ready", flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


async def test_runs_of_a_killed_server_are_unknown_and_not_rerun(
    db_log: DatabaseExecOutputLog, db_url: str
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, db_url], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"ready"
        await db_log.open("mine", tenant="t", sandbox_id="sb")  # this process: alive
        assert await db_log.mark_unknown_abandoned() == []  # the server still runs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert await db_log.mark_unknown_abandoned() == ["crashed"]
        assert await db_log.mark_unknown_abandoned() == []
        page = await db_log.read("crashed", tenant="t", after=-1, wait=1)
        assert [c.data for c in page.chunks] == [b"line 0\n", b"line 1\n", b"line 2\n"]
        assert page.outcome is not None
        assert page.outcome.result is None
        error = page.outcome.error
        assert error is not None
        assert error["code"] == "backend_unavailable"
        assert error["details"] == {"outcome": "unknown"}
        assert db_log.runs.get("crashed").state == "unknown"
        mine = await db_log.read("mine", tenant="t", after=-1, wait=0)
        assert mine.outcome is None  # a live owner's run is untouched
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_owner_alive_tells_dead_from_reused() -> None:
    from sandlot.journal import owner_alive, process_owner

    me = process_owner()
    assert owner_alive(me)
    host, pid, ticks = me.split(":")
    assert not owner_alive(f"{host}:{pid}:{int(ticks) + 1}")  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not owner_alive(f"{host}:{child.pid}:1")
    assert owner_alive(f"another-host:{pid}:{ticks}")  # cannot know: treated as alive


async def test_error_outcome_round_trips(db_log: DatabaseExecOutputLog) -> None:
    streams: list[Literal["stdout", "stderr"]] = ["stdout", "stderr"]
    await db_log.open("e1", tenant="t", sandbox_id="sb")
    for s in streams:
        await db_log.append("e1", s, s.encode())
    await db_log.finish("e1", ExecOutcome(error={"code": "timeout"}))
    page = await db_log.read("e1", tenant="t", after=-1, wait=0)
    assert [c.stream for c in page.chunks] == streams
    assert page.outcome == ExecOutcome(error={"code": "timeout"})
    await db_log.aclose()
