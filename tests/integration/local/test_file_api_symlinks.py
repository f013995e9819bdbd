"""The file API decides on the path a symlink leads to, not on the one written (issue 23).

A policy that forbids writes under /etc must not be walked around by a link the sandbox
plants in /workspace (`ln -s /etc /workspace/e`, then write /workspace/e/x.conf): the path is
resolved inside the sandbox, the policy decides on that, its receipt names it, and nothing is
touched. Real sandboxes on the local backend; needs root.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from sandlot import PolicyDenied
from sandlot.backends.local import LocalBackend
from sandlot.sdk import AsyncSandbox, AsyncSandlot

NO_ETC = """
permit (principal, action, resource);

@id("no-etc")
@reason("nothing under /etc is touched through the file API")
forbid (principal, action in [Action::"write", Action::"read"], resource)
when { context has within && context.within.contains("/etc") };
"""

# Links an agent can plant with one exec: the directory itself, a link in a parent directory,
# and a relative link that climbs out with ..
PLANTS = {
    "link to /etc": ("ln -s /etc /workspace/e", "/workspace/e"),
    "link in a parent": (
        "mkdir -p /workspace/p && ln -s / /workspace/p/root",
        "/workspace/p/root/etc",
    ),
    "relative link with ..": (
        "mkdir -p /workspace/r && ln -s ../../etc /workspace/r/up",
        "/workspace/r/up",
    ),
}


@pytest.fixture
async def sandbox(
    tmp_path: Path, backend: LocalBackend
) -> AsyncIterator[tuple[AsyncSandlot, AsyncSandbox]]:
    policy = tmp_path / "no-etc.cedar"
    policy.write_text(NO_ETC)
    async with AsyncSandlot(
        tmp_path / "home", backends={"local": backend}, policy=policy
    ) as client:
        sb = await client.create(network="deny-all")
        try:
            yield client, sb
        finally:
            await sb.destroy()


async def _denied_naming(client: AsyncSandlot, op: Awaitable[object], resolved: str) -> None:
    with pytest.raises(PolicyDenied) as info:
        await op
    assert "no-etc" in info.value.message
    await client.manager.flush_receipts()
    receipt = next(
        r for r in reversed(client.receipts.tail(20)) if r.entry_hash == info.value.receipt_id
    )
    assert receipt.body["decision"] == "DENY"
    assert resolved in str(receipt.body)


@pytest.mark.parametrize("plant", list(PLANTS))
async def test_a_planted_link_does_not_carry_the_file_api_into_etc(
    sandbox: tuple[AsyncSandlot, AsyncSandbox], plant: str
) -> None:
    client, sb = sandbox
    command, etc = PLANTS[plant]
    assert (await sb.exec(command)).exit_code == 0
    before = (await sb.exec("ls /etc; cat /etc/passwd")).stdout

    await _denied_naming(client, sb.write_file(f"{etc}/x.conf", "owned\n"), "/etc/x.conf")
    await _denied_naming(client, sb.remove_file(f"{etc}/passwd"), "/etc/passwd")
    await _denied_naming(client, sb.list_files(etc), "/etc")
    await _denied_naming(client, sb.read_file(f"{etc}/passwd"), "/etc/passwd")

    assert (await sb.exec("ls /etc; cat /etc/passwd")).stdout == before


async def test_writes_in_the_workspace_still_work(
    sandbox: tuple[AsyncSandlot, AsyncSandbox],
) -> None:
    _, sb = sandbox
    await sb.write_file("/workspace/a/b.txt", "one\n")
    # A link that stays inside the workspace is followed, and decided on where it leads.
    assert (await sb.exec("ln -s /workspace/a /workspace/link")).exit_code == 0
    await sb.write_file("/workspace/link/c.txt", "two\n")
    assert await sb.read_file("/workspace/a/c.txt") == b"two\n"
    assert {f.name for f in await sb.list_files("/workspace/link")} == {"b.txt", "c.txt"}
    await sb.remove_file("/workspace/link/b.txt")
    assert (await sb.exec("ls /workspace/a")).stdout == "c.txt\n"
    # A link in the last place is replaced by a write, and removed (not followed) by a remove.
    assert (await sb.exec("ln -s /etc/passwd /workspace/pw")).exit_code == 0
    await sb.write_file("/workspace/pw", "mine\n")
    assert (await sb.exec("test ! -L /workspace/pw && cat /workspace/pw")).stdout == "mine\n"
    assert (await sb.exec("ln -s /etc /workspace/etc2")).exit_code == 0
    await sb.remove_file("/workspace/etc2")
    assert (await sb.exec("test -d /etc/apt -o -f /etc/passwd && echo intact")).stdout == "intact\n"


Swap = Callable[[], Awaitable[object]]


async def test_a_link_swapped_in_after_the_decision_does_not_win(
    sandbox: tuple[AsyncSandlot, AsyncSandbox],
) -> None:
    client, sb = sandbox
    assert (await sb.exec("mkdir -p /workspace/d")).exit_code == 0
    channel = await client.manager._channel(await client.manager.get(sb.id))
    real = await channel.resolve("/workspace/d/x.conf", follow_last=False)
    assert real == "/workspace/d/x.conf"
    # Between the decision and the write, the directory becomes a link to /etc.
    assert (await sb.exec("rmdir /workspace/d && ln -s /etc /workspace/d")).exit_code == 0
    with pytest.raises(Exception, match="symbolic link"):
        await channel.write_file(real, b"owned\n", nofollow=True)
    with pytest.raises(Exception, match="symbolic link"):
        await channel.remove("/workspace/d/passwd", nofollow=True)
    with pytest.raises(Exception, match="symbolic link"):
        await channel.list_files("/workspace/d", nofollow=True)
    assert (await sb.exec("test -e /etc/x.conf || echo absent")).stdout == "absent\n"
