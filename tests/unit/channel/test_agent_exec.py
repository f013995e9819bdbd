"""exec through a real agent process: output, stdin, timeouts that kill whole trees, cancellation."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from sandlot.channel.client import AgentChannel, connect_unix
from sandlot.errors import BackendError, InvalidRequest, NotFound
from sandlot.models import OutputChunk

PY = "python3"


async def test_exec_collects_stdout_stderr_exit_code_and_duration(channel: AgentChannel) -> None:
    r = await channel.exec(["sh", "-c", "echo out; echo err >&2; sleep 0.05; exit 3"])
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    assert r.signal is None
    assert not r.timed_out
    assert 50 <= r.duration_ms < 5000


async def test_argv_with_odd_bytes_arrives_exactly(channel: AgentChannel) -> None:
    args = ["a b", "'\"$HOME`x`", "line\nbreak", "tab\there", "é✓", "-", "", "\udcff\udcfe"]
    script = "import os,sys; sys.stdout.write(repr([os.fsencode(a) for a in sys.argv[1:]]))"
    r = await channel.exec([PY, "-c", script, *args])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == repr([os.fsencode(a) for a in args])


async def test_env_is_merged_over_the_agent_default(channel: AgentChannel) -> None:
    r = await channel.exec(["sh", "-c", 'echo "$FOO|$PATH"'], env={"FOO": "bar baz"})
    foo, path = r.stdout.rstrip("\n").split("|")
    assert foo == "bar baz"
    assert "/usr/bin" in path


async def test_cwd_and_missing_cwd(channel: AgentChannel, tmp_path: Path) -> None:
    r = await channel.exec(["pwd"], cwd=str(tmp_path))
    assert r.stdout.strip() == str(tmp_path)
    with pytest.raises(NotFound):
        await channel.exec(["pwd"], cwd=str(tmp_path / "missing"))


async def test_missing_and_non_executable_programs(channel: AgentChannel, tmp_path: Path) -> None:
    r = await channel.exec(["no-such-program-xyz"])
    assert r.exit_code == 127
    assert "not found" in r.stderr
    script = tmp_path / "noexec.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    r = await channel.exec([str(script)])
    assert r.exit_code == 126


async def test_invalid_argv_is_rejected(channel: AgentChannel) -> None:
    with pytest.raises(InvalidRequest):
        await channel.exec([])
    with pytest.raises(InvalidRequest):
        await channel.exec(["echo", "nul\x00byte"])


async def test_stdin_bytes_stream_and_none(channel: AgentChannel) -> None:
    r = await channel.exec(["cat"], stdin=b"hello\x00world")
    assert r.stdout == "hello\x00world"

    async def pieces():
        for i in range(5):
            yield f"piece{i}\n".encode()
            await anyio.sleep(0.01)

    r = await channel.exec(["sh", "-c", "wc -l; echo done"], stdin=pieces())
    assert r.stdout.split() == ["5", "done"]
    # No stdin means /dev/null: cat sees end-of-file at once instead of hanging.
    with anyio.fail_after(10):
        r = await channel.exec(["cat"])
    assert r.exit_code == 0
    assert r.stdout == ""


async def test_large_stdin_while_output_flows_back(channel: AgentChannel) -> None:
    data = os.urandom(12 << 20)  # three windows: needs stdin and stdout to flow concurrently
    r = await channel.exec(["sh", "-c", "cat | od -An -v -tx1 | wc -l"], stdin=data)
    assert int(r.stdout) == (len(data) + 15) // 16


async def test_big_output_is_not_lost(channel: AgentChannel) -> None:
    size = 50 << 20
    chunks: list[OutputChunk] = []
    r = await channel.exec(
        ["sh", "-c", f"yes abcdefghi | head -c {size}; echo tail >&2"],
        on_output=chunks.append,
    )
    assert r.exit_code == 0
    assert len(r.stdout) == size
    assert r.stdout == ("abcdefghi\n" * (size // 10 + 1))[:size]
    assert r.stderr == "tail\n"
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum(len(c.data) for c in chunks if c.stream == "stdout") == size


async def test_output_callback_may_be_async_and_sees_both_streams_in_one_sequence(
    channel: AgentChannel,
) -> None:
    seen: list[tuple[int, str, bytes]] = []

    async def on_output(chunk: OutputChunk) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append((chunk.seq, chunk.stream, chunk.data))

    script = "echo a; sleep 0.05; echo b >&2; sleep 0.05; echo c"
    await channel.exec(["sh", "-c", script], on_output=on_output)
    assert [s[0] for s in seen] == list(range(len(seen)))
    assert [(s[1], s[2]) for s in seen] == [
        ("stdout", b"a\n"),
        ("stderr", b"b\n"),
        ("stdout", b"c\n"),
    ]


async def test_fifty_concurrent_execs_on_one_connection(channel: AgentChannel) -> None:
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        r = await channel.exec(["sh", "-c", 'sleep 0.2; echo "$0"', str(i)])
        results[i] = r.stdout

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, i)
    assert results == {i: f"{i}\n" for i in range(50)}


async def test_signal_exit_codes(channel: AgentChannel) -> None:
    r = await channel.exec(["sh", "-c", "kill -TERM $$"])
    assert (r.exit_code, r.signal) == (128 + signal.SIGTERM, signal.SIGTERM)
    r = await channel.exec(["sh", "-c", "kill -KILL $$"])
    assert (r.exit_code, r.signal) == (137, 9)
    r = await channel.exec(["sh", "-c", "exit 255"])
    assert (r.exit_code, r.signal) == (255, None)


async def test_timeout_kills_a_setsid_double_forked_tree(
    channel: AgentChannel, tmp_path: Path, survivors, eventually
) -> None:
    tag = f"TREE_{uuid.uuid4().hex}"
    pids = tmp_path / "pids"
    # A daemon that escapes the group and the session (setsid), one that double-forks and is
    # re-parented away from the command, and a plain child; each records its pid.
    script = f"""
