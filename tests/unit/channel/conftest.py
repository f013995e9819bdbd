"""Fixtures for the agent tests: a real agent process on a unix socket in a temp dir."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from sandlot.channel.client import AgentChannel, connect_unix
from sandlot.channel.protocol import AGENT_PATH


class AgentProcess:
    """An agent started as a plain host subprocess (no isolation needed for these tests)."""

    def __init__(
        self,
        sock: Path,
        python: str = sys.executable,
        extra: tuple[str, ...] = (),
        script: Path = AGENT_PATH,
    ) -> None:
        self.sock = sock
        self.log = sock.with_suffix(".log")
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        # Its own session, so that a test killing "everything the agent started" can never
        # reach pytest itself.
        self.proc = subprocess.Popen(
            [python, "-I", "-S", str(script), "--listen", str(sock), *extra],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    # Not in tmp_path: tests list and compare that directory.
    proc = AgentProcess(tmp_path_factory.mktemp("agent") / "agent.sock")
    yield proc
    rc = proc.stop()
    assert rc == 0, f"agent exited {rc}: {proc.output()}"
    assert "Traceback" not in proc.output(), proc.output()


@pytest.fixture
async def channel(agent: AgentProcess) -> AsyncIterator[AgentChannel]:
    ch = await connect_unix(agent.sock, timeout=15)
    try:
        yield ch
    finally:
        await ch.close()


def processes_with_env(needle: str) -> list[int]:
    """Live (non-zombie) host processes whose initial environment contains ``needle``."""
    found = []
    raw = needle.encode()
    for name in sorted(p.name for p in Path("/proc").iterdir()):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        state = stat[stat.rindex(b")") + 2 :].split()[0]
        if raw in env and state != b"Z":
            found.append(int(name))
    return found


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def survivors() -> Callable[[str], list[int]]:
    """``survivors(needle)``: live processes whose environment contains ``needle``."""
    return processes_with_env


@pytest.fixture
def eventually() -> Callable[..., bool]:
    """``eventually(cond, timeout=5)``: poll a condition until it holds or time runs out."""
    return wait_until


@pytest.fixture
def start_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., AgentProcess]]:
    """Start more agents (another interpreter, extra arguments); all are stopped at the end."""
    started: list[AgentProcess] = []

    def start(
        name: str = "extra", python: str = sys.executable, extra: tuple[str, ...] = ()
    ) -> AgentProcess:
        p = AgentProcess(
            tmp_path_factory.mktemp("agent") / f"{name}.sock", python=python, extra=extra
        )
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
