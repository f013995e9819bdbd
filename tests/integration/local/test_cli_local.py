"""The CLI on the real ``local`` backend, one process per command, as a new user runs it
(issue 13: a crashed sandbox, a failed setup, a missing working directory)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandlot.backends.local.runtime import process_alive

SANDLOT = [sys.executable, "-m", "sandlot"]


@pytest.fixture
def cli(tmp_path: Path):  # type: ignore[no-untyped-def]
    home = tmp_path / "home"
    env = {**os.environ, "SANDLOT_HOME": str(home), "SANDLOT_BACKEND": "local", "COLUMNS": "200"}
    made: list[str] = []

    def run(*args: str, stdin: str | None = "") -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*SANDLOT, *args], input=stdin, capture_output=True, text=True, env=env, timeout=120
        )
        made.extend(ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("sb-"))
        return proc

    run.home = home  # type: ignore[attr-defined]
    run.made = made  # type: ignore[attr-defined]
    yield run
    for sid in {*made, *_ids_in(home)}:
        run("destroy", sid)


def _ids_in(home: Path) -> list[str]:
    root = home / "backends" / "local"
    return [p.name for p in root.iterdir() if p.name.startswith("sb-")] if root.is_dir() else []


def _init(home: Path, sandbox_id: str) -> tuple[int, int]:
    meta = json.loads((home / "backends" / "local" / sandbox_id / "meta.json").read_text())
    pid, start = meta["init"]
    return int(pid), int(start)


def test_a_sandbox_whose_init_was_killed_is_seen_stopped_and_comes_back(cli) -> None:  # type: ignore[no-untyped-def]
    created = cli("create", "--network", "deny-all")
    assert created.returncode == 0, created.stderr
    sid = created.stdout.strip()
    assert cli("exec", sid, "--", "sh", "-c", "echo kept > /workspace/f").returncode == 0
    pid, start = _init(cli.home, sid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process_alive(pid, start) and time.monotonic() < deadline:
        time.sleep(0.05)

    got = json.loads(cli("get", sid, "--json").stdout)
    assert got["status"] == "stopped", got
    assert got["death"]["cause"] == "crashed"
    assert "killed or crashed" in got["death"]["message"] or "signal" in got["death"]["message"]

    refused = cli("exec", "--no-resume", sid, "--", "true")
    assert refused.returncode == 1
    assert "crashed" in refused.stderr

    # Any operation boots it again (files kept); so does resume, for real.
    ran = cli("exec", sid, "--", "cat", "/workspace/f")
    assert (ran.returncode, ran.stdout) == (0, "kept\n"), ran.stderr
    pid2, start2 = _init(cli.home, sid)
    assert process_alive(pid2, start2)
    os.kill(pid2, signal.SIGKILL)
    while process_alive(pid2, start2):
        time.sleep(0.05)
    resumed = cli("resume", sid, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["status"] == "running"
    assert process_alive(*_init(cli.home, sid)), "resume started it again"
    assert "death" not in json.loads(cli("get", sid, "--json").stdout) or (
        json.loads(cli("get", sid, "--json").stdout)["death"] is None
    )


def test_a_failed_setup_prints_the_sandbox_and_stops_it(cli) -> None:  # type: ignore[no-untyped-def]
    failed = cli("create", "--network", "deny-all", "--setup", "false")
    assert failed.returncode == 1
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith("error: setup step 1 exited with 1")
    sid = line.split("(sandbox ")[1].split()[0]
    assert sid.startswith("sb-")
    assert "kept" in line
    meta = json.loads((cli.home / "backends" / "local" / sid / "meta.json").read_text())
    assert meta["init"] is None or not process_alive(*meta["init"]), "its processes are stopped"
    as_json = cli("create", "--network", "deny-all", "--setup", "false", "--json")
    error = json.loads(as_json.stdout)["error"]
    assert error["details"]["sandbox_id"].startswith("sb-")
    assert error["details"]["kept_until"]


def test_run_whose_setup_fails_leaves_nothing(cli) -> None:  # type: ignore[no-untyped-def]
    ran = cli("run", "--network", "deny-all", "--setup", "false", "--", "true")
    assert ran.returncode == 1
    assert "was destroyed" in ran.stderr
    listed = json.loads(cli("list", "--json").stdout)
    assert listed == []
    assert _ids_in(cli.home) == [], "its backend sandbox is gone too"


def test_exec_in_a_missing_directory_is_one_line(cli) -> None:  # type: ignore[no-untyped-def]
    sid = cli("create", "--network", "deny-all").stdout.strip()
    for stdin in ("", None):  # streamed standard input (a pipe), and none
        bad = cli("exec", "--cwd", "/nonexistent", sid, "--", "ls", stdin=stdin)
        assert bad.returncode == 1
        assert bad.stderr.strip() == (
            "error: working directory /nonexistent: No such file or directory"
        ), bad.stderr


def _peak_rss_mib(argv: list[str], env: dict[str, str], stdin: Path | None = None) -> float:
    """Run a command and return its peak resident memory (MiB), from wait4's rusage."""
    with open(stdin or os.devnull, "rb") as f:
        proc = subprocess.Popen(argv, stdin=f, stdout=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, argv
    return usage.ru_maxrss / 1024


def test_write_and_read_file_stream_instead_of_holding_the_file(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sid = cli("create", "--network", "deny-all").stdout.strip()
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(256):
            f.write(chunk)
    env = {**os.environ, "SANDLOT_HOME": str(cli.home), "SANDLOT_BACKEND": "local"}
    baseline = _peak_rss_mib([*SANDLOT, "get", sid], env)
    for argv, stdin in (
        ([*SANDLOT, "write-file", sid, "/workspace/big.bin", str(big)], None),
        ([*SANDLOT, "write-file", sid, "/workspace/big2.bin"], big),
        ([*SANDLOT, "read-file", sid, "/workspace/big.bin", "--out", str(tmp_path / "back")], None),
    ):
        peak = _peak_rss_mib(argv, env, stdin)
        # A 256 MiB file held whole would add at least that much.
        assert peak < baseline + 64, (argv, peak, baseline)
    assert (tmp_path / "back").read_bytes() == big.read_bytes()
    size = cli("exec", sid, "--", "stat", "-c", "%s", "/workspace/big2.bin").stdout.strip()
    assert size == str(256 << 20)


def test_read_file_to_a_path_keeps_the_old_file_when_the_read_fails(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sid = cli("create", "--network", "deny-all").stdout.strip()
    keep = tmp_path / "keep.txt"
    keep.write_text("precious\n")
    failed = cli("read-file", sid, "/wrong/path", "--out", str(keep))
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: ")
    assert keep.read_text() == "precious\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".keep")] == []
    cli("exec", sid, "--", "sh", "-c", "echo fresh > /workspace/f")
    assert cli("read-file", sid, "/workspace/f", "--out", str(keep)).returncode == 0
    assert keep.read_text() == "fresh\n"


def test_exec_streams_big_output_in_bounded_memory(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sid = cli("create", "--network", "deny-all").stdout.strip()
    env = {**os.environ, "SANDLOT_HOME": str(cli.home), "SANDLOT_BACKEND": "local"}
    baseline = _peak_rss_mib([*SANDLOT, "exec", sid, "--", "true"], env)
    size = 300_000_000
    argv = [*SANDLOT, "exec", sid, "--", "head", "-c", str(size), "/dev/zero"]
    peak = _peak_rss_mib(argv, env)
    assert peak < baseline + 64, (peak, baseline)
    # And every byte arrived.
    counted = subprocess.run(
        f"{' '.join(argv)} | wc -c", shell=True, capture_output=True, text=True, env=env
    )
    assert counted.stdout.strip() == str(size)


def test_read_file_to_a_device_or_through_a_symlink_writes_in_place(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import stat

    sid = cli("create", "--network", "deny-all").stdout.strip()
    cli("exec", sid, "--", "sh", "-c", "echo data > /workspace/f")
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    assert cli("read-file", sid, "/workspace/f", "--out", str(null)).returncode == 0
    assert stat.S_ISCHR(null.lstat().st_mode), "a device was replaced by a regular file"
    real = tmp_path / "real.txt"
    real.write_text("old\n")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    assert cli("read-file", sid, "/workspace/f", "--out", str(link)).returncode == 0
    assert link.is_symlink()
    assert real.read_text() == "data\n"
