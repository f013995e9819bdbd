"""``sandlot shell``: the real console script, on the fake backend's toy terminal, with piped
input and with a real local terminal (raw mode, window size, SIGWINCH)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

SANDLOT = [sys.executable, "-m", "sandlot"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "SANDLOT_BACKEND": "fake", **extra}


def _create() -> str:
    made = subprocess.run(
        [*SANDLOT, "create", "--json"], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["id"])


def test_piped_input_runs_and_exit_code_comes_back() -> None:
    sid = _create()
    ran = subprocess.run(
        [*SANDLOT, "shell", sid],
        input=b"stty size\nexit 3\n",
        capture_output=True,
        env=_env(LINES="30", COLUMNS="100"),
        timeout=60,
    )
    assert ran.returncode == 3, ran.stderr
    assert b"30 100" in ran.stdout
    unknown = subprocess.run(
        [*SANDLOT, "shell", "sb-000000000000"], capture_output=True, env=_env(), timeout=60
    )
    assert unknown.returncode == 1
    assert b"sb-000000000000" in unknown.stderr


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _read_until(fd: int, needle: bytes, timeout: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    while needle not in seen:
        assert time.monotonic() < deadline, f"no {needle!r} in {seen!r}"
        try:
            seen += os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.02)
    return seen


def _shell_on(master: int, slave: int, sid: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``sandlot shell`` on a real terminal, once it has put the terminal in raw mode (typing
    before that would be flushed by it)."""
    proc = subprocess.Popen(
        [*SANDLOT, "shell", sid],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    deadline = time.monotonic() + 60
    while termios.tcgetattr(master)[3] & termios.ECHO:
        if proc.poll() is not None:
            os.set_blocking(master, False)
            pytest.fail(f"sandlot shell exited {proc.returncode}: {os.read(master, 4096)!r}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the terminal never went raw")
        time.sleep(0.02)
    return proc


def test_on_a_real_terminal_raw_mode_and_window_size_follow() -> None:
    sid = _create()
    master, slave = os.openpty()
    _set_size(slave, 20, 70)
    env = _env()
    env.pop("LINES", None)
    env.pop("COLUMNS", None)
    proc = _shell_on(master, slave, sid, env)
    try:
        os.write(master, b"stty size\r")
        # Raw mode: the local terminal does not echo, so "stty size" shows once (the remote
        # echo) and the answer follows.
        seen = _read_until(master, b"20 70")
        assert seen.count(b"stty size") == 1, seen
        _set_size(master, 41, 120)
        proc.send_signal(signal.SIGWINCH)
        time.sleep(0.5)
        os.write(master, b"stty size\r")
        _read_until(master, b"41 120")
        os.write(master, b"exit 5\r")
        assert proc.wait(timeout=30) == 5
        assert termios.tcgetattr(master)[3] & termios.ECHO, "the terminal mode was restored"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_through_a_server_the_command_ends_when_the_program_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 14: through a server the CLI waited for one more keystroke after the
    program exited (a worker thread stuck reading the terminal held the interpreter)."""
    from sandlot.server import ServerConfig
    from sandlot.server.testing import ServerThread
    from sandlot.testing import FakeBackend

    config = ServerConfig(sweep_interval=None)
    with ServerThread(tmp_path / "srv", backends={"fake": FakeBackend()}, config=config) as srv:
        env = _env(SANDLOT_URL=srv.url, SANDLOT_API_KEY=srv.new_key("acme"))
        made = subprocess.run(
            [*SANDLOT, "create"], capture_output=True, text=True, env=env, timeout=60
        )
        assert made.returncode == 0, made.stderr
        sid = made.stdout.strip()
        master, slave = os.openpty()
        proc = _shell_on(master, slave, sid, env)
        try:
            os.write(master, b"exit 5\r")
            assert proc.wait(timeout=10) == 5, "the command outlived its program"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(master)
