"""Paths enforced by the kernel: what ``backend_options.local.protected_paths`` names is
read-only inside the sandbox, and ``hidden_paths`` are empty, however a write is spelled.

A symlink planted in /workspace once carried file-API writes into /etc while a direct /etc
write was denied; here the kernel refuses both (``EROFS``), through a shell, through Python,
through the file API and after a restart, while the rest of the sandbox stays writable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.errors import InvalidRequest, NotSupported, SandboxError
from sandlot.sdk import AsyncSandbox, AsyncSandlot

OPTIONS = {"local": {"protected_paths": ["/etc", "/usr/local/"], "hidden_paths": ["/srv"]}}
EROFS = "Read-only file system"


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AsyncSandlot]:
    home = tmp_path_factory.mktemp("home")
    backend = LocalBackend(home / "local", cache=tmp_path_factory.mktemp("cache"))
    async with AsyncSandlot(home, backends={"local": backend}) as c:
        yield c


@pytest.fixture(scope="module")
async def sb(client: AsyncSandlot) -> AsyncIterator[AsyncSandbox]:
    sandbox = await client.create(network="deny-all", backend_options=OPTIONS)
    await sandbox.exec("ln -s /etc /workspace/etc-link && ln -s /srv /workspace/srv-link")
    yield sandbox
    await sandbox.destroy()


@pytest.mark.parametrize(
    "command",
    [
        "echo x > /etc/planted",
        "echo x > /workspace/etc-link/planted",
        "sh -c 'cat /etc/hostname > /workspace/etc-link/hostname.bak'",
        "rm -f /workspace/etc-link/hostname",
        "mkdir /usr/local/planted",
        "python3 -c \"open('/workspace/etc-link/planted', 'w')\"",
        "echo x > /workspace/srv-link/planted",
    ],
    ids=["direct", "symlink", "sh-c", "delete", "subdir", "python", "hidden"],
)
async def test_a_write_to_a_protected_path_fails_however_spelled(
    sb: AsyncSandbox, command: str
) -> None:
    result = await sb.exec(command)
    assert result.exit_code != 0, result
    assert EROFS in result.stderr, result
    listing = await sb.exec("ls -A /etc/planted /etc/hostname.bak /usr/local/planted /srv")
    assert "planted" not in listing.stdout
    assert (await sb.exec("cat /etc/hostname")).exit_code == 0


async def test_the_file_api_cannot_write_past_them(sb: AsyncSandbox) -> None:
    for path in ("/etc/via-api", "/workspace/etc-link/via-api", "/workspace/srv-link/via-api"):
        with pytest.raises(SandboxError, match=EROFS):
            await sb.write_file(path, "x")
    with pytest.raises(SandboxError, match=EROFS):
        await sb.remove_file("/workspace/etc-link/hostname")
    listing = await sb.exec("ls -A /etc /srv")
    assert "via-api" not in listing.stdout
    assert "hostname" in listing.stdout


async def test_the_rest_stays_writable(sb: AsyncSandbox) -> None:
    result = await sb.exec("echo ok > /workspace/ok && echo ok > /tmp/ok && echo ok > /root/ok")
    assert result.exit_code == 0, result
    await sb.write_file("/workspace/api-ok", "ok")
    assert (await sb.read_file("/workspace/api-ok")) == b"ok"
    # Hidden: an empty directory where the image has one.
    assert (await sb.exec("ls -A /srv")).stdout == ""


async def test_they_hold_after_a_restart(client: AsyncSandlot) -> None:
    sandbox = await client.create(network="deny-all", backend_options=OPTIONS)
    try:
        await sandbox.stop()
        result = await sandbox.exec("touch /etc/after-restart")
        assert EROFS in result.stderr, result
    finally:
        await sandbox.destroy()


@pytest.mark.parametrize("paths", [["etc"], ["/proc/sys"], ["/"], ["/x/../etc"], "/etc"], ids=str)
async def test_paths_it_cannot_protect_are_refused(client: AsyncSandlot, paths: object) -> None:
    with pytest.raises(InvalidRequest, match="protected_paths"):
        await client.create(
            network="deny-all", backend_options={"local": {"protected_paths": paths}}
        )


async def test_gvisor_refuses_them(client: AsyncSandlot) -> None:
    options = {"local": {"isolation": "gvisor", "hidden_paths": ["/srv"]}}
    with pytest.raises(NotSupported, match="hidden_paths"):
        await client.create(network="deny-all", backend_options=options)
