"""Strict enforcement through every entry point: however the wipe reaches the sandbox, its
``execve`` of ``rm`` stops in the kernel and the gate denies it.

``rm -rf --no-preserve-root /`` is sent through a background process (a shell fed on stdin),
a terminal (a shell and a Python prompt, typed), the MCP tools (``exec_command``,
``run_agent``, ``write_file`` then ``exec_command``) run in-process over the same SDK, and the
file API (a script written, then run). Each must fail with EPERM inside, leave the sandbox's
files where they were, and leave a DENY receipt for ``exec.program`` naming rm and its
arguments. These spellings all pass the command gate: only strict mode sees the program.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import Context

from sandlot.backends.local import LocalBackend
from sandlot.mcp.server import SandlotApi, build_server
from sandlot.receipts.receipt import Receipt
from sandlot.sdk import AsyncSandbox, AsyncSandlot

STRICT = {"local": {"enforcement": "strict"}}
WIPE = "rm -rf --no-preserve-root /"
ARGV = WIPE.split()
DENIED = ("Operation not permitted", "[Errno 1]")


class Strict:
    def __init__(self, client: AsyncSandlot, sb: AsyncSandbox, receipts: list[Receipt]) -> None:
        self.client, self.sb, self.receipts = client, sb, receipts

    def denied_rm(self) -> list[str]:
        return [
            str(r.body.get("detail"))
            for r in self.receipts
            if r.body.get("op") == "exec.program" and r.body.get("decision") == "DENY"
        ]

    async def mcp(self, tool: str, args: dict[str, object]) -> dict[str, object]:
        async def provider(ctx: Context) -> SandlotApi:
            return self.client

        async with Client(build_server(provider)) as mcp:
            result = await mcp.call_tool(tool, {"sandbox_id": self.sb.id, **args})
        assert not result.is_error, result.content
        assert result.structured_content is not None
        return result.structured_content


@pytest.fixture(scope="module")
async def strict(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Strict]:
    home = tmp_path_factory.mktemp("home")
    backend = LocalBackend(home / "local", cache=tmp_path_factory.mktemp("cache"))
    receipts: list[Receipt] = []
    client = AsyncSandlot(home, backends={"local": backend}, on_receipt=receipts.append)
    try:
        sb = await client.create(network="deny-all", backend_options=STRICT)
        await sb.write_file("/workspace/keep.txt", "still here\n")
        yield Strict(client, sb, receipts)
        await sb.destroy()
    finally:
        await client.aclose()


async def _process_output(s: Strict, process_id: str) -> str:
    await s.sb.wait_process(process_id, timeout=60)
    chunks = [c.data async for c in s.sb.process_output(process_id)]
    return b"".join(chunks).decode(errors="replace")


async def background_shell_on_stdin(s: Strict) -> str:
    proc = await s.sb.start_process("sh")
    await s.sb.write_stdin(proc.id, f"{WIPE}; echo rc=$?\n", close=True)
    out = await _process_output(s, proc.id)
    assert "rc=1" in out or "rc=126" in out, out
    return out


async def _typed(s: Strict, command: list[str] | None, lines: list[str], until: bytes) -> str:
    async with await s.sb.open_pty(command) as term:
        for line in lines:
            await term.write(f"{line}\r".encode())
        seen = b""
        with anyio.fail_after(30):
            while until not in seen:
                data = await term.read()
                assert data, seen
                seen += data
        await term.wait(timeout=30)
    return seen.decode(errors="replace")


async def terminal_shell(s: Strict) -> str:
    return await _typed(s, None, [f"{WIPE}; echo rc=$?", "exit"], b"rc=126")


async def terminal_python(s: Strict) -> str:
    lines = [
        "import subprocess",
        f"try: subprocess.run({ARGV})\nexcept OSError as e: print('failed', e.errno, e.strerror)\n",
        "exit()",
    ]
    return await _typed(s, ["python3", "-i"], lines, b"failed 1")


async def mcp_exec_command(s: Strict) -> str:
    out = await s.mcp("exec_command", {"command": f"echo '{WIPE}' | sh"})
    assert out["exit_code"] != 0
    return str(out["stderr"])


async def mcp_run_agent(s: Strict) -> str:
    handle = await s.mcp("run_agent", {"command": "sh", "task": f"{WIPE}\n"})
    await s.sb.wait_process(str(handle["process_id"]), timeout=60)
    logs = await s.mcp("get_logs", {"process_id": handle["process_id"]})
    assert logs["exit_code"] != 0
    return str(logs["data"])


async def mcp_write_file_then_exec(s: Strict) -> str:
    await s.mcp("write_file", {"path": "/workspace/mcp-wipe.sh", "content": f"{WIPE}\n"})
    out = await s.mcp("exec_command", {"command": "sh /workspace/mcp-wipe.sh"})
    assert out["exit_code"] != 0
    return str(out["stderr"])


async def file_api_script(s: Strict) -> str:
    await s.sb.write_file("/workspace/api-wipe.sh", f"#!/bin/sh\n{WIPE}\n", mode=0o755)
    result = await s.sb.exec(["/workspace/api-wipe.sh"], timeout=60)
    assert result.exit_code != 0
    return result.stderr


@pytest.mark.parametrize(
    "entry",
    [
        background_shell_on_stdin,
        terminal_shell,
        terminal_python,
        mcp_exec_command,
        mcp_run_agent,
        mcp_write_file_then_exec,
        file_api_script,
    ],
    ids=lambda f: f.__name__,
)
async def test_a_wipe_is_denied_through_every_entry_point(
    strict: Strict, entry: Callable[[Strict], Awaitable[str]]
) -> None:
    before = len(strict.denied_rm())
    out = await entry(strict)
    assert any(d in out for d in DENIED), out
    assert (await strict.sb.read_file("/workspace/keep.txt")) == b"still here\n"
    assert int((await strict.sb.exec("ls /usr/bin | wc -l")).stdout) > 50
    await strict.client.manager.flush_receipts()
    denials = strict.denied_rm()[before:]
    assert denials, "no DENY receipt for the exec of rm"
    assert all(f"/rm {WIPE.removeprefix('rm ')}'" in d for d in denials), denials
