"""Revoking an API key ends what it opened, on every server sharing the database: its event
streams and terminals close within a second, and its next request is refused at once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from sandlot.client import AsyncClient, Client
from sandlot.server import ServerConfig
from sandlot.server.keys import ApiKeyStore
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

pytestmark = pytest.mark.needs_postgres

SANDLOT = [sys.executable, "-m", "sandlot"]

DEADLINE = 1.0
"""Seconds within which a revoked key's open connections must have ended."""


def _server(home: Path, database: str) -> ServerThread:
    config = ServerConfig(sweep_interval=None, mcp=False)
    return ServerThread(home, backends={"fake": FakeBackend()}, config=config, database=database)


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    event = "message"
    async for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, line[6:]
            event = "message"


async def test_revoking_a_key_ends_its_streams_and_terminals_on_every_server(
    tmp_path: Path, pg_url: str
) -> None:
    with _server(tmp_path / "a", pg_url) as a, _server(tmp_path / "b", pg_url) as b:
        made = await a.keys.create("tenant-r")
        other = a.new_key("tenant-r")  # the same tenant's other key keeps working
        auth = {"Authorization": f"Bearer {made.key}"}
        async with AsyncClient(b.url, made.key) as client:
            sb = await client.create()
            cat = await sb.start_process("cat")
        ended: dict[str, float] = {}
        last: dict[str, object] = {}
        revoked_at: list[float] = []
        exec_ids: list[str] = []

        async def follow(name: str, response: httpx.Response) -> None:
            async for event, data in _sse_events(response.aiter_lines()):
                last[name] = (event, json.loads(data).get("code"))
                if event == "started":
                    exec_ids.append(json.loads(data)["exec_id"])
            ended[name] = time.monotonic()

        async def terminal(ws: ClientConnection) -> None:
            frames: list[str | bytes] = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    frames.append(await ws.recv())
            ended["terminal"] = time.monotonic()
            last["terminal"] = (ws.close_code, json.loads(frames[-1])["problem"]["code"])

        ws_url = b.url.replace("http://", "ws://") + f"/v1/sandboxes/{sb.id}/pty"
        async with (
            httpx.AsyncClient(base_url=b.url, headers=auth, timeout=30) as http,
            http.stream(
                "POST", f"/v1/sandboxes/{sb.id}/execs", json={"command": "sleep 30"}
            ) as exec_stream,
            http.stream(
                "GET", f"/v1/sandboxes/{sb.id}/processes/{cat.id}/output", params={"follow": True}
            ) as output_stream,
            ws_connect(ws_url, additional_headers=auth) as ws,
            anyio.create_task_group() as tg,
        ):
            assert exec_stream.status_code == output_stream.status_code == 200
            assert json.loads(await ws.recv())["type"] == "opened"
            await ws.send(b"echo before\r")
            tg.start_soon(follow, "exec events", exec_stream)
            tg.start_soon(follow, "process output", output_stream)
            tg.start_soon(terminal, ws)
            await anyio.sleep(0.3)
            assert ended == {}, "nothing may end before the revocation"

            await a.keys.revoke(made.info.id)
            revoked_at.append(time.monotonic())
            # New requests are refused at once, on the server that revoked and the other one.
            for server in (a, b):
                refused = await http.get(f"{server.url}/v1/sandboxes")
                assert refused.status_code == 401, (server.url, refused.text)
                assert refused.json()["code"] == "unauthenticated"
            with anyio.move_on_after(5):
                while len(ended) < 3:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

        took = {name: round(at - revoked_at[0], 3) for name, at in ended.items()}
        print(f"closed after revocation (s): {took}")
        assert set(took) == {"exec events", "process output", "terminal"}, took
        assert all(t < DEADLINE for t in took.values()), took
        # Each says why it ended: an error event, or an error frame and a policy close.
        assert last["exec events"] == ("error", "unauthenticated")
        assert last["process output"] == ("error", "unauthenticated")
        assert last["terminal"] == (1008, "unauthenticated")
        # The command the key started runs on: the tenant's other key can still end it.
        await _cancel(b.url, other, exec_ids[0])


async def _cancel(url: str, key: str, exec_id: str) -> None:
    """Cancel a running command with ``key`` and wait until it has ended."""
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as http:
        assert (await http.post(f"/v1/execs/{exec_id}/cancel")).status_code == 204
        async with http.stream("GET", f"/v1/execs/{exec_id}/events") as events:
            outcome = [e async for e in _sse_events(events.aiter_lines())][-1]
    assert outcome[0] == "error"
    assert json.loads(outcome[1])["details"]["cancelled"] is True


async def test_a_revocation_by_another_process_is_seen_at_once(pg_url: str) -> None:
    """Two servers' key stores on one database: one revokes, the other refuses the next use."""
    here, there = ApiKeyStore(pg_url), ApiKeyStore(pg_url)
    try:
        made = await here.create("tenant-x")
        assert await there.authenticate(made.key) is not None
        assert await here.authenticate(made.key) is not None
        await here.revoke(made.info.id)
        assert await there.authenticate(made.key) is None
        assert await here.authenticate(made.key) is None
    finally:
        await here.aclose()
        await there.aclose()


