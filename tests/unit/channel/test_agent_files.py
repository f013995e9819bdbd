"""File operations through a real agent process (the agent resolves every path itself)."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import anyio
import pytest

from sandlot.channel.client import AgentChannel
from sandlot.errors import Conflict, InvalidRequest, NotFound


async def _roundtrip(channel: AgentChannel, path: Path, size: int) -> float:
    """Upload ``size`` pseudo-random bytes in 1 MiB pieces, read them back; seconds taken."""
    seed = os.urandom(1 << 20)
    sent = hashlib.sha256()

    async def source():
        for i in range(size // len(seed)):
            piece = seed[i % 7 :] + seed[: i % 7]  # vary the content from piece to piece
            sent.update(piece)
            yield piece

    t0 = time.perf_counter()
    info = await channel.write_file(str(path), source())
    assert info.size == size
    got = hashlib.sha256()
    n = 0
    async for chunk in channel.read_file(str(path)):
        got.update(chunk)
        n += len(chunk)
    elapsed = time.perf_counter() - t0
    assert n == size
    assert got.hexdigest() == sent.hexdigest()
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == sent.hexdigest()
    return elapsed


async def test_64_mib_round_trip_keeps_its_sha256(channel: AgentChannel, tmp_path: Path) -> None:
    await _roundtrip(channel, tmp_path / "big.bin", 64 << 20)


@pytest.mark.slow
async def test_1_gib_round_trip_keeps_its_sha256(channel: AgentChannel, tmp_path: Path) -> None:
    elapsed = await _roundtrip(channel, tmp_path / "huge.bin", 1 << 30)
    rate = 2 * (1 << 30) / elapsed / 1e6
    print(f"1 GiB up + down in {elapsed:.2f}s: {rate:.0f} MB/s")
    # A regression guard, not the target (>= 200 MB/s, met on tmpfs; see bench/agent_exec.py):
    # this run includes 3 GiB of SHA-256 and the disk's own write speed.
    assert rate > 25


async def test_write_makes_parents_sets_mode_and_leaves_no_temp_files(
    channel: AgentChannel, tmp_path: Path
) -> None:
    target = tmp_path / "a" / "b" / "c.txt"
    info = await channel.write_file(str(target), b"hello", mode=0o640)
    assert (info.type, info.size, info.mode, info.name) == ("file", 5, 0o640, "c.txt")
    assert target.read_bytes() == b"hello"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    # Replacing keeps the mode when none is given.
    await channel.write_file(str(target), b"bye")
    assert target.read_bytes() == b"bye"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in target.parent.iterdir()] == ["c.txt"]
    empty = await channel.write_file(str(tmp_path / "empty"), b"")
    assert empty.size == 0


async def test_failed_upload_leaves_the_old_file_intact(
    channel: AgentChannel, tmp_path: Path
) -> None:
    target = tmp_path / "keep.txt"
    target.write_bytes(b"original")

    async def broken():
        yield b"partial"
        await anyio.sleep(0.05)
        msg = "source failed"
        raise RuntimeError(msg)

    with pytest.raises(RuntimeError):
        await channel.write_file(str(target), broken())
    assert target.read_bytes() == b"original"

    def no_temp() -> bool:
        return [p.name for p in tmp_path.iterdir()] == ["keep.txt"]

    assert await anyio.to_thread.run_sync(lambda: _poll(no_temp))


def _poll(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def test_write_errors(channel: AgentChannel, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidRequest):
        await channel.write_file(str(tmp_path), b"onto a directory")
    with pytest.raises((InvalidRequest, Conflict)):
        await channel.write_file(str(tmp_path / "file" / "below"), b"under a file")
    with pytest.raises(InvalidRequest):
        await channel.write_file("relative/path", b"x")


async def test_symlink_at_target_is_replaced_not_followed(
    channel: AgentChannel, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    link = tmp_path / "link"
    link.symlink_to(outside)
    await channel.write_file(str(link), b"new")
    assert outside.read_text() == "untouched"
    assert not link.is_symlink()
    assert link.read_bytes() == b"new"


async def test_list_stat_mkdir_remove_chmod(channel: AgentChannel, tmp_path: Path) -> None:
    await channel.mkdir(str(tmp_path / "d" / "e"))
    await channel.mkdir(str(tmp_path / "d" / "e"))  # exists: fine
    (tmp_path / "b.txt").write_text("12345")
    (tmp_path / "a-link").symlink_to("b.txt")
    entries = await channel.list_files(str(tmp_path))
    assert [e.name for e in entries] == ["a-link", "b.txt", "d"]
    by_name = {e.name: e for e in entries}
    assert by_name["a-link"].type == "symlink"
    assert by_name["a-link"].target == "b.txt"
    assert (by_name["b.txt"].type, by_name["b.txt"].size) == ("file", 5)
    assert by_name["d"].type == "dir"
    assert by_name["b.txt"].path == str(tmp_path / "b.txt")

    st = await channel.stat(str(tmp_path / "a-link"))
    assert st.type == "symlink"  # not followed
    with pytest.raises(NotFound):
        await channel.stat(str(tmp_path / "missing"))
    with pytest.raises(InvalidRequest):
        await channel.list_files(str(tmp_path / "b.txt"))

    await channel.chmod(str(tmp_path / "b.txt"), 0o600)
    assert (await channel.stat(str(tmp_path / "b.txt"))).mode == 0o600

    with pytest.raises(Conflict):
        await channel.mkdir(str(tmp_path / "b.txt"))
    with pytest.raises(Conflict):
        await channel.remove(str(tmp_path / "d"))
    await channel.remove(str(tmp_path / "d"), recursive=True)
    await channel.remove(str(tmp_path / "a-link"))
    assert (tmp_path / "b.txt").exists()
    await channel.remove(str(tmp_path / "b.txt"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NotFound):
        await channel.remove(str(tmp_path / "b.txt"))


async def test_recursive_remove_does_not_follow_symlinks(
    channel: AgentChannel, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    tree = tmp_path / "tree" / "sub"
    tree.mkdir(parents=True)
    (tree / "escape").symlink_to(victim)
    await channel.remove(str(tmp_path / "tree"), recursive=True)
    assert not (tmp_path / "tree").exists()
    assert (victim / "precious").read_text() == "keep me"


async def test_large_directory_listing(channel: AgentChannel, tmp_path: Path) -> None:
    for i in range(2500):
        (tmp_path / f"f{i:05d}").touch()
    entries = await channel.list_files(str(tmp_path))
    assert [e.name for e in entries] == [f"f{i:05d}" for i in range(2500)]


async def test_read_errors(channel: AgentChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        async for _ in channel.read_file(str(tmp_path / "missing")):
            pass
    with pytest.raises(InvalidRequest):
        async for _ in channel.read_file(str(tmp_path)):
            pass


async def test_follow_file_tails_appends(channel: AgentChannel, tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    log.write_bytes(b"0123456789")
    got = b""
    plain = b"".join([c async for c in channel.follow_file(str(log), offset=4)])
    assert plain == b"456789"

    async def appender() -> None:
        for i in range(3):
            await anyio.sleep(0.1)
            with open(log, "ab") as f:
                f.write(f"line{i}\n".encode())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(appender)
            stream = channel.follow_file(str(log), offset=8, follow=True)
            async for chunk in stream:
                got += chunk
                if got.endswith(b"line2\n"):
                    break
            await stream.aclose()  # type: ignore[attr-defined]
    assert got == b"89line0\nline1\nline2\n"
    # The abandoned follow does not disturb the connection.
    assert (await channel.exec(["echo", "ok"])).stdout == "ok\n"
