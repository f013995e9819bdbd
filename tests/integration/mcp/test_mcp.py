"""The MCP tools through the official MCP client, over stdio (``sandlot mcp`` as a subprocess)
and over streamable HTTP (``/mcp`` on a real server, behind API keys)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from sandlot import PolicyDenied
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

TOOLS = {
    "create_sandbox",
    "list_sandboxes",
    "get_sandbox",
    "delete_sandbox",
    "stop_sandbox",
    "keep_alive",
    "exec_command",
    "read_file",
    "write_file",
    "list_files",
    "get_logs",
    "expose_port",
    "list_exposed_ports",
    "snapshot_sandbox",
    "upload_dir",
    "run_agent",
    "version",
    "health",
}


@pytest.fixture
def server(tmp_path: Path) -> AsyncIterator[ServerThread]:
    fake = FakeBackend()
    with ServerThread(tmp_path / "srv", backends={"fake": fake}) as s:
        s.fake = fake  # type: ignore[attr-defined]
        yield s  # type: ignore[misc]


@asynccontextmanager
async def http_client(server: ServerThread, key: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
    async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
        yield c


@asynccontextmanager
async def stdio_client(home: Path, share: Path) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "sandlot", "mcp", "--share", str(share)],
        env={
            "SANDLOT_HOME": str(home),
            "SANDLOT_BACKEND": "fake",
            "PATH": os.environ.get("PATH", ""),
        },
    )
    async with Client(params, read_timeout_seconds=60) as c:
        yield c


async def _walk(client: Client, *, share: Path | None) -> str:
    """Every tool once, as a model would use them; returns the sandbox id."""
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    assert tools["list_sandboxes"].annotations.read_only_hint is True
    assert tools["read_file"].annotations.read_only_hint is True
    assert tools["delete_sandbox"].annotations.destructive_hint is True
    assert tools["exec_command"].annotations.destructive_hint is True
    assert tools["create_sandbox"].annotations.destructive_hint is False
    assert tools["get_sandbox"].output_schema is not None

    created = await client.call_tool(
        "create_sandbox", {"setup": "echo ready", "labels": {"via": "mcp"}}
    )
    assert not created.is_error, created.content
    sid = created.structured_content["id"]
    assert created.structured_content["status"] == "running"

    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    ran = await client.call_tool(
        "exec_command", {"sandbox_id": sid, "command": "echo hello"}, progress_callback=on_progress
    )
    assert not ran.is_error, ran.content
    assert ran.structured_content["exit_code"] == 0
    assert ran.structured_content["stdout"] == "hello\n"
    assert progress == ["stdout: hello\n"]
    failed = await client.call_tool("exec_command", {"sandbox_id": sid, "command": ["false"]})
    assert failed.structured_content["exit_code"] == 1

    wrote = await client.call_tool(
        "write_file", {"sandbox_id": sid, "path": "/workspace/notes.txt", "content": "abcdef"}
    )
    assert wrote.structured_content["size"] == 6
    page = await client.call_tool(
        "read_file",
        {"sandbox_id": sid, "path": "/workspace/notes.txt", "offset": 2, "max_bytes": 3},
    )
    assert page.structured_content["content"] == "cde"
    assert page.structured_content["eof"] is False
    rest = await client.call_tool(
        "read_file", {"sandbox_id": sid, "path": "/workspace/notes.txt", "offset": 5}
    )
    assert (rest.structured_content["content"], rest.structured_content["eof"]) == ("f", True)
    binary = await client.call_tool(
        "write_file",
        {"sandbox_id": sid, "path": "/workspace/b", "content": "/wA=", "encoding": "base64"},
    )
    assert not binary.is_error
    read_binary = await client.call_tool("read_file", {"sandbox_id": sid, "path": "/workspace/b"})
    assert read_binary.structured_content["encoding"] == "base64"
    listed = await client.call_tool("list_files", {"sandbox_id": sid})
    assert [e["name"] for e in listed.structured_content["entries"]] == ["b", "notes.txt"]

    logs = await client.call_tool("get_logs", {"sandbox_id": sid})
    assert logs.structured_content["next_offset"] == 0
    port = await client.call_tool("expose_port", {"sandbox_id": sid, "port": 3000})
    assert port.structured_content["port"] == 3000
    ports = await client.call_tool("list_exposed_ports", {"sandbox_id": sid})
    assert [p["port"] for p in ports.structured_content["ports"]] == [3000]
    snap = await client.call_tool("snapshot_sandbox", {"sandbox_id": sid})
    assert snap.structured_content["id"].startswith("snap-")
    alive = await client.call_tool("keep_alive", {"sandbox_id": sid, "seconds": 120})
    assert alive.structured_content["expires_at"] is None  # no TTL was set, none is invented
    many = await client.call_tool("list_sandboxes", {"labels": {"via": "mcp"}})
    assert [s["id"] for s in many.structured_content["sandboxes"]] == [sid]
    assert (await client.call_tool("health", {})).structured_content["status"] == "ok"
    assert (await client.call_tool("version", {})).structured_content["version"]

    if share is not None:
        uploaded = await client.call_tool(
            "upload_dir",
            {"sandbox_id": sid, "local_path": str(share), "remote_path": "/workspace/proj"},
        )
        assert not uploaded.is_error, uploaded.content
        assert uploaded.structured_content["files"] == 2
        got = await client.call_tool(
            "read_file", {"sandbox_id": sid, "path": "/workspace/proj/sub/b.txt"}
        )
        assert got.structured_content["content"] == "bee"
    outside = await client.call_tool(
        "upload_dir", {"sandbox_id": sid, "local_path": "/etc", "remote_path": "/workspace/etc"}
    )
    assert outside.is_error
    assert outside.structured_content["error"]["code"] == "invalid_request"

    missing = await client.call_tool("get_sandbox", {"sandbox_id": "sb-000000000000"})
    assert missing.is_error
    assert missing.structured_content["error"]["code"] == "not_found"
    stopped = await client.call_tool("stop_sandbox", {"sandbox_id": sid})
    assert stopped.structured_content["status"] == "stopped"
    shown = await client.call_tool("get_sandbox", {"sandbox_id": sid})
    assert shown.structured_content["death_cause"] == "stopped"
    return sid


def _share(tmp_path: Path) -> Path:
    share = tmp_path / "share" / "proj"
    (share / "sub").mkdir(parents=True)
    (share / "a.txt").write_text("ay")
    (share / "sub" / "b.txt").write_text("bee")
    (share / "link").symlink_to("/etc/passwd")
    return share


async def test_stdio_walk(tmp_path: Path) -> None:
    share = _share(tmp_path)
    async with stdio_client(tmp_path / "home", share.parent) as client:
        sid = await _walk(client, share=share)
        gone = await client.call_tool("delete_sandbox", {"sandbox_id": sid})
        assert gone.structured_content["status"] == "destroyed"
        version = await client.call_tool("version", {})
        assert version.structured_content["mode"] == "embedded"


async def test_http_walk_run_agent_and_policy_denial(server: ServerThread) -> None:
    key = server.new_key("mcp-tenant")
    async with http_client(server, key) as client:
        sid = await _walk(client, share=None)
        started = await client.call_tool(
            "run_agent", {"sandbox_id": sid, "command": "echo agent says hi"}
        )
        assert not started.is_error, started.content
        handle = started.structured_content
        assert handle["pid"] > 0
        assert handle["command"] == ["sh", "-c", "echo agent says hi"]
        (call,) = server.fake.calls_for(sid, "start_process")[-1:]  # type: ignore[attr-defined]
        assert call.args["argv"] == ["sh", "-c", "echo agent says hi"]
        assert not [c for c in server.fake.calls_for(sid, "exec") if "nohup" in str(c.args)]  # type: ignore[attr-defined]
        first = await client.call_tool(
            "get_logs", {"sandbox_id": sid, "process_id": handle["process_id"], "max_bytes": 6}
        )
        assert first.structured_content["data"] == "agent "
        more = await client.call_tool(
            "get_logs",
            {
                "sandbox_id": sid,
                "process_id": handle["process_id"],
                "offset": first.structured_content["next_offset"],
            },
        )
        assert more.structured_content["data"] == "says hi\n"
        assert (more.structured_content["running"], more.structured_content["exit_code"]) == (
            False,
            0,
        )
        await _run_agent_task_and_follow(client, server.fake, sid)  # type: ignore[attr-defined]

        server.fake.fail_next(  # type: ignore[attr-defined]
            "exec",
            PolicyDenied(
                "curl is not allowed here", reason_code="NETWORK_EGRESS", receipt_id="rc-42"
            ),
        )
        denied = await client.call_tool(
            "exec_command", {"sandbox_id": sid, "command": "curl example.com"}
        )
        assert denied.is_error
        error = denied.structured_content["error"]
        assert (error["code"], error["reason_code"], error["receipt_id"]) == (
            "policy_denied",
            "NETWORK_EGRESS",
            "rc-42",
        )
        assert "NETWORK_EGRESS" in denied.content[0].text
        gated = await client.call_tool("exec_command", {"sandbox_id": sid, "command": "rm -rf /"})
        assert gated.is_error
        assert gated.structured_content["error"]["code"] == "policy_denied"
        assert gated.structured_content["error"]["receipt_id"]

    other = server.new_key("someone-else")
    async with http_client(server, other) as client:
        hidden = await client.call_tool("get_sandbox", {"sandbox_id": sid})
        assert hidden.structured_content["error"]["code"] == "not_found"
        assert (await client.call_tool("list_sandboxes", {})).structured_content["sandboxes"] == []


async def _run_agent_task_and_follow(client: Client, fake: FakeBackend, sid: str) -> None:
    # The task goes to the program's standard input, which is then closed (`cat` echoes it
    # and exits at end of input).
    reader = await client.call_tool(
        "run_agent", {"sandbox_id": sid, "command": ["cat"], "task": "fix the tests"}
    )
    assert not reader.is_error, reader.content
    (fed,) = fake.calls_for(sid, "write_stdin")[-1:]
    assert (fed.args["data"], fed.args["close"]) == (b"fix the tests", True)
    logs = await client.call_tool(
        "get_logs", {"sandbox_id": sid, "process_id": reader.structured_content["process_id"]}
    )
    assert logs.structured_content["data"] == "fix the tests"
    assert logs.structured_content["running"] is False

    # A long-running program: get_logs waits for new output when asked to.
    agent = await client.call_tool(
        "run_agent", {"sandbox_id": sid, "command": "my-agent --serve", "name": "agent"}
    )
    pid = agent.structured_content["process_id"]
    assert agent.structured_content["name"] == "agent"
    empty = await client.call_tool("get_logs", {"sandbox_id": sid, "process_id": pid, "wait": 0.2})
    assert (empty.structured_content["data"], empty.structured_content["running"]) == ("", True)

    async def speak() -> None:
        await anyio.sleep(0.3)
        fake.emit_process_output(sid, pid, "step 1 done\n")

    async with anyio.create_task_group() as tg:
        tg.start_soon(speak)
        waited = await client.call_tool(
            "get_logs", {"sandbox_id": sid, "process_id": pid, "wait": 20}
        )
    assert waited.structured_content["data"] == "step 1 done\n"
    assert waited.structured_content["next_offset"] == len("step 1 done\n")
    unknown = await client.call_tool("get_logs", {"sandbox_id": sid, "process_id": "p-nope"})
    assert unknown.is_error
    assert unknown.structured_content["error"]["code"] == "not_found"


def test_http_mcp_needs_a_key(server: ServerThread) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    assert httpx.post(f"{server.url}/mcp", json=body).status_code == 401
    refused = httpx.post(
        f"{server.url}/mcp", json=body, headers={"Authorization": "Bearer sandlot_x"}
    )
    assert refused.status_code == 401
    assert refused.json()["code"] == "unauthenticated"


_MCP_ACCEPT = {"Accept": "application/json, text/event-stream"}


def _open_mcp_session(http: httpx.Client) -> str:
    """A session opened over raw HTTP, as any MCP client opens one: its ``mcp-session-id``."""
    hello = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"},
        },
    }
    opened = http.post("/mcp", json=hello, headers=_MCP_ACCEPT)
    assert opened.status_code == 200, opened.text
    session = opened.headers["mcp-session-id"]
    ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    headers = {**_MCP_ACCEPT, "mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}
    assert http.post("/mcp", json=ready, headers=headers).status_code == 202
    return session


def _in_session(http: httpx.Client, method: str, session: str) -> httpx.Response:
    headers = {**_MCP_ACCEPT, "mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}
    body = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    if method == "POST":
        return http.post("/mcp", json=body, headers=headers)
    if method == "GET":
        return http.get("/mcp", headers={**headers, "Accept": "text/event-stream"})
    return http.delete("/mcp", headers=headers)


def test_an_mcp_session_answers_only_the_key_that_opened_it(server: ServerThread) -> None:
    keys = {
        "owner": server.new_key("mcp-a"),
        "same tenant, other key": server.new_key("mcp-a"),
        "other tenant": server.new_key("mcp-b"),
    }
    clients = {
        who: httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {k}"}, timeout=30)
        for who, k in keys.items()
    }
    try:
        session = _open_mcp_session(clients["owner"])
        for who in ("same tenant, other key", "other tenant"):
            for method in ("POST", "GET", "DELETE"):
                taken = _in_session(clients[who], method, session)
                unknown = _in_session(clients[who], method, "0" * 32)
                assert taken.status_code == 404, (who, method, taken.text)
                # Exactly as an unknown session: nothing tells the id exists.
                assert (taken.status_code, taken.text) == (unknown.status_code, unknown.text)
        # The owner's session survived every attempt.
        listed = _in_session(clients["owner"], "POST", session)
        assert listed.status_code == 200
        assert "create_sandbox" in listed.text
        assert _in_session(clients["owner"], "DELETE", session).status_code == 200
    finally:
        for client in clients.values():
            client.close()


async def test_a_revoked_key_loses_its_mcp_stream(server: ServerThread) -> None:
    made = await server.keys.create("mcp-r")
    auth = {"Authorization": f"Bearer {made.key}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=30) as sync_http:
        session = _open_mcp_session(sync_http)
    headers = {
        **auth,
        "Accept": "text/event-stream",
        "mcp-session-id": session,
        "mcp-protocol-version": "2025-06-18",
    }
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        http.stream("GET", "/mcp", headers=headers) as stream,
    ):
        assert stream.status_code == 200
        await server.keys.revoke(made.info.id)
        revoked = anyio.current_time()
        with anyio.fail_after(5):
            tail = [line async for line in stream.aiter_lines()]
        took = anyio.current_time() - revoked
    assert took < 1.0, took
    assert "event: error" in tail, tail
    assert any("unauthenticated" in line for line in tail), tail