def test_cli_revoke_ends_the_key_on_a_running_server(tmp_path: Path, pg_url: str) -> None:
    """``sandlot api-keys revoke`` talks to no server: the server learns from the database."""
    with _server(tmp_path / "a", pg_url) as a:
        made = anyio.run(a.keys.create, "tenant-c")
        auth = {"Authorization": f"Bearer {made.key}"}
        with Client(a.url, made.key) as client:
            sb = client.create()
        with (
            httpx.Client(base_url=a.url, headers=auth, timeout=30) as http,
            http.stream(
                "POST", f"/v1/sandboxes/{sb.id}/execs", json={"command": "sleep 30"}
            ) as stream,
        ):
            lines = stream.iter_lines()
            assert next(lines).startswith("event: started")
            exec_id = json.loads(next(lines).removeprefix("data: "))["exec_id"]
            done = subprocess.run(
                [*SANDLOT, "--database", pg_url, "api-keys", "revoke", made.info.id],
                capture_output=True,
                text=True,
                env={**os.environ, "SANDLOT_HOME": str(tmp_path / "cli")},
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            revoked = time.monotonic()
            assert http.get("/v1/sandboxes").status_code == 401
            rest = list(lines)  # ends when the server ends the stream
            took = time.monotonic() - revoked
        assert took < DEADLINE, took
        assert "event: error" in rest, rest
        anyio.run(_cancel, a.url, a.new_key("tenant-c"), exec_id)


async def test_revocation_still_ends_streams_after_the_key_table_was_away(
    tmp_path: Path, pg_url: str
) -> None:
    """A database error while the server looks for revoked keys (here the key table is gone
    for a moment, as in a botched migration or restore) must not stop it looking."""
    import psycopg

    with _server(tmp_path / "a", pg_url) as a:
        made = await a.keys.create("tenant-w")
        auth = {"Authorization": f"Bearer {made.key}"}
        async with AsyncClient(a.url, made.key) as client:
            sb = await client.create()
            cat = await sb.start_process("cat")
        output = f"/v1/sandboxes/{sb.id}/processes/{cat.id}/output"
        async with (
            httpx.AsyncClient(base_url=a.url, headers=auth, timeout=30) as http,
            http.stream("GET", output, params={"follow": True}) as stream,
        ):
            assert stream.status_code == 200
            async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as db:
                await db.execute("ALTER TABLE api_keys RENAME TO api_keys_away")
                await anyio.sleep(1.2)  # a few rounds of looking fail meanwhile
                await db.execute("ALTER TABLE api_keys_away RENAME TO api_keys")
            await a.keys.revoke(made.info.id)
            revoked = time.monotonic()
            with anyio.move_on_after(5):
                tail = [line async for line in stream.aiter_lines()]
            took = time.monotonic() - revoked
        assert took < DEADLINE, took
        assert "event: error" in tail, tail


async def test_revocation_cuts_a_command_s_streamed_input(tmp_path: Path, pg_url: str) -> None:
    """Input streamed into a command is typing into it, as in a terminal: it stops too."""
    with _server(tmp_path / "a", pg_url) as a:
        made = await a.keys.create("tenant-i")
        other = a.new_key("tenant-i")
        auth = {"Authorization": f"Bearer {made.key}"}
        async with AsyncClient(a.url, made.key) as client:
            sb = await client.create()
        revoked: list[float] = []

        async def typing() -> AsyncIterator[bytes]:
            yield b"before\n"
            for _ in range(100):  # five seconds of it, unless cut
                await anyio.sleep(0.05)
                yield b"after\n" if revoked else b"before\n"

        async with (
            httpx.AsyncClient(base_url=a.url, headers=auth, timeout=30) as http,
            http.stream(
                "POST",
                f"/v1/sandboxes/{sb.id}/execs",
                json={"command": "cat", "stdin_stream": True},
            ) as events,
        ):
            event, data = await anext(_sse_events(events.aiter_lines()))
            assert event == "started"
            exec_id = json.loads(data)["exec_id"]

            async def feed() -> None:
                with contextlib.suppress(httpx.TransportError):
                    await http.put(f"/v1/execs/{exec_id}/stdin", content=typing())
                revoked.append(time.monotonic())

            async with anyio.create_task_group() as tg:
                tg.start_soon(feed)
                await anyio.sleep(0.3)
                await a.keys.revoke(made.info.id)
                revoked.append(time.monotonic())
        took = revoked[-1] - revoked[0]
        assert took < DEADLINE, took
        # The command saw its input end: it finished, and the tenant's other key reads it.
        async with (
            httpx.AsyncClient(
                base_url=a.url, headers={"Authorization": f"Bearer {other}"}, timeout=30
            ) as http,
            http.stream("GET", f"/v1/execs/{exec_id}/events") as rest,
        ):
            outcome = [e async for e in _sse_events(rest.aiter_lines())][-1]
        assert outcome[0] == "result", outcome
        assert json.loads(outcome[1])["stdout"].startswith("before\n")
