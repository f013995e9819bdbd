"""Attacks from inside a sandbox that must fail, under crun and under gVisor.

Each test is one attempt to get out or to touch the host: its secrets, files, processes,
network, name, clock, kernel settings, environment, container runtimes. The sandbox is root
inside, so every failure here comes from the isolation, not from missing permissions of an
ordinary user.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from sandlot.backends.local import LocalBackend
from sandlot.errors import NotFound, SandboxError
from sandlot.models import ExecResult, new_id


async def run(backend: LocalBackend, ref: str, *argv: str, timeout: float = 60) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(list(argv), timeout=timeout)
    finally:
        await channel.close()


async def sh(backend: LocalBackend, ref: str, script: str, timeout: float = 60) -> ExecResult:
    return await run(backend, ref, "sh", "-c", script, timeout=timeout)


async def py(backend: LocalBackend, ref: str, code: str, timeout: float = 60) -> ExecResult:
    return await run(backend, ref, "python3", "-c", code, timeout=timeout)


async def test_cannot_read_a_host_secret(backend, sandbox, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    for path in (secret, Path("/root/.bash_history"), Path("/etc/shadow")):
        result = await sh(backend, sandbox, f"cat {path} /proc/1/root{path} 2>&1")
        assert "top secret" not in result.stdout
    result = await sh(backend, sandbox, f"ls {tmp_path} 2>&1; cat /etc/shadow 2>&1 | head -1")
    assert "secret.txt" not in result.stdout
    assert "root:" not in result.stdout  # the host's shadow file has a root entry
    channel = await backend.channel(sandbox)
    try:
        with pytest.raises(NotFound):
            await channel.stat(str(secret))
    finally:
        await channel.close()


async def test_cannot_write_outside(backend, sandbox) -> None:
    token = new_id("escape")
    result = await sh(
        backend,
        sandbox,
        f"echo x > /tmp/{token}; echo x > /etc/{token}; echo x > /root/{token};"
        f" echo x > /usr/{token} 2>/dev/null || echo usr-refused;"
        f" echo x > /proc/sys/kernel/{token} 2>/dev/null || echo proc-refused",
    )
    assert "usr-refused" in result.stdout
    assert "proc-refused" in result.stdout
    for path in (f"/tmp/{token}", f"/etc/{token}", f"/root/{token}", f"/usr/{token}"):
        assert not Path(path).exists(), f"{path} appeared on the host"


async def test_cannot_see_or_signal_host_processes(backend, sandbox) -> None:
    marker = new_id("hostproc").replace("-", "")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    try:
        listing = await sh(backend, sandbox, "ps -eo pid,args")
        assert marker not in listing.stdout
        assert len(listing.stdout.splitlines()) < 10
        result = await sh(backend, sandbox, f"kill -9 {victim.pid} 2>&1; kill -9 -1 2>&1; true")
        assert result.exit_code == 0
        time.sleep(0.2)
        assert victim.poll() is None, "a host process died"
    finally:
        victim.kill()
        victim.wait()


async def test_symlinks_cannot_lead_file_operations_out(backend, sandbox, tmp_path) -> None:
    host_file = tmp_path / "host-target.txt"
    host_file.write_text("host data\n")
    host_hostname = Path("/etc/hostname").read_text() if Path("/etc/hostname").exists() else ""
    await sh(
        backend,
        sandbox,
        f"ln -sfn /etc/hostname /workspace/to-etc; ln -sfn {host_file} /workspace/to-host;"
        f" ln -sfn {tmp_path} /workspace/to-host-dir; ln -sfn /etc /workspace/etc-dir",
    )
    channel = await backend.channel(sandbox)
    try:
        # Reading through the link reads the sandbox's own file, never the host's.
        data = b"".join([c async for c in channel.read_file("/workspace/to-etc")])
        assert data == b"sandbox\n"
        assert data.decode() != host_hostname or host_hostname == "sandbox\n"
        with pytest.raises(NotFound):
            b"".join([c async for c in channel.read_file("/workspace/to-host")])
        # Writing through links changes only the sandbox's view (or is refused).
        for path, data in (
            ("/workspace/to-host", b"overwritten\n"),
            ("/workspace/to-host-dir/planted.txt", b"planted\n"),
            ("/workspace/etc-dir/hostname", b"renamed\n"),
        ):
            with contextlib.suppress(SandboxError):
                await channel.write_file(path, data)
        inside = b"".join([c async for c in channel.read_file("/etc/hostname")])
    finally:
        await channel.close()
    assert host_file.read_text() == "host data\n"
    assert not (tmp_path / "planted.txt").exists()
    if host_hostname:
        assert Path("/etc/hostname").read_text() == host_hostname
    assert inside in (b"sandbox\n", b"renamed\n")


FORK_BOMB = """
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""


