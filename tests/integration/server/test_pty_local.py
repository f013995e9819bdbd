"""A real terminal over the WebSocket: a real server on the ``local`` backend runs ``sh`` on a
pty inside a crun sandbox; we type into it, resize it, and read its exit code back."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from sandlot import Sandbox
from sandlot.client import Client
from sandlot.server.testing import ServerThread
from sandlot.terminal import Terminal

pytestmark = [pytest.mark.needs_root, pytest.mark.slow]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "root (the local backend's namespaces, mounts and cgroups)"
    for tool, pkg in (("crun", "crun"), ("unshare", "util-linux"), ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {pkg})"
    return None


def _read_until(term: Terminal, needle: bytes) -> bytes:
    seen = b""
    while needle not in seen:
        data = term.read(timeout=20)
        assert data, f"the terminal ended before {needle!r}; it showed {seen!r}"
        seen += data
    return seen


def _running(sb: Sandbox, cmdline: str) -> bool:
    listing = sb.exec(
        ["sh", "-c", 'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline; echo; done'],
        check=True,
    )
    return any(line.strip() == cmdline for line in listing.stdout.splitlines())


def test_sh_on_a_real_pty_over_the_websocket(tmp_path: Path) -> None:
    reason = _missing()
    if reason:
        pytest.skip(f"needs {reason}")
    with ServerThread(tmp_path / "srv", backend="local") as server:
        key = server.new_key("pty-tenant")
        with Client(server.url, key, timeout=60) as client:
            sb = client.create(network="deny-all")
            try:
                with sb.open_pty(["sh"], rows=24, cols=80) as term:
                    term.write(b"echo hi\n")
                    # The terminal echoes what was typed, then the program's output, in CRLF.
                    assert b"\r\nhi\r\n" in _read_until(term, b"\r\nhi\r\n")
                    term.write(b"stty size\n")
                    _read_until(term, b"24 80")
                    term.resize(40, 100)
                    term.write(b"stty size\n")
                    _read_until(term, b"40 100")
                    term.write(b"tty\n")
                    assert b"/dev/pts/" in _read_until(term, b"/dev/pts/")
                    term.write(b"exit 7\n")
                    assert term.wait(timeout=30) == 7
                # A terminal that is hung up ends its program.
                term = sb.open_pty(["sleep", "1234"])
                assert _running(sb, "sleep 1234")
                term.close()
                deadline = time.monotonic() + 10
                while _running(sb, "sleep 1234") and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not _running(sb, "sleep 1234")
                # Background processes on the same sandbox, through the same server.
                proc = sb.start_process(["sh", "-c", "read line; echo got $line"])
                sb.write_stdin(proc.id, b"bread\n", close=True)
                done = sb.wait_process(proc.id, timeout=30)
                assert done.exit_code == 0
                assert b"".join(c.data for c in sb.process_output(proc.id)) == b"got bread\n"
            finally:
                sb.destroy()
