"""What a local sandbox is made of: namespaces, its uid range, its root view, its limits."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from sandlot.backends.local import LocalBackend
from sandlot.models import ExecResult, new_id

NAMESPACES = ("pid", "mnt", "net", "ipc", "uts", "cgroup", "user")


async def run(backend: LocalBackend, ref: str, *argv: str, timeout: float = 60) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(list(argv), timeout=timeout)
    finally:
        await channel.close()


async def sh(backend: LocalBackend, ref: str, script: str, timeout: float = 60) -> ExecResult:
    return await run(backend, ref, "sh", "-c", script, timeout=timeout)


def upper(backend: LocalBackend, ref: str) -> Path:
    return backend.state_dir / ref / "layer" / "upper"


async def test_every_namespace_is_new(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation))
    # The sandbox's process on the host: the agent (crun) or gVisor's kernel (runsc).
    pid = int((backend.state_dir / ref / "init.pid").read_text())
    # gVisor's kernel (ptrace platform) stays in the host's pid and cgroup namespaces by design:
    # the sandbox's processes are its own, invisible to the host kernel as such.
    expected = NAMESPACES if isolation == "namespaces" else ("mnt", "net", "ipc", "uts", "user")
    for ns in expected:
        ours = Path(f"/proc/self/ns/{ns}").readlink()
        theirs = Path(f"/proc/{pid}/ns/{ns}").readlink()
        assert theirs != ours, f"the sandbox shares the host's {ns} namespace"
    if isolation == "namespaces":
        script = "; ".join(f"readlink /proc/self/ns/{ns}" for ns in NAMESPACES)
        inside = (await sh(backend, ref, script)).stdout.split()
        assert inside == [str(Path(f"/proc/{pid}/ns/{ns}").readlink()) for ns in NAMESPACES]
    # Only loopback, and our own host name.
    assert (await run(backend, ref, "cat", "/proc/net/dev")).stdout.count(":") == 1
    assert (await run(backend, ref, "hostname")).stdout == "sandbox\n"


async def test_root_inside_is_an_unprivileged_host_uid(backend, isolation, spec_for) -> None:
    a = await backend.create(new_id("sb"), spec_for(isolation))
    b = await backend.create(new_id("sb"), spec_for(isolation))
    assert (await run(backend, a, "id", "-u")).stdout == "0\n"
    for ref in (a, b):
        await sh(backend, ref, "echo x > /workspace/owned; mkdir -p /root/dir")
    owners = []
    for ref in (a, b):
        st = (upper(backend, ref) / "workspace" / "owned").stat()
        assert st.st_uid >= 1 << 20
        assert st.st_gid >= 1 << 20
        assert (upper(backend, ref) / "root" / "dir").stat().st_uid == st.st_uid
        owners.append(st.st_uid)
    ranges = sorted(backend.uid_ranges())
    assert len(ranges) == 2
    assert ranges[1] - ranges[0] >= 65536
    assert sorted(owners) == ranges
    if isolation == "namespaces":
        uid_map = (await run(backend, a, "cat", "/proc/self/uid_map")).stdout.split()
        assert uid_map[0] == "0"
        assert int(uid_map[1]) in ranges
        assert uid_map[2] == "65536"


async def test_privileges_are_dropped(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation))
    status = dict(
        line.split(":\t", 1)
        for line in (await run(backend, ref, "cat", "/proc/self/status")).stdout.splitlines()
        if ":\t" in line
    )
    # gVisor's /proc does not show NoNewPrivs or Seccomp; the sandbox's kernel is not the host's.
    assert status.get("NoNewPrivs", "1").strip() == "1"
    cap_sys_admin, cap_sys_ptrace, cap_net_raw, cap_sys_module = 21, 19, 13, 16
    eff = int(status["CapEff"], 16)
    for cap in (cap_sys_admin, cap_sys_ptrace, cap_net_raw, cap_sys_module):
        assert not eff & (1 << cap)
    assert int(status["CapBnd"], 16) == eff
    if isolation == "namespaces":
        assert status["Seccomp"].strip() == "2"


async def test_default_root_view(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation))
    result = await sh(
        backend,
        ref,
        "touch /usr/bin/x 2>/dev/null && echo usr-writable;"
        "echo sys > /proc/sys/kernel/domainname 2>/dev/null && echo procsys-writable;"
        "touch /sys/x 2>/dev/null && echo sys-writable;"
        "head -c 16 /proc/kcore 2>/dev/null | wc -c;"
        "touch /tmp/t /home/t /workspace/t /etc/t && echo writable;"
        "head -1 /etc/passwd; cat /etc/hostname; test -x /usr/bin/python3 && echo python",
    )
    assert result.stdout.split("\n") == [
        "0",
        "writable",
        "root:x:0:0:root:/root:/bin/sh",
        "sandbox",
        "python",
        "",
    ]
    # The host's /usr is shown as root's, read-only.
    assert (await run(backend, ref, "stat", "-c", "%u", "/usr/bin/env")).stdout == "0\n" or (
        isolation == "gvisor"
    )


async def test_memory_limit_kills_the_hog(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation, resources={"memory_mb": 96}))
    hog = "b = bytearray(400 << 20); print(len(b))"
    if isolation == "namespaces":
        result = await run(backend, ref, "python3", "-c", hog)
        assert (result.signal, result.oom_killed) == (9, True)
        assert (await run(backend, ref, "echo", "alive")).stdout == "alive\n"
    else:
        # gVisor's kernel is one host process: the host kills the sandbox, and says why.
        try:
            result = await run(backend, ref, "python3", "-c", hog)
        except Exception:
            result = None
        if result is not None:
            assert result.exit_code != 0
        with anyio.fail_after(20):
            while (state := await backend.inspect(ref)).state == "running" and result is None:
                await anyio.sleep(0.05)
        if result is None:
            assert (state.state, state.reason) == ("stopped", "oom")


async def test_oom_of_the_init_is_reported(backend, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for("namespaces", resources={"memory_mb": 96}))
    channel = await backend.channel(ref)
    # A hog that waits a moment, then the agent made the OOM killer's first choice (after the
    # hog started, which would otherwise inherit the score).
    await channel.start_process(
        ["python3", "-c", "import time; time.sleep(1); b = bytearray(400 << 20); time.sleep(60)"]
    )
    await channel.exec(["sh", "-c", "echo 1000 > /proc/1/oom_score_adj"])
    with anyio.fail_after(30):
        while (state := await backend.inspect(ref)).state == "running":
            await anyio.sleep(0.05)
    assert (state.state, state.reason) == ("stopped", "oom")
    await channel.close()


FORK_COUNT = (
    "import os, signal, time\n"
    "kids = []\n"
    "for _ in range({n}):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "print(len(kids))\n"
    "for pid in kids:\n"
    "    os.kill(pid, signal.SIGKILL)\n"
    "    os.waitpid(pid, 0)\n"
)


async def test_pids_limit_holds(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation, resources={"pids": 32}))
    result = await run(backend, ref, "python3", "-c", FORK_COUNT.format(n=200))
    assert result.exit_code == 0, result.stderr
    forked = int(result.stdout)
    # The agent and the counting process hold pids too (and gVisor's kernel its threads).
    assert 10 <= forked < 32
    assert (await run(backend, ref, "echo", "still here")).stdout == "still here\n"


async def test_cpu_quota_holds(backend, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for("namespaces", resources={"vcpus": 0.25}))
    # Two busy loops for one second of wall time may use 0.25 s of CPU between them.
    script = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(2):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        end = time.time() + 1.0\n"
        "        while time.time() < end: pass\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "for pid in pids: os.waitpid(pid, 0)\n"
        "t = os.times(); print(t.children_user + t.children_system)\n"
    )
    start = time.monotonic()
    result = await run(backend, ref, "python3", "-c", script)
    wall = time.monotonic() - start
    assert result.exit_code == 0, result.stderr
    assert float(result.stdout) <= 0.25 * wall + 0.15


async def test_disk_limit_holds(backend, isolation, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation, resources={"disk_mb": 24}))
    result = await sh(
        backend, ref, "dd if=/dev/zero of=/workspace/big bs=1M count=64 2>&1; echo rc=$?"
    )
    assert "rc=0" not in result.stdout
    assert "No space left" in result.stdout
    size = int((await sh(backend, ref, "wc -c < /workspace/big")).stdout)
    assert size <= 24 << 20
    await backend.stop(ref)
    await backend.start(ref, spec_for(isolation, resources={"disk_mb": 24}))
    assert int((await sh(backend, ref, "wc -c < /workspace/big")).stdout) == size


@pytest.mark.parametrize("limit", [None, 64])
async def test_claimed_limits_match_cold_ones(make_backend, spec_for, limit) -> None:
    backend = make_backend(pool={"namespaces": 1})
    await backend.fill_pool()
    spec = spec_for("namespaces", resources={"memory_mb": limit, "pids": 16})
    ref = await backend.create(new_id("sb"), spec)
    assert backend.pooled() == []
    result = await run(backend, ref, "python3", "-c", FORK_COUNT.format(n=100))
    assert int(result.stdout) < 16
    if limit:
        hog = await run(backend, ref, "python3", "-c", "b = bytearray(300 << 20)")
        assert hog.oom_killed
