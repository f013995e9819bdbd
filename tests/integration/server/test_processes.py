"""Background processes and terminals, the same through the in-process SDK and through the HTTP
client (SSE for output, a WebSocket for terminals), errors included."""

from __future__ import annotations

import json

import anyio
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from sandlot import InvalidRequest, InvalidState, NotFound, PolicyDenied, SandboxTimeout
from sandlot.client import AsyncClient
from sandlot.sdk import AsyncSandlot
from sandlot.server.testing import ServerThread
from sandlot.terminal import AsyncTerminal
from sandlot.testing import FakeBackend

Api = tuple[AsyncSandlot | AsyncClient, FakeBackend]


async def test_start_list_signal_wait(api: Api) -> None:
    client, fake = api
    sb = await client.create(start="serve")
    worker = await sb.start_process("sleep 1000", name="worker", env={"MODE": "bg"})
    assert worker.running
    assert worker.name == "worker"
    (call,) = [c for c in fake.calls_for(sb.id, "start_process") if c.args["name"] == "worker"]
    assert call.args["argv"] == ["sh", "-c", "sleep 1000"]
    listed = {p.id: p for p in await sb.list_processes()}
    assert {p.name for p in listed.values()} >= {"main", "worker"}
    assert listed[worker.id].running

    await sb.signal_process(worker.id)
    done = await sb.wait_process(worker.id, timeout=10)
    assert (done.running, done.exit_code) == (False, 128 + 15)
    with pytest.raises(InvalidState):
        await sb.signal_process(worker.id, 9)
    quick = await sb.start_process(["echo", "done"])
    assert (await sb.wait_process(quick.id, timeout=10)).exit_code == 0