setsid sh -c 'echo $$ >> {pids}; exec sleep 300' &
(sh -c 'echo $$ >> {pids}; exec sleep 300' &) &
sh -c 'echo $$ >> {pids}; exec sleep 300' &
sleep 300
"""
    r = await channel.exec(["sh", "-c", script], env={"TREE_TAG": tag}, timeout=1.0)
    assert r.timed_out
    assert r.exit_code == 124
    assert 900 <= r.duration_ms < 10_000
    recorded = [int(p) for p in pids.read_text().split()]
    assert len(recorded) == 3

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().split(b") ")[1][:1] == b"Z"
        except FileNotFoundError:
            return True

    assert eventually(lambda: all(gone(p) for p in recorded))
    assert eventually(lambda: survivors(tag) == [])


async def test_cancelling_the_caller_kills_the_remote_tree(
    channel: AgentChannel, survivors, eventually
) -> None:
    tag = f"CANCEL_{uuid.uuid4().hex}"
    with anyio.move_on_after(0.5):
        await channel.exec(["sh", "-c", "sleep 300 & sleep 300"], env={"CANCEL_TAG": tag})
        pytest.fail("the exec should have been cancelled")
    assert eventually(lambda: survivors(tag) == [])
    # The connection stays usable.
    assert (await channel.exec(["echo", "ok"])).stdout == "ok\n"


async def test_orphans_are_reaped_by_the_agent(
    channel: AgentChannel, agent, tmp_path, eventually
) -> None:
    out = tmp_path / "ppid"
    r = await channel.exec(["sh", "-c", f"(sh -c 'sleep 0.3; echo $PPID > {out}' &); exit 0"])
    assert r.exit_code == 0
    assert eventually(lambda: out.exists() and out.read_text().strip() != "")
    # Re-parented to the agent (a child subreaper), not to the host's init...
    assert int(out.read_text()) == agent.pid

    def zombies_of_agent() -> list[str]:
        found = []
        for name in sorted(p.name for p in Path("/proc").iterdir()):
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b") ", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] == b"Z" and int(fields[1]) == agent.pid:
                found.append(name)
        return found

    # ...and reaped by it.
    assert eventually(lambda: zombies_of_agent() == [])


async def test_closing_the_channel_fails_calls_and_kills_their_commands(
    agent, survivors, eventually
) -> None:
    tag = f"CLOSE_{uuid.uuid4().hex}"
    ch = await connect_unix(agent.sock)
    errors: list[BaseException] = []

    async def run() -> None:
        try:
            await ch.exec(["sleep", "300"], env={"CLOSE_TAG": tag})
        except BackendError as e:
            errors.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        assert await anyio.to_thread.run_sync(lambda: eventually(lambda: survivors(tag) != []))
        await ch.close()
    assert len(errors) == 1
    assert eventually(lambda: survivors(tag) == [])
    with pytest.raises(BackendError):
        await ch.exec(["true"])


async def test_agent_dying_mid_call_raises_backend_error(agent) -> None:
    ch = await connect_unix(agent.sock)

    async def kill_soon() -> None:
        await anyio.sleep(0.3)
        os.kill(agent.pid, signal.SIGKILL)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_soon)
        with pytest.raises(BackendError):
            await ch.exec(["sleep", "30"])
    await ch.close()
    agent.proc.wait()
    agent.proc.returncode = 0  # killed on purpose; the fixture checks for a clean exit


async def test_sigterm_kills_every_process_the_agent_started(agent, survivors, eventually) -> None:
    tag = f"TERM_{uuid.uuid4().hex}"
    ch = await connect_unix(agent.sock)
    await ch.start_process(["sh", "-c", "setsid sleep 300 & sleep 300"], env={"TERM_TAG": tag})

    async def doomed_exec() -> None:
        with pytest.raises(BackendError):
            await ch.exec(["sleep", "300"], env={"TERM_TAG": tag})

    async with anyio.create_task_group() as tg:
        tg.start_soon(doomed_exec)
        assert await anyio.to_thread.run_sync(lambda: eventually(lambda: len(survivors(tag)) == 4))
        os.kill(agent.pid, signal.SIGTERM)
        await anyio.to_thread.run_sync(agent.proc.wait, 10)
        tg.cancel_scope.cancel()
    await ch.close()
    assert agent.proc.returncode == 0
    assert eventually(lambda: survivors(tag) == [])
    assert not agent.sock.exists()
