"""Background processes and terminals through a real agent process."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import anyio
import pytest

from sandlot.channel.client import AgentChannel, connect_unix
from sandlot.channel.protocol import MAX_DATA, WINDOW, FrameType
from sandlot.errors import Conflict, InvalidState, NotFound, SandboxTimeout
from sandlot.models import OutputChunk


async def _collect(it) -> list[OutputChunk]:
    return [chunk async for chunk in it]


async def test_background_lifecycle_stdin_wait_and_reattach(channel: AgentChannel) -> None:
    script = 'echo one; echo two >&2; read x; echo "got $x"; exit 3'
    info = await channel.start_process(["sh", "-c", script], name="worker")
    assert info.running
    assert info.id.startswith("p-")
    assert info.command == ["sh", "-c", script]
    assert info.pid > 0
    listed = {p.id: p for p in await channel.list_processes()}
    assert listed[info.id].running

    await channel.write_stdin(info.id, b"hello\n", close=True)
    done = await channel.wait_process(info.id, timeout=10)
    assert (done.running, done.exit_code) == (False, 3)

    chunks = await _collect(channel.process_output(info.id))
    text = b"".join(c.data for c in chunks)
    assert text.count(b"one\n") == 1
    assert b"got hello\n" in text
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert {c.stream for c in chunks} == {"stdout", "stderr"}

    # Reattach from an offset: the same chunks, same numbers.
    tail = await _collect(channel.process_output(info.id, offset=1))
    assert [(c.seq, c.data) for c in tail] == [(c.seq, c.data) for c in chunks[1:]]
    # The name works as a handle too.
    assert (await channel.wait_process("worker")).exit_code == 3
    assert not {p.id: p for p in await channel.list_processes()}[info.id].running


async def test_follow_streams_output_until_exit(channel: AgentChannel) -> None:
    info = await channel.start_process(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"])
    with anyio.fail_after(10):
        chunks = await _collect(channel.process_output(info.id, follow=True))
    assert b"".join(c.data for c in chunks) == b"1\n2\n3\n"


async def test_offset_that_fell_out_of_the_buffer_starts_at_the_oldest_chunk(
    channel: AgentChannel,
) -> None:
    # ~12 MiB of output: more than the 8 MiB the agent keeps.
    script = "import sys\nfor i in range(3000): sys.stdout.write('%05d' % i + 'x' * 4091 + '\\n'); sys.stdout.flush()"
    info = await channel.start_process(["python3", "-c", script])
    await channel.wait_process(info.id, timeout=30)
    chunks = await _collect(channel.process_output(info.id, offset=0))
    assert chunks[0].seq > 0  # says how many chunks were lost
    assert [c.seq for c in chunks] == list(range(chunks[0].seq, chunks[0].seq + len(chunks)))
    data = b"".join(c.data for c in chunks)
    assert 7 << 20 < len(data) <= 8 << 20
    assert data.endswith(b"02999" + b"x" * 4091 + b"\n")


async def test_log_path_is_appended_across_processes(channel: AgentChannel, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "main.log"
    first = await channel.start_process(
        ["sh", "-c", "echo first; echo first-err >&2"], log_path=str(log)
    )
    await channel.wait_process(first.id, timeout=10)
    second = await channel.start_process(["echo", "second"], log_path=str(log))
    await channel.wait_process(second.id, timeout=10)
    lines = log.read_text().splitlines()
    assert sorted(lines[:2]) == ["first", "first-err"]
    assert lines[2:] == ["second"]


async def test_names_are_unique_among_running_processes(channel: AgentChannel) -> None:
    p = await channel.start_process(["sleep", "30"], name="svc")
    with pytest.raises(Conflict):
        await channel.start_process(["sleep", "30"], name="svc")
    await channel.signal_process(p.id, signal.SIGKILL)
    await channel.wait_process(p.id, timeout=10)
    again = await channel.start_process(["true"], name="svc")
    await channel.wait_process(again.id, timeout=10)


async def test_wait_timeout_unknown_ids_and_closed_stdin(channel: AgentChannel) -> None:
    p = await channel.start_process(["sleep", "30"])
    with pytest.raises(SandboxTimeout):
        await channel.wait_process(p.id, timeout=0.2)
    with pytest.raises(NotFound):
        await channel.wait_process("p-nope")
    with pytest.raises(NotFound):
        await channel.signal_process("p-nope", signal.SIGTERM)
    await channel.write_stdin(p.id, b"", close=True)
    with pytest.raises(InvalidState):
        await channel.write_stdin(p.id, b"more")
    await channel.signal_process(p.id, signal.SIGKILL)
    assert (await channel.wait_process(p.id, timeout=10)).exit_code == 137
    with pytest.raises(InvalidState):
        await channel.signal_process(p.id, signal.SIGTERM)


async def test_signal_reaches_the_whole_tree(channel: AgentChannel, survivors, eventually) -> None:
    tag = f"SIG_{uuid.uuid4().hex}"
    p = await channel.start_process(
        ["sh", "-c", "setsid sleep 300 & sleep 300 & wait"], env={"SIG_TAG": tag}
    )
    assert await anyio.to_thread.run_sync(lambda: eventually(lambda: len(survivors(tag)) == 3))
    await channel.signal_process(p.id, signal.SIGTERM)
    done = await channel.wait_process(p.id, timeout=10)
    assert done.exit_code == 128 + signal.SIGTERM
    assert eventually(lambda: survivors(tag) == [])


async def test_background_processes_outlive_the_connection(agent) -> None:
    a = await connect_unix(agent.sock)
    p = await a.start_process(["sleep", "30"], name="keeper")
    await a.close()
    b = await connect_unix(agent.sock)
    try:
        (found,) = [x for x in await b.list_processes() if x.id == p.id]
        assert found.running
        await b.signal_process("keeper", signal.SIGKILL)
    finally:
        await b.close()


async def test_pty_echo_resize_and_exit(channel: AgentChannel) -> None:
    pty = await channel.open_pty(["sh"], rows=24, cols=80, env={"PS1": "$ "})
    buf = b""

    async def read_until(needle: bytes) -> None:
        nonlocal buf
        with anyio.fail_after(10):
            while needle not in buf:
                data = await pty.read()
                assert data, f"terminal ended before {needle!r}: {buf!r}"
                buf += data

    await pty.write(b"echo hi-$((40+2))\n")
    await read_until(b"hi-42\r\n")  # the terminal's line discipline turns \n into \r\n
    await pty.write(b"stty size\n")
    await read_until(b"24 80")
    await pty.resize(40, 100)
    await pty.write(b"stty size\n")
    await read_until(b"40 100")
    await pty.write(b"tty; exit 7\n")
    await read_until(b"/dev/pts/")
    assert await pty.wait() == 7
    with anyio.fail_after(5):
        while await pty.read():
            pass
    await pty.close()


async def test_pty_close_hangs_up_and_leaves_nothing(
    channel: AgentChannel, survivors, eventually
) -> None:
    tag = f"PTY_{uuid.uuid4().hex}"
    pty = await channel.open_pty(["sh", "-c", "trap '' HUP; sleep 300"], env={"PTY_TAG": tag})
    assert pty.id.startswith("t-")
    assert await anyio.to_thread.run_sync(lambda: eventually(lambda: len(survivors(tag)) == 2))
    await pty.close()
    # SIGHUP first; the tree is killed after a one-second grace even if it ignores hang-ups.
    assert eventually(lambda: survivors(tag) == [], timeout=5)
    assert (await channel.exec(["echo", "still fine"])).stdout == "still fine\n"


async def test_input_the_program_read_before_exiting_is_not_an_error(
    channel: AgentChannel,
) -> None:
    """A writer's end of input may arrive after the program read its bytes and exited (seen
    under load as ``stdin is closed: the process has exited`` for ``read x; exit``)."""
    from sandlot.channel.protocol import Chan, FrameType

    info = await channel.start_process(["sh", "-c", "read x; echo got $x; exit 3"])
    conn = channel._conn
    st = await conn.open({"op": "proc.stdin", "id": info.id, "close": True})
    await conn.send_data(st, b"hello\n")
    done = await channel.wait_process(info.id, timeout=10)  # it read the line and exited
    assert done.exit_code == 3
    await conn.send(FrameType.EOF, st.sid, b"", Chan.IN)
    await conn.result(st)  # no error: every byte was delivered
    out = b"".join(c.data for c in await _collect(channel.process_output(info.id)))
    assert out == b"got hello\n"
    # Input that can no longer be delivered is still refused.
    with pytest.raises(InvalidState, match="closed"):
        await channel.write_stdin(info.id, b"late\n")


async def test_a_follower_out_of_credit_is_sent_nothing_while_the_process_floods(
    channel: AgentChannel,
) -> None:
    # A follower that never reads used to get a `seq` event for every chunk the process
    # printed once it had fallen out of the ring: a flood the host decoded for nobody.
    info = await channel.start_process(["yes", "flood"])
    conn = channel._conn
    st = await conn.open({"op": "proc.output", "id": info.id, "offset": 0, "follow": True})
    try:
        deadline = anyio.current_time() + 2
        while anyio.current_time() < deadline:  # other calls keep the connection read
            await channel.list_processes()
            await anyio.sleep(0.05)
        events = [i for i in st.items if i[0] == FrameType.EVENT]
        data = [i[2] for i in st.items if i[0] == FrameType.DATA]
        # The first event says where it starts; any other comes with the chunk it jumps to.
        assert len(events) <= 1 + len(data), events[:5]
        assert sum(map(len, data)) <= WINDOW + MAX_DATA  # within the window it was granted
    finally:
        await conn.cancel(st)
        await channel.signal_process(info.id, signal.SIGKILL)


async def test_a_one_shot_read_of_a_flooding_process_ends(channel: AgentChannel) -> None:
    # It reads the output there is when asked: chasing the end of a process that prints faster
    # than the reader reads never ended (a host reading slowly read for ever).
    info = await channel.start_process(["yes", "flood"])
    try:
        await anyio.sleep(0.5)  # a full ring
        with anyio.fail_after(30):
            chunks = []
            async for chunk in channel.process_output(info.id, offset=0):
                chunks.append(chunk)
                await anyio.sleep(0.01)  # slower than `yes`
        assert chunks
        assert [c.seq for c in chunks] == list(range(chunks[0].seq, chunks[0].seq + len(chunks)))
    finally:
        await channel.signal_process(info.id, signal.SIGKILL)