async def test_fork_bomb_is_contained(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("atk"), spec_for(isolation, resources={"pids": 48}))
    peak = 0
    pids_current = list(Path("/sys/fs/cgroup/pids/sandlot").glob(f"*/sl-{ref}/pids.current"))
    async with anyio.create_task_group() as tg:
        results: list[ExecResult] = []

        async def bomb() -> None:
            # Every process forks forever and retries when refused, until the timeout kills
            # the whole tree.
            results.append(await py(backend, ref, FORK_BOMB, timeout=4))

        tg.start_soon(bomb)
        await anyio.sleep(1.5)
        # The host stays responsive while the bomb runs.
        start = time.monotonic()
        subprocess.run(["true"], check=True)
        assert time.monotonic() - start < 1.0
        for path in pids_current:
            peak = max(peak, int(path.read_text()))
    assert results[0].timed_out
    if isolation == "namespaces":
        assert 40 <= peak <= 48
    after = await run(backend, ref, "echo", "alive")
    assert after.stdout == "alive\n", after
    await backend.destroy(ref)


async def test_memory_hog_is_killed_and_recorded(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("atk"), spec_for(isolation, resources={"memory_mb": 96}))
    hog = "b = bytearray(1 << 30)"
    try:
        result: ExecResult | None = await py(backend, ref, hog)
    except Exception:
        result = None  # under gVisor the whole sandbox is one host process: it is the one killed
    if result is not None and (result.oom_killed or isolation == "namespaces"):
        assert result.oom_killed
        assert result.signal == 9
    else:
        with anyio.fail_after(20):
            while (state := await backend.inspect(ref)).state == "running":
                await anyio.sleep(0.05)
        assert (state.state, state.reason) == ("stopped", "oom")
    await backend.destroy(ref)


PTRACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    import time; time.sleep(5); os._exit(0)
r = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
print(r, ctypes.get_errno())
os.kill(pid, 9)
"""
UNSHARE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for flag in (0x10000000, 0x00020000, 0x40000000):  # user, mount, net
    print(libc.unshare(flag), ctypes.get_errno())
"""


async def test_mount_ptrace_and_unshare_are_denied(backend, sandbox) -> None:
    result = await sh(backend, sandbox, "mkdir -p /mnt/x; mount -t tmpfs none /mnt/x; echo rc=$?")
    assert "rc=0" not in result.stdout
    result = await sh(backend, sandbox, "mount --bind /usr /mnt/x; echo rc=$?")
    assert "rc=0" not in result.stdout
    ptrace = await py(backend, sandbox, PTRACE)
    assert ptrace.stdout.split()[0] == "-1", ptrace
    unshare = await py(backend, sandbox, UNSHARE)
    assert all(line.split()[0] == "-1" for line in unshare.stdout.splitlines()), unshare
    result = await sh(backend, sandbox, "unshare -U -r id 2>&1; echo rc=$?")
    assert "rc=0" not in result.stdout


async def test_host_loopback_is_unreachable(backend, sandbox) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = (
            "import socket\n"
            f"for host in ('127.0.0.1', '10.0.2.2', '169.254.169.254'):\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            f"    try:\n        s.connect((host, {port})); print('connected', host)\n"
            "    except OSError as e:\n        print('refused', host, e.errno)\n"
        )
        result = await py(backend, sandbox, code)
        assert "connected" not in result.stdout
        assert result.stdout.count("refused") == 3
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


