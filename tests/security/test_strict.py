"""Strict enforcement: every program a sandbox starts is decided by the policy gate.

The gate already denies ``rm -rf --no-preserve-root /`` typed as a command; these are the
spellings it cannot see through (piped to a shell, in a script, from Python, behind a
variable), each of which reaches the kernel as an ``execve`` of ``rm`` that strict mode stops
and the default policy denies. Each must fail with EPERM, leave the sandbox's files intact and
leave a DENY receipt naming rm and its arguments; ordinary work keeps running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from sandlot.backends.local import LocalBackend
from sandlot.errors import NotSupported
from sandlot.models import SandboxSpec
from sandlot.receipts.receipt import Receipt
from sandlot.sdk import AsyncSandbox, AsyncSandlot

STRICT = {"local": {"enforcement": "strict"}}
WIPE = "rm -rf --no-preserve-root /"
ARGV = WIPE.split()


@pytest.fixture(scope="module")
async def strict(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[AsyncSandlot, AsyncSandbox, list[Receipt]]]:
    home = tmp_path_factory.mktemp("home")
    backend = LocalBackend(home / "local", cache=tmp_path_factory.mktemp("cache"))
    receipts: list[Receipt] = []
    client = AsyncSandlot(home, backends={"local": backend}, on_receipt=receipts.append)
    try:
        sb = await client.create(network="deny-all", backend_options=STRICT)
        await sb.write_file("/workspace/keep.txt", "still here\n")
        yield client, sb, receipts
        await sb.destroy()
    finally:
        await client.aclose()


def _denied_rm(receipts: list[Receipt]) -> list[str]:
    out = []
    for r in receipts:
        body = r.body
        if body.get("op") == "exec.program" and body.get("decision") == "DENY":
            out.append(str(body.get("detail")))
    return out


@pytest.mark.parametrize(
    "command",
    [
        f"echo '{WIPE}' | sh",
        "sh /workspace/wipe.sh",
        f"python3 -c \"import os; os.execvp('rm', {ARGV})\"",
        f'python3 -c "import subprocess, sys; sys.exit(subprocess.run({ARGV}).returncode)"',
        f"R=rm; $R {WIPE.removeprefix('rm ')}",
    ],
    ids=["stdin", "script", "execvp", "subprocess", "variable"],
)
async def test_a_wipe_is_denied_however_it_is_spelled(
    strict: tuple[AsyncSandlot, AsyncSandbox, list[Receipt]], command: str
) -> None:
    client, sb, receipts = strict
    await sb.write_file("/workspace/wipe.sh", f"{WIPE}\n")
    before = len(_denied_rm(receipts))
    result = await sb.exec(command, timeout=60)
    assert result.exit_code != 0
    assert "Operation not permitted" in result.stderr or "[Errno 1]" in result.stderr, result
    assert (await sb.read_file("/workspace/keep.txt")) == b"still here\n"
    listing = await sb.exec("ls /usr/bin | wc -l")
    assert int(listing.stdout) > 50
    await client.manager.flush_receipts()
    denials = _denied_rm(receipts)[before:]
    assert denials, "no DENY receipt for the exec of rm"
    # The program is the binary the caller named (each PATH entry a shell or execvp tries).
    assert all(f"/rm {WIPE.removeprefix('rm ')}'" in d for d in denials), denials


async def test_ordinary_work_still_runs(
    strict: tuple[AsyncSandlot, AsyncSandbox, list[Receipt]],
) -> None:
    _, sb, receipts = strict
    assert "keep.txt" in (await sb.exec(["ls", "/workspace"])).stdout.split()
    assert (await sb.exec(["python3", "-c", "print(1)"])).stdout == "1\n"
    assert (await sb.exec("echo hi | cat")).stdout == "hi\n"
    # Many programs at once, each argv new (each one a decision): none is lost or stuck.
    many = await sb.exec("seq 200 | xargs -P 8 -n 1 echo | sort -n | tail -1", timeout=60)
    assert (many.exit_code, many.stdout) == (0, "200\n")
    allowed = [
        r.body
        for r in receipts
        if r.body.get("op") == "exec.program" and r.body.get("decision") == "ALLOW"
    ]
    assert any("cat" in str(b.get("detail")) for b in allowed)


async def test_strict_is_refused_where_it_cannot_hold(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "state", cache=tmp_path / "cache")
    try:
        with pytest.raises(NotSupported, match="gVisor"):
            await backend.create(
                "strict-gvisor",
                SandboxSpec(
                    network="deny-all",
                    backend_options={"local": {"isolation": "gvisor", "enforcement": "strict"}},
                ),
            )
        assert not (tmp_path / "state" / "strict-gvisor").exists()
    finally:
        await backend.aclose()


async def test_what_is_typed_into_a_terminal_is_decided_too(
    strict: tuple[AsyncSandlot, AsyncSandbox, list[Receipt]],
) -> None:
    # Keystrokes never reach the gate; the programs they start do.
    _, sb, _ = strict
    async with await sb.open_pty() as term:
        await term.write(f"{WIPE}; echo rc=$?\r".encode())
        seen = b""
        with anyio.fail_after(20):
            while b"rc=126" not in seen:
                data = await term.read()
                assert data, seen
                seen += data
        assert b"Operation not permitted" in seen
        await term.write(b"exit\r")
        await term.wait(timeout=20)
    assert (await sb.read_file("/workspace/keep.txt")) == b"still here\n"


async def test_a_restarted_sandbox_is_still_strict(
    strict: tuple[AsyncSandlot, AsyncSandbox, list[Receipt]],
) -> None:
    client, _, _ = strict
    sb = await client.create(network="deny-all", backend_options=STRICT)
    backend = client.manager.backends["local"]
    assert isinstance(backend, LocalBackend)
    listeners = backend.run_dir / "x"
    assert len(list(listeners.iterdir())) == 2  # this sandbox's and the module's
    await sb.stop()
    assert len(list(listeners.iterdir())) == 1
    assert (await sb.exec("echo hi | cat")).stdout == "hi\n"  # resumed: a new listener
    denied = await sb.exec(f"echo '{WIPE}' | sh")
    assert "Operation not permitted" in denied.stderr
    await sb.destroy()
    assert len(list(listeners.iterdir())) == 1
