"""Resolving paths inside the sandbox, and acting on exactly the resolved path (issue 23).

The host decides on the path an operation will touch: ``file.resolve`` follows symlinks as the
kernel would, and ``nofollow`` makes an operation fail, not detour, when a link is swapped in
after that decision. A real agent process; an older agent without ``file.resolve`` gets the
same answers from the host's walk over ``file.stat``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot.channel.client import AgentChannel, connect_unix
from sandlot.channel.protocol import AGENT_PATH
from sandlot.errors import Conflict, InvalidRequest

from .conftest import AgentProcess


def _tree(root: Path) -> dict[tuple[str, bool], str]:
    """Links of every kind under ``root``; what each path resolves to (follow_last or not)."""
    real = root / "real"
    (real / "sub").mkdir(parents=True)
    (root / "abs").symlink_to(real)
    (root / "rel").symlink_to("real/sub/..")
    (root / "up").symlink_to(f"../{root.name}/real")
    (real / "last").symlink_to(real / "sub")
    (root / "loop").symlink_to("loop2")
    (root / "loop2").symlink_to("loop")
    r = os.path.realpath(root)
    return {
        ("abs/sub/x.conf", True): f"{r}/real/sub/x.conf",
        ("rel/sub", True): f"{r}/real/sub",
        ("up/sub/../sub", True): f"{r}/real/sub",
        ("real/last", True): f"{r}/real/sub",
        ("real/last", False): f"{r}/real/last",
        ("abs/last/new/x", False): f"{r}/real/sub/new/x",
        ("missing/../abs", True): f"{r}/real",
    }


async def test_resolve_follows_links_like_the_kernel(channel: AgentChannel, tmp_path: Path) -> None:
    for (path, follow_last), expected in _tree(tmp_path).items():
        got = await channel.resolve(f"{tmp_path}/{path}", follow_last=follow_last)
        assert got == expected, path
        if follow_last and Path(expected).exists():
            assert got == os.path.realpath(f"{tmp_path}/{path}")
    with pytest.raises(InvalidRequest, match="too many levels of symbolic links"):
        await channel.resolve(f"{tmp_path}/loop/x")


@pytest.fixture
async def old_channel(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[AgentChannel]:
    # The agent as it was before file.resolve: the same file without that op.
    home = tmp_path_factory.mktemp("old-agent")
    source = AGENT_PATH.read_text()
    assert '    "file.resolve": op_file_resolve,\n' in source
    script = home / "agent.py"
    script.write_text(source.replace('    "file.resolve": op_file_resolve,\n', ""))
    proc = AgentProcess(home / "agent.sock", script=script)
    try:
        ch = await connect_unix(proc.sock, timeout=15)
        try:
            yield ch
        finally:
            await ch.close()
    finally:
        proc.stop()


async def test_an_older_agent_gets_the_same_answers(
    old_channel: AgentChannel, tmp_path: Path
) -> None:
    for (path, follow_last), expected in _tree(tmp_path).items():
        got = await old_channel.resolve(f"{tmp_path}/{path}", follow_last=follow_last)
        assert got == expected, path


async def test_a_link_swapped_in_after_resolving_fails_the_operation(
    channel: AgentChannel, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_text("mine")
    decided = await channel.resolve(str(d / "f"), follow_last=False)
    (d / "f").unlink()
    d.rmdir()
    d.symlink_to(victim)
    with pytest.raises(Conflict, match="symbolic link"):
        await channel.write_file(decided, b"owned", nofollow=True)
    with pytest.raises(Conflict, match="symbolic link"):
        await channel.remove(str(d / "precious"), nofollow=True)
    with pytest.raises(Conflict, match="symbolic link"):
        await channel.list_files(str(d), nofollow=True)
    with pytest.raises(Conflict, match="symbolic link"):
        async for _ in channel.read_file(str(d / "precious"), nofollow=True):
            pass
    assert sorted(p.name for p in victim.iterdir()) == ["precious"]
    assert (victim / "precious").read_text() == "keep me"


async def test_nofollow_acts_on_a_resolved_path(channel: AgentChannel, tmp_path: Path) -> None:
    await channel.write_file(str(tmp_path / "a" / "b" / "c.txt"), b"one", nofollow=True)
    assert (tmp_path / "a" / "b" / "c.txt").read_bytes() == b"one"
    got = b"".join([c async for c in channel.read_file(str(tmp_path / "a/b/c.txt"), nofollow=True)])
    assert got == b"one"
    assert [e.name for e in await channel.list_files(str(tmp_path / "a/b"), nofollow=True)] == [
        "c.txt"
    ]
    (tmp_path / "a" / "b" / "link").symlink_to(tmp_path)
    await channel.remove(str(tmp_path / "a" / "b" / "link"), nofollow=True)
    await channel.remove(str(tmp_path / "a"), recursive=True, nofollow=True)
    assert list(tmp_path.iterdir()) == []
