"""The exec notifier against a real seccomp filter: a stand-in for crun loads one
(``notify_standin.py``), hands its fd to :class:`ExecGate` the way crun does, and runs programs
whose every ``execve`` the gate decides."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.backends.local.execgate import (
    MAX_ARGS,
    ExecCall,
    ExecGate,
    notif_sizes,
    shares_memory,
)

STANDIN = Path(__file__).with_name("notify_standin.py")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (seccomp without no_new_privs)"
)


class Recorder:
    def __init__(self, deny: str = "rm") -> None:
        self.deny = deny
        self.calls: list[ExecCall] = []
        self.lock = threading.Lock()

    def __call__(self, call: ExecCall) -> bool:
        with self.lock:
            self.calls.append(call)
        return Path(call.path).name != self.deny

    def programs(self) -> list[str]:
        with self.lock:
            return [Path(c.path).name for c in self.calls]


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[tuple[ExecGate, Recorder]]:
    recorder = Recorder()
    g = ExecGate(tmp_path / "listener.sock", recorder)
    yield g, recorder
    g.close()


def run(gate: ExecGate, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    return subprocess.run(
        [sys.executable, str(STANDIN), gate.listener_path, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=cwd,
    )


def test_kernel_sizes_match_the_layout() -> None:
    assert notif_sizes() == (80, 24, 64)


def test_allowed_programs_run_and_each_exec_is_seen(
    gate: tuple[ExecGate, Recorder], tmp_path: Path
) -> None:
    g, rec = gate
    out = run(g, "sh", "-c", "echo hi | cat; /usr/bin/env true", cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, "hi\n"), out.stderr
    first = rec.calls[0]
    assert first.argv == ("sh", "-c", "echo hi | cat; /usr/bin/env true")
    assert first.cwd == str(tmp_path)
    assert {"sh", "cat", "env", "true"} <= set(rec.programs())
    assert g.state is not None
    assert g.state["fds"] == ["seccompFd"]


@pytest.mark.parametrize(
    "argv",
    [
        ["sh", "-c", "rm -rf /nonexistent-strict-test"],
        ["sh", "-c", "R=rm; $R -rf /nonexistent-strict-test"],
        [
            sys.executable,
            "-c",
            "import os; os.execvp('rm', ['rm', '-rf', '/nonexistent-strict-test'])",
        ],
        [
            sys.executable,
            "-c",
            "import subprocess; subprocess.run(['rm', '-rf', '/nonexistent-strict-test'])",
        ],
    ],
    ids=["sh", "variable", "execvp", "subprocess"],
)
def test_a_denied_program_fails_with_eperm(
    gate: tuple[ExecGate, Recorder], argv: list[str]
) -> None:
    g, rec = gate
    out = run(g, *argv)
    assert out.returncode != 0
    assert "Operation not permitted" in out.stderr or "[Errno 1]" in out.stderr, out.stderr
    rm = [c for c in rec.calls if Path(c.path).name == "rm"]
    assert rm
    assert all(c.argv == ("rm", "-rf", "/nonexistent-strict-test") for c in rm)


def test_stdin_script_and_execveat(gate: tuple[ExecGate, Recorder], tmp_path: Path) -> None:
    g, rec = gate
    script = tmp_path / "s.sh"
    script.write_text("rm -rf /nonexistent-strict-test\necho after=$?\n")
    out = run(g, "sh", str(script))
    assert "after=126" in out.stdout
    assert "Operation not permitted" in out.stderr
    # fexecve: execveat(fd, "", argv, envp, AT_EMPTY_PATH); the path is the fd's target
    code = (
        "import os; fd = os.open('/usr/bin/rm', os.O_RDONLY);"
        " os.execve(fd, ['rm', '-rf', '/nonexistent-strict-test'], {})"
    )
    out = run(g, sys.executable, "-c", code)
    assert "[Errno 1]" in out.stderr, out.stderr
    assert rec.calls[-1].path == "/usr/bin/rm"


def test_a_failing_decision_denies(tmp_path: Path) -> None:
    def broken(call: ExecCall) -> bool:
        msg = "policy engine down"
        raise RuntimeError(msg)

    g = ExecGate(tmp_path / "l.sock", broken)
    try:
        out = run(g, "true")
        assert out.returncode != 0
        assert "[Errno 1]" in out.stderr
    finally:
        g.close()


def test_close_before_crun_connects_and_after_exits(tmp_path: Path) -> None:
    g = ExecGate(tmp_path / "l.sock", lambda call: True)
    g.close()
    assert not Path(g.listener_path).exists()
    g = ExecGate(tmp_path / "l.sock", lambda call: True)
    assert run(g, "true").returncode == 0
    assert run(g, "true").returncode == 0  # a second start hands over a second fd
    g.close()
    assert not g._thread.is_alive()
    assert not any(t.is_alive() for t in g._serving)


def test_shares_memory() -> None:
    # The lone program's parent must be single-threaded too (shares_memory counts the parent's
    # threads, for vfork children): pytest's own process may run threads of other tests.
    single_parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess; p = subprocess.Popen(['sleep', '5']); print(p.pid, flush=True); p.wait()",
        ],
        stdout=subprocess.PIPE,
    )
    threaded = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; threading.Thread(target=time.sleep, args=(5,)).start(); print(flush=True); time.sleep(5)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert single_parent.stdout is not None
        assert threaded.stdout is not None
        single = int(single_parent.stdout.readline())
        threaded.stdout.readline()
        assert shares_memory(single) is False
        assert shares_memory(threaded.pid) is True
    finally:
        for p in (single_parent, threaded):
            p.kill()
            p.wait()
            assert p.stdout is not None
            p.stdout.close()


def test_programs_fail_closed_once_the_gate_is_gone(tmp_path: Path) -> None:
    g = ExecGate(tmp_path / "l.sock", lambda call: True)
    code = "import os, sys, time; sys.stdin.read(); os.execvp('true', ['true'])"
    child = subprocess.Popen(
        [sys.executable, str(STANDIN), g.listener_path, sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while g.decided < 1:  # python3 itself started: the filter is live
            threading.Event().wait(0.01)
        g.close()
        _, err = child.communicate("", timeout=30)
    finally:
        child.kill()
        child.wait()
    assert child.returncode != 0
    assert "[Errno 38] Function not implemented" in err


def test_a_slow_decision_holds_up_only_its_own_caller(tmp_path: Path) -> None:
    asked = threading.Event()
    release = threading.Event()

    def decide(call: ExecCall) -> bool:
        if call.argv[:1] == ("sleep",):
            asked.set()
            release.wait(30)  # an approval, say
        return True

    g = ExecGate(tmp_path / "l.sock", decide, quick=lambda call: None)
    go = tmp_path / "go"
    # Builtins only until /bin/echo: its exec comes after sleep's is pending.
    script = f"sleep 0 & while [ ! -e {go} ]; do :; done; /bin/echo fast; wait"
    child = subprocess.Popen(
        [sys.executable, str(STANDIN), g.listener_path, "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        assert child.stdout is not None
        assert asked.wait(20)
        go.touch()
        started = time.monotonic()
        assert child.stdout.readline() == "fast\n"
        assert time.monotonic() - started < 10  # while sleep's decision is pending
        release.set()
        assert child.wait(timeout=20) == 0
    finally:
        release.set()
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
        g.close()


def test_closing_with_a_decision_pending_fails_it_closed(tmp_path: Path) -> None:
    asked = threading.Event()
    release = threading.Event()

    def decide(call: ExecCall) -> bool:
        if call.argv[:1] == ("true",):
            asked.set()
            release.wait(20)
        return True

    g = ExecGate(tmp_path / "l.sock", decide, quick=lambda call: None)
    code = "import os; os.execvp('true', ['true'])"
    child = subprocess.Popen(
        [sys.executable, str(STANDIN), g.listener_path, sys.executable, "-c", code],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert asked.wait(20)
        g.close()
        release.set()  # the late answer must go nowhere (its fd is closed)
        _, err = child.communicate(timeout=20)
    finally:
        release.set()
        child.kill()
        child.wait()
    assert child.returncode != 0
    assert "[Errno 38]" in err


def test_an_argv_over_many_pages_is_read_whole(gate: tuple[ExecGate, Recorder]) -> None:
    # Strings that cross page boundaries and an argv array of several pages: read whole,
    # never decided on a prefix.
    g, rec = gate
    argv = ["true", "x" * 10_000, *(f"arg{i}" for i in range(3000)), "y" * 5000]
    out = run(g, *argv)
    assert out.returncode == 0, out.stderr
    assert rec.calls[0].argv == tuple(argv)
    assert rec.calls[0].path == "/usr/bin/true"  # execvp, PATH=/usr/bin:/bin


def test_an_argv_past_the_limits_is_denied_unread(gate: tuple[ExecGate, Recorder]) -> None:
    g, rec = gate
    out = run(g, "true", *("x" for _ in range(MAX_ARGS)))
    assert out.returncode != 0
    assert "[Errno 1]" in out.stderr, out.stderr
    assert rec.calls == []


def test_an_unreadable_argv_is_denied(gate: tuple[ExecGate, Recorder]) -> None:
    # The kernel would fail this exec with EFAULT; the gate answers before it, with EPERM.
    g, rec = gate
    code = (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True);"
        " argv = (ctypes.c_void_p * 2)(4096, None);"
        " libc.execve(b'/bin/true', argv, None); print(ctypes.get_errno())"
    )
    out = run(g, sys.executable, "-c", code)
    assert out.stdout == "1\n", out
    assert [c.path for c in rec.calls] == [sys.executable]


def test_a_misaligned_argv_across_pages_is_read(gate: tuple[ExecGate, Recorder]) -> None:
    # Linux takes an argv array at any address; one whose pointer straddles two pages is
    # read from both.
    g, rec = gate
    code = (
        "import ctypes, mmap, struct; libc = ctypes.CDLL(None, use_errno=True);"
        " m = mmap.mmap(-1, 8192); s = ctypes.create_string_buffer(b'straddled');"
        " m[4092:4108] = struct.pack('=QQ', ctypes.addressof(s), 0);"
        " base = ctypes.addressof(ctypes.c_char.from_buffer(m));"
        " libc.execve(b'/bin/true', ctypes.c_void_p(base + 4092), None)"
    )
    out = run(g, sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    assert rec.calls[-1].argv == ("straddled",)


def test_a_program_that_is_not_there_fails_as_the_kernel_would(
    gate: tuple[ExecGate, Recorder], tmp_path: Path
) -> None:
    # A PATH search tries each entry: those that hold no such file are answered ENOENT with
    # nothing decided; the one that exists is decided as before.
    g, rec = gate
    missing = tmp_path / "nowhere"
    code = (
        "import os, subprocess;"
        f" os.environ['PATH'] = '{missing}:{missing}2:/usr/bin';"
        "\ntry: subprocess.run(['rm', '-rf', '/nonexistent-strict-test'])"
        "\nexcept PermissionError: print('denied', flush=True)"
        f"\nos.execv('{missing}/rm', ['rm'])"
    )
    out = run(g, sys.executable, "-c", code)
    assert out.stdout == "denied\n", out
    assert "No such file or directory" in out.stderr, out.stderr
    assert [c.path for c in rec.calls] == [sys.executable, "/usr/bin/rm"]


def test_a_program_that_appears_where_one_was_missing_is_decided(
    gate: tuple[ExecGate, Recorder], tmp_path: Path
) -> None:
    # A path once answered ENOENT is looked up again: a program put there is decided.
    g, rec = gate
    where = tmp_path / "later"
    code = (
        "import os, shutil"
        f"\ntry: os.execv('{where}/tool', ['tool'])"
        "\nexcept FileNotFoundError: print('missing', flush=True)"
        f"\nos.mkdir('{where}'); shutil.copy('/usr/bin/true', '{where}/tool')"
        f"\nos.execv('{where}/tool', ['tool', 'now'])"
    )
    out = run(g, sys.executable, "-c", code)
    assert (out.returncode, out.stdout) == (0, "missing\n"), out
    assert [c.argv for c in rec.calls][1:] == [("tool", "now")]