async def test_host_name_time_and_sysctls_cannot_change(backend, sandbox, isolation) -> None:
    sysctls = ["kernel/hostname", "kernel/domainname", "vm/swappiness", "net/ipv4/ip_forward"]
    before = {k: Path("/proc/sys", k).read_text() for k in sysctls}
    host_time = time.time()
    result = await sh(
        backend,
        sandbox,
        "hostname evil 2>&1; echo rc=$?; date -s '2001-01-01' 2>&1; echo rc=$?;"
        + "".join(f"echo 1 > /proc/sys/{k} 2>&1; echo rc=$?;" for k in sysctls),
    )
    if isolation == "namespaces":
        assert "rc=0" not in result.stdout, result.stdout
    else:
        # gVisor's /proc/sys belongs to its own kernel; the name and the clock are refused.
        assert result.stdout.count("rc=0") <= 1, result.stdout
    assert {k: Path("/proc/sys", k).read_text() for k in sysctls} == before
    assert abs(time.time() - host_time) < 30
    assert (await run(backend, sandbox, "hostname")).stdout == "sandbox\n"


async def test_host_environment_is_invisible(backend, sandbox, host_secret) -> None:
    assert os.environ.get("SANDLOT_ATTACK_SUITE_SECRET") == host_secret
    result = await sh(backend, sandbox, "env; cat /proc/1/environ; cat /proc/self/environ")
    assert host_secret not in result.stdout
    assert "SANDLOT_ATTACK_SUITE_SECRET" not in result.stdout


async def test_container_runtime_sockets_are_unreachable(backend, sandbox) -> None:
    paths = [
        "/run/docker.sock",
        "/var/run/docker.sock",
        "/run/containerd/containerd.sock",
        "/run/crun",
        "/run/runc",
        "/run/sandlot",
        str(backend.run_dir),
        str(backend.state_dir),
        f"{backend.state_dir}/{sandbox}/agent.sock",
    ]
    result = await sh(backend, sandbox, " ".join(f"ls -d {p} 2>/dev/null;" for p in paths) + "true")
    assert result.stdout == ""
    code = (
        "import socket\n"
        f"for p in {paths!r}:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n        s.connect(p); print('connected', p)\n"
        "    except OSError:\n        pass\n"
    )
    assert "connected" not in (await py(backend, sandbox, code)).stdout


FILL = """
import os
if not os.path.isdir("/.sandlot/run"):
    print("absent")
else:
    written = 0
    try:
        with open("/.sandlot/run/fill", "wb") as f:
            for _ in range(64):
                written += f.write(b"x" * (128 << 10))
                f.flush()
    except OSError as e:
        print("refused", e.errno)
    print(written)
"""


async def test_the_agent_socket_directory_cannot_fill_the_host(backend, sandbox, isolation) -> None:
    lines = (await py(backend, sandbox, FILL)).stdout.split()
    if isolation == "namespaces":
        # crun hands the agent its socket as a file descriptor: no host directory is mounted.
        assert lines == ["absent"]
    else:
        # gVisor's agent binds its socket on a host directory: a 64 KiB tmpfs of its own.
        assert lines[0] == "refused"
        assert int(lines[-1]) <= 64 << 10


async def test_denials_hold_with_the_reused_seccomp_program(backend, isolation, spec_for) -> None:
    # crun compiles the profile for the first sandbox; later ones get that program back
    # through an annotation. The filter they run under must deny the same calls.
    first = await backend.create(new_id("atk"), spec_for(isolation))
    ref = await backend.create(new_id("atk"), spec_for(isolation))
    config = (backend.state_dir / ref / "config.json").read_text()
    if isolation == "namespaces":
        assert "run.oci.seccomp_bpf_data" in config
        status = (await sh(backend, ref, "grep ^Seccomp /proc/self/status")).stdout
        assert "Seccomp:\t2" in status, status
    unshare = await py(backend, ref, UNSHARE)
    assert all(line.split()[0] == "-1" for line in unshare.stdout.splitlines()), unshare
    ptrace = await py(backend, ref, PTRACE)
    assert ptrace.stdout.split()[0] == "-1", ptrace
    result = await sh(backend, ref, "mkdir -p /mnt/x; mount -t tmpfs none /mnt/x; echo rc=$?")
    assert "rc=0" not in result.stdout
    for r in (first, ref):
        await backend.destroy(r)
