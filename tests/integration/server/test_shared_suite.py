"""One suite, two implementations: the in-process SDK and the HTTP client against a real
server must behave the same way a user would notice, errors included."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from sandlot import (
    ExecFailed,
    InvalidRequest,
    InvalidState,
    NotFound,
    PolicyDenied,
    SandboxStatus,
)
from sandlot.client import AsyncClient
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend

S = SandboxStatus
Api = tuple[AsyncSandlot | AsyncClient, FakeBackend]


async def test_create_streams_setup_output_and_runs_start(api: Api) -> None:
    client, fake = api
    seen: list[bytes] = []
    sb = await client.create(
        setup=["echo one", "echo two"],
        start="sleep 1000",
        on_setup_output=lambda c: seen.append(c.data),
    )
    assert sb.status is S.RUNNING
    assert sb.info.setup_done
    assert b"".join(seen) == b"one\ntwo\n"
    (main,) = fake.calls_for(sb.id, "start_process")
    assert main.args["argv"] == ["sh", "-c", "sleep 1000"]
    quiet = await client.create(setup="echo three")
    assert quiet.status is S.RUNNING


async def test_failing_setup_raises_exec_failed_with_result(api: Api) -> None:
    client, _ = api
    label = {"suite": "setup-fails"}
    with pytest.raises(ExecFailed) as info:
        await client.create(setup=["echo before", "exit 3"], labels=label)
    assert info.value.result.exit_code == 3
    assert info.value.result.stdout == ""
    (sb,) = await client.list(status=S.FAILED, labels=label)
    assert sb.death is not None
    assert sb.death.cause == "setup_failed"
    assert sb.death.last_output == ["before"]


async def test_exec_streams_collects_and_check_raises(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    chunks: list[tuple[str, bytes]] = []
    texts: list[str] = []
    result = await sb.exec(
        ["chatty", "5", "0"],
        on_output=lambda c: chunks.append((c.stream, c.data)),
        on_stdout=texts.append,
    )
    assert result.exit_code == 0
    assert result.stdout == "".join(f"line {i}\n" for i in range(5))
    assert [d for _, d in chunks] == [f"line {i}\n".encode() for i in range(5)]
    assert "".join(texts) == result.stdout
    assert (await sb.exec("echo hi")).stdout == "hi\n"
    failed = await sb.exec("exit 4")
    assert failed.exit_code == 4
    with pytest.raises(ExecFailed) as info:
        await sb.exec("exit 5", check=True)
    assert info.value.result.exit_code == 5


async def test_exec_stdin_bytes_and_streamed(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    assert (await sb.exec("cat", stdin=b"all at once")).stdout == "all at once"

    async def pieces() -> AsyncIterator[bytes]:
        for part in (b"one ", b"two ", b"three"):
            await anyio.sleep(0.01)
            yield part

    assert (await sb.exec(["cat"], stdin=pieces())).stdout == "one two three"


async def test_bad_input_is_the_same_clear_error(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    with pytest.raises(InvalidRequest, match="cwd"):
        await sb.exec("true", cwd="relative/dir")
    with pytest.raises(InvalidRequest, match="timeout"):
        await sb.exec("true", timeout=0)
    with pytest.raises(InvalidRequest, match="workdir"):
        await client.create(workdir="not/absolute")
    with pytest.raises(InvalidRequest, match="backend"):
        await client.create(backend="no-such-backend")
    with pytest.raises(InvalidRequest, match="absolute"):
        await sb.read_file("relative.txt")


async def test_unknown_ids_are_not_found(api: Api) -> None:
    client, _ = api
    with pytest.raises(NotFound, match="sb-000000000000"):
        await client.get("sb-000000000000")
    with pytest.raises(NotFound):
        await client.delete_snapshot("snap-000000000000")
    with pytest.raises(NotFound):
        await client.fork("snap-000000000000")


async def test_files_round_trip(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    info = await sb.write_file("/workspace/a.txt", "héllo")
    assert (info.name, info.size) == ("a.txt", len("héllo".encode()))
    await sb.write_file("/workspace/bin/run", b"#!/bin/sh\n", mode=0o755)
    blob = bytes(range(256)) * 4096
    await sb.write_files({"/workspace/blob": blob, "/workspace/b.txt": "b"})
    assert await sb.read_file("/workspace/a.txt") == "héllo".encode()
    assert await sb.read_file("/workspace/blob") == blob
    assert b"".join([c async for c in sb.stream_file("/workspace/blob")]) == blob
    names = [f.name for f in await sb.list_files()]
    assert names == ["a.txt", "b.txt", "bin", "blob"]
    (run,) = await sb.list_files("/workspace/bin")
    assert run.mode == 0o755
    await sb.remove_file("/workspace/bin", recursive=True)
    with pytest.raises(NotFound):
        await sb.read_file("/workspace/bin/run")
    with pytest.raises(NotFound):
        await sb.list_files("/nowhere")


async def test_stop_resume_and_auto_resume(api: Api) -> None:
    client, fake = api
    sb = await client.create(start="serve")
    stopped = await sb.stop()
    assert stopped.status is S.STOPPED
    assert stopped.death is not None
    assert stopped.death.cause == "stopped"
    with pytest.raises(InvalidState):
        await sb.exec("true", auto_resume=False)
    assert (await sb.exec("echo back")).stdout == "back\n"
    assert (await sb.refresh()).status is S.RUNNING
    assert len(fake.calls_for(sb.id, "start")) == 1
    await sb.stop()
    assert (await sb.resume()).status is S.RUNNING


async def test_destroy_keeps_record_hidden_and_context_manager_destroys(api: Api) -> None:
    client, _ = api
    label = {"suite": "destroy"}
    sb = await client.create(labels=label)
    gone = await sb.destroy()
    assert gone.status is S.DESTROYED
    assert gone.death is not None
    assert gone.death.cause == "destroyed"
    assert await client.list(labels=label) == []
    assert [s.id for s in await client.list(labels=label, include_destroyed=True)] == [sb.id]
    async with await client.create(labels=label) as other:
        other_id = other.id
    assert (await client.get(other_id)).status is S.DESTROYED
    assert (await sb.destroy()).status is S.DESTROYED


async def test_keep_alive_extends_ttl(api: Api) -> None:
    client, _ = api
    sb = await client.create(timeout=60)
    before = sb.info.expires_at
    assert before is not None
    longer = await sb.keep_alive(3600)
    assert longer.expires_at is not None
    assert longer.expires_at > before
    assert sb.info.expires_at == longer.expires_at
    assert (await sb.keep_alive(10)).expires_at == longer.expires_at, "never shortens"
    assert (longer.expires_at - longer.created_at).total_seconds() > 3000


async def test_snapshot_restore_fork(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    await sb.write_file("/workspace/state", "v1")
    snap = await sb.snapshot()
    assert snap.sandbox_id == sb.id
    await sb.write_file("/workspace/state", "v2")
    assert (await sb.restore(snap.id)).status is S.RUNNING
    assert await sb.read_file("/workspace/state") == b"v1"
    kids = await client.fork(snap.id, 2)
    assert len(kids) == 2
    assert [await k.read_file("/workspace/state") for k in kids] == [b"v1", b"v1"]
    (kid,) = await sb.fork()
    assert kid.info.metadata["forked_from"].startswith("snap-")
    snaps = await client.list_snapshots(sb.id)
    assert snap.id in [s.id for s in snaps]
    await client.delete_snapshot(snap.id)
    assert snap.id not in [s.id for s in await client.list_snapshots(sb.id)]


async def test_ports(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    mapping = await sb.expose_port(8080)
    assert mapping.port == 8080
    assert mapping.url.startswith("http://127.0.0.1:")
    assert [p.port for p in sb.info.ports] == [8080]
    assert await sb.list_ports() == [mapping]
    with pytest.raises(InvalidRequest):
        await sb.expose_port(70000)


async def test_logs_and_follow(api: Api) -> None:
    client, fake = api
    sb = await client.create(start="serve")
    fake.emit_log(sb.id, "first\n")
    assert b"".join([c async for c in sb.logs()]) == b"first\n"
    assert b"".join([c async for c in sb.logs(offset=2)]) == b"rst\n"
    got = bytearray()

    async def later() -> None:
        await anyio.sleep(0.2)
        fake.emit_log(sb.id, "second\n")

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        with anyio.fail_after(10):
            async for chunk in sb.logs(follow=True):
                got += chunk
                if b"second" in got:
                    break
    assert bytes(got) == b"first\nsecond\n"


async def test_policy_denial_crosses_with_reason_and_receipt(api: Api) -> None:
    client, fake = api
    sb = await client.create()
    # The gate's own denial: the command never reaches the backend, and a receipt says why.
    before = len(fake.calls_for(sb.id, "exec"))
    with pytest.raises(PolicyDenied) as info:
        await sb.exec("rm -rf /")
    assert info.value.reason_code
    assert info.value.receipt_id
    assert len(fake.calls_for(sb.id, "exec")) == before
    # A denial raised further down keeps its reason and receipt across HTTP too.
    fake.fail_next("exec", PolicyDenied("not today", reason_code="DESTRUCTIVE", receipt_id="rc-1"))
    with pytest.raises(PolicyDenied) as again:
        await sb.exec("echo harmless")
    assert (again.value.reason_code, again.value.receipt_id) == ("DESTRUCTIVE", "rc-1")
    assert str(again.value) == "not today"


async def test_write_file_streams_a_file_object_and_chunks(api: Api, tmp_path) -> None:  # type: ignore[no-untyped-def]
    client, _ = api
    sb = await client.create()
    source = tmp_path / "big.bin"
    source.write_bytes(bytes(range(256)) * 20_000)
    with open(source, "rb") as f:
        info = await sb.write_file("/workspace/big.bin", f)
    assert info.size == 5_120_000
    assert await sb.read_file("/workspace/big.bin") == source.read_bytes()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"one "
        yield b"two"

    await sb.write_file("/workspace/two.txt", chunks())
    assert await sb.read_file("/workspace/two.txt") == b"one two"


async def test_a_failed_create_names_the_sandbox_it_left(api: Api) -> None:
    client, _ = api
    with pytest.raises(ExecFailed) as failed:
        await client.create(setup="exit 4", labels={"suite": "named"})
    (sb,) = await client.list(status=S.FAILED, labels={"suite": "named"})
    assert failed.value.sandbox_id == sb.id
    assert sb.id in str(failed.value)
    assert failed.value.details["kept_until"]


async def test_async_with_create_destroys_on_exit(api: Api) -> None:
    """Issue 13 item 16: ``async with client.create()`` needed ``async with await``."""
    client, _ = api
    async with client.create(labels={"suite": "async-with"}) as sb:
        assert (await sb.exec("echo in")).stdout == "in\n"
    (gone,) = await client.list(labels={"suite": "async-with"}, include_destroyed=True)
    assert gone.status is S.DESTROYED
    handle = await client.create()  # awaiting it still gives the handle
    assert handle.status is S.RUNNING


async def test_create_is_a_coroutine_and_a_cancelled_async_with_still_destroys(api: Api) -> None:
    client, _ = api
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.create)  # a plain coroutine to task runners
    label = {"suite": "cancelled-with"}
    with anyio.move_on_after(0.5):
        async with client.create(labels=label):
            await anyio.sleep(30)  # cancelled here: the sandbox must still be destroyed
    (gone,) = await client.list(labels=label, include_destroyed=True)
    assert gone.status is S.DESTROYED