async def test_output_stdin_follow_and_offsets(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    cat = await sb.start_process("cat")
    await sb.write_stdin(cat.id, b"one\n")
    await sb.write_stdin(cat.id, "two\n")
    chunks = [c async for c in sb.process_output(cat.id)]
    assert [(c.seq, c.data) for c in chunks] == [(0, b"one\n"), (1, b"two\n")]
    assert [c.data async for c in sb.process_output(cat.id, offset=1)] == [b"two\n"]

    followed: list[bytes] = []

    async def more() -> None:
        await anyio.sleep(0.2)
        await sb.write_stdin(cat.id, b"three\n", close=True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(more)
        with anyio.fail_after(20):
            # Follows until the process exits (closing its stdin ends `cat`), then stops.
            followed += [c.data async for c in sb.process_output(cat.id, offset=1, follow=True)]
    assert followed == [b"two\n", b"three\n"]
    assert not (await sb.wait_process(cat.id, timeout=10)).running
    with pytest.raises(InvalidState):
        await sb.write_stdin(cat.id, b"too late")


async def test_followers_each_get_all_the_output_in_order(api: Api) -> None:
    # Over HTTP the followers of a process share one reader; each still gets every chunk,
    # numbered as the process numbers them, also one that joins late from an earlier offset.
    client, _ = api
    sb = await client.create()
    cat = await sb.start_process("cat")
    await sb.write_stdin(cat.id, b"one\n")
    got: dict[str, list[tuple[int, bytes]]] = {}

    async def follow(name: str, offset: int) -> None:
        got[name] = [
            (c.seq, c.data) async for c in sb.process_output(cat.id, offset=offset, follow=True)
        ]

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow, "first", 0)
            tg.start_soon(follow, "second", 0)
            await anyio.sleep(0.2)
            await sb.write_stdin(cat.id, b"two\n")
            await anyio.sleep(0.2)
            tg.start_soon(follow, "late", 1)
            await anyio.sleep(0.2)
            await sb.write_stdin(cat.id, b"three\n", close=True)
    everything = [(0, b"one\n"), (1, b"two\n"), (2, b"three\n")]
    assert got == {"first": everything, "second": everything, "late": everything[1:]}


async def test_errors_cross_as_the_same_classes(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    sleeper = await sb.start_process(["sleep", "1000"])
    with pytest.raises(SandboxTimeout):
        await sb.wait_process(sleeper.id, timeout=0.2)
    with pytest.raises(NotFound):
        await sb.signal_process("p-nope")
    with pytest.raises(NotFound):
        await sb.write_stdin("p-nope", b"x")
    with pytest.raises(NotFound):
        _ = [c async for c in sb.process_output("p-nope")]
    with pytest.raises(InvalidRequest, match="signal"):
        await sb.signal_process(sleeper.id, 0)
    with pytest.raises(InvalidRequest, match="cwd"):
        await sb.start_process("true", cwd="relative")
    with pytest.raises(InvalidRequest, match="rows"):
        await sb.open_pty(rows=0)
    with pytest.raises(PolicyDenied) as denied:
        await sb.start_process("rm -rf /")
    assert denied.value.receipt_id
    other = await client.create()
    await other.destroy()
    with pytest.raises(InvalidState):
        await other.list_processes()


async def _read_until(term: AsyncTerminal, needle: bytes) -> bytes:
    seen = b""
    with anyio.fail_after(20):
        while needle not in seen:
            data = await term.read()
            assert data, f"the terminal ended before {needle!r}; it showed {seen!r}"
            seen += data
    return seen


async def test_terminal_echo_resize_and_exit_code(api: Api) -> None:
    client, fake = api
    sb = await client.create()
    async with await sb.open_pty(rows=30, cols=90) as term:
        assert term.id
        assert term.sandbox_id == sb.id
        await term.write(b"echo hi\r")
        assert b"echo hi" in await _read_until(term, b"echo hi")
        await term.write("stty size\r")
        await _read_until(term, b"30 90")
        await term.resize(40, 100)
        await term.write(b"stty size\r")
        await _read_until(term, b"40 100")
        await term.write(b"exit 3\r")
        assert await term.wait(timeout=20) == 3
        assert term.exit_code == 3
        while await term.read(timeout=20):
            pass
    (opened,) = fake.calls_for(sb.id, "open_pty")
    assert opened.args["argv"] == ["sh"]


async def test_terminal_refusals_are_the_same_errors(api: Api) -> None:
    client, fake = api
    sb = await client.create()
    before = len(fake.calls_for(sb.id, "open_pty"))
    with pytest.raises(PolicyDenied) as denied:
        await sb.open_pty("rm -rf /")
    assert denied.value.reason_code
    assert denied.value.receipt_id
    assert len(fake.calls_for(sb.id, "open_pty")) == before
    async with await sb.open_pty(["sh"], cwd="/tmp", env={"A": "1"}) as fine:
        await fine.write(b"exit\r")
        assert await fine.wait(timeout=20) == 0
    await sb.destroy()
    with pytest.raises(InvalidState):
        await sb.open_pty()


async def test_terminal_hang_up_when_closed(api: Api) -> None:
    client, _ = api
    sb = await client.create()
    term = await sb.open_pty(["sh", "-i"])
    await term.write(b"echo still here\r")
    await _read_until(term, b"still here")
    await term.close()
    await term.close()  # twice is fine


async def test_terminal_websocket_protocol(server: ServerThread, tenant_key: str) -> None:
    """The wire protocol itself: JSON control frames, binary terminal bytes, exit then close."""
    async with AsyncClient(server.url, tenant_key) as client:
        sb = await client.create()
    url = server.url.replace("http://", "ws://") + f"/v1/sandboxes/{sb.id}/pty?rows=5&cols=7"
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with ws_connect(url, additional_headers=auth) as ws:
        opened = json.loads(await ws.recv())
        assert opened["type"] == "opened"
        assert opened["id"]
        await ws.send(json.dumps({"type": "resize", "rows": 0, "cols": 1}))
        refused = json.loads(await ws.recv())
        assert (refused["type"], refused["problem"]["code"]) == ("error", "invalid_request")
        await ws.send(b"stty size\r")
        seen = b""
        while b"5 7" not in seen:
            frame = await ws.recv()
            assert isinstance(frame, bytes), frame
            seen += frame
        await ws.send(b"exit 4\r")
        frames = [frame async for frame in ws]  # ends when the server closes normally
        assert json.loads(frames[-1]) == {"type": "exit", "exit_code": 4}
        assert all(isinstance(f, bytes) for f in frames[:-1])
    assert ws.close_code == 1000
    # Without a key, or with unknown parameters, the upgrade is refused with a problem.
    with pytest.raises(InvalidStatus) as nokey:
        async with ws_connect(url):
            pass
    assert nokey.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as bad:
        async with ws_connect(url + "&shell=zsh", additional_headers=auth):
            pass
    assert bad.value.response.status_code == 422
    assert json.loads(bad.value.response.body)["code"] == "invalid_request"
