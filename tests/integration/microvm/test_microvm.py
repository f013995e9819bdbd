"""The microvm backend against real QEMU: create from a template, exec and files through the
guest agent, stop/start, snapshot/restore/fork, reset verification, and a destroy that leaves
nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import anyio
import pytest

from sandlot.backends.microvm import ImagePaths, MicrovmBackend, ResetVerificationFailed, qemu
from sandlot.backends.microvm.image import build_image, verify_image
from sandlot.channel.client import AgentChannel
from sandlot.errors import InvalidRequest, NotSupported
from sandlot.models import NetworkAllowlist, Resources, SandboxSpec, new_id

# The first test to need the image may build it (about a minute, longer on a busy machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def _sh(backend: MicrovmBackend, ref: str, script: str) -> str:
    channel = await backend.channel(ref)
    try:
        result = await channel.exec(["/bin/sh", "-c", script], timeout=60)
    finally:
        await channel.close()
    assert result.exit_code == 0, result.stderr
    return result.stdout


async def _read(backend: MicrovmBackend, ref: str, path: str) -> bytes:
    channel = await backend.channel(ref)
    try:
        return b"".join([chunk async for chunk in channel.read_file(path)])
    finally:
        await channel.close()


async def _write(backend: MicrovmBackend, ref: str, path: str, data: bytes) -> None:
    channel = await backend.channel(ref)
    try:
        await channel.write_file(path, data)
    finally:
        await channel.close()


def test_image_is_cached_and_matches_its_manifest(microvm_image: ImagePaths) -> None:
    assert verify_image(microvm_image) == []
    manifest = json.loads((microvm_image.directory / "manifest.json").read_text())
    assert set(manifest["sha256"]) == {"vmlinuz", "initrd.img", "rootfs.qcow2"}
    started = time.monotonic()
    again = build_image()
    assert again.directory == microvm_image.directory
    assert time.monotonic() - started < 10  # no rebuild: only apt-cache look-ups


async def test_create_exec_files_and_destroy_leaves_nothing(
    backend: MicrovmBackend, spec: SandboxSpec, microvm_state: Path
) -> None:
    sid = new_id("sb")
    ref = await backend.create(sid, spec)
    vm_dir = microvm_state / "vms" / ref
    pid = qemu.read_pid(vm_dir)
    assert pid is not None
    assert (await backend.inspect(ref)).state == "running"
    assert await backend.list_owned() == {sid: ref}

    out = await _sh(backend, ref, "uname -r; cat /proc/1/comm; pwd; date +%s")
    kernel, comm, cwd, guest_now = out.split()
    assert kernel.endswith("-cloud-amd64")  # a separate guest kernel, not the host's
    assert kernel != os.uname().release
    assert comm.startswith("python")
    assert cwd == "/workspace"
    assert abs(int(guest_now) - time.time()) < 5  # the restored clock was set

    # The clock is set by the agent itself (no program started): it takes whatever it is given.
    channel = await backend.channel(ref)
    try:
        assert isinstance(channel, AgentChannel)
        assert "clock.set" in channel.agent_info.ops
        await channel.set_clock(time.time() + 86400)
        ahead = int((await channel.exec(["date", "+%s"])).stdout)
        assert abs(ahead - time.time() - 86400) < 5
        with pytest.raises(InvalidRequest):
            await channel.set_clock(-1)
        await channel.set_clock(time.time())
    finally:
        await channel.close()

    payload = os.urandom(3 << 20)
    await _write(backend, ref, "/workspace/blob.bin", payload)
    assert await _read(backend, ref, "/workspace/blob.bin") == payload

    # The create is idempotent: a retry adopts the running VM.
    assert await backend.create(sid, spec) == ref
    assert qemu.read_pid(vm_dir) == pid

    await backend.destroy(ref)
    assert not vm_dir.exists()
    assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    assert await backend.list_owned() == {}
    assert (await backend.inspect(ref)).state == "missing"
    await backend.destroy(ref)  # a missing sandbox is not an error


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


async def test_a_create_killed_before_its_record_is_listed_and_destroyed(
    backend: MicrovmBackend,
) -> None:
    vm_dir = backend._root / "vms" / new_id("sb")
    vm_dir.mkdir()
    (vm_dir / "disk.qcow2").write_bytes(b"partial")
    assert (await backend.list_owned()).get(vm_dir.name) == vm_dir.name
    await backend.destroy(vm_dir.name)
    assert not vm_dir.exists()


async def test_stop_keeps_disk_and_memory(backend: MicrovmBackend, spec: SandboxSpec) -> None:
    assert backend.capabilities().pause_memory
    ref = await backend.create(new_id("sb"), spec)
    await _write(backend, ref, "/workspace/kept.txt", b"still here")
    channel = await backend.channel(ref)
    try:
        proc = await channel.start_process(["sleep", "1000"], name="sleeper")
    finally:
        await channel.close()
    await backend.stop(ref)
    state = await backend.inspect(ref)
    assert state.state == "stopped"
    assert qemu.read_pid(backend._vm_dir(ref)) is None

    await backend.start(ref, spec)
    assert await _read(backend, ref, "/workspace/kept.txt") == b"still here"
    channel = await backend.channel(ref)
    try:
        procs = {p.id: p for p in await channel.list_processes()}
    finally:
        await channel.close()
    assert procs[proc.id].running  # memory survived: the process did too
    assert procs[proc.id].pid == proc.pid
    await backend.destroy(ref)


async def test_snapshot_restore_and_fork(backend: MicrovmBackend, spec: SandboxSpec) -> None:
    ref = await backend.create(new_id("sb"), spec)
    await _write(backend, ref, "/workspace/state.txt", b"v1")
    snap = await backend.snapshot(ref, new_id("snap"))
    assert snap.size_bytes > 0
    await _write(backend, ref, "/workspace/state.txt", b"v2")
    await _write(backend, ref, "/workspace/later.txt", b"after the snapshot")

    await backend.restore(ref, snap, spec)
    assert await _read(backend, ref, "/workspace/state.txt") == b"v1"
    assert "later.txt" not in await _sh(backend, ref, "ls /workspace")

    [child] = await backend.fork(snap, [new_id("sb")], spec)
    assert await _read(backend, child, "/workspace/state.txt") == b"v1"
    await _write(backend, child, "/workspace/state.txt", b"child")
    assert await _read(backend, ref, "/workspace/state.txt") == b"v1"  # no sharing

    await backend.destroy(child)
    await backend.destroy(ref)
    await backend.delete_snapshot(snap)
    await backend.delete_snapshot(snap)


async def test_reset_verifies_and_catches_a_tampered_overlay(
    backend: MicrovmBackend, spec: SandboxSpec
) -> None:
    ref = await backend.create(new_id("sb"), spec)
    await _write(backend, ref, "/workspace/dirty.txt", b"x" * 100_000)
    await _sh(backend, ref, "sleep 300 </dev/null >/dev/null 2>&1 & sync")

    report = await backend.reset_to_baseline(ref)
    assert report.ok, report.to_dict()
    assert {c.source for c in report.checks} == {"disk", "vmm", "guest_fds"}
    assert "dirty.txt" not in await _sh(backend, ref, "ls /workspace")

    report = await backend.reset_to_baseline(ref)
    assert report.ok
    # The host changes the overlay behind the VM's back: verification must notice.
    disk = backend._vm_dir(ref) / "disk.qcow2"
    with open(disk, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(ResetVerificationFailed) as caught:
        await backend.verify(ref)
    assert caught.value.details["diverged"] == ["disk"]
    verification = caught.value.details["verification"]
    assert isinstance(verification, dict)
    assert verification["ok"] is False
    await backend.destroy(ref)


async def test_reset_resumes_a_standby_and_still_verifies_it(
    backend: MicrovmBackend, spec: SandboxSpec
) -> None:
    ref = await backend.create(new_id("sb"), spec)
    vm_dir = backend._vm_dir(ref)
    await _write(backend, ref, "/workspace/dirty.txt", b"x")
    await backend.reset_to_baseline(ref)  # a plain restore, which starts a standby
    standby = vm_dir / "standby"
    standby_pid = qemu.read_pid(standby)
    assert standby_pid is not None
    async with await backend._qmp(standby) as q:
        assert await q.status() == "paused"  # loaded, not running: it uses no guest CPU

    await _write(backend, ref, "/workspace/dirty.txt", b"x")
    assert (await backend.reset_to_baseline(ref)).ok
    assert qemu.read_pid(vm_dir) == standby_pid  # the standby became the VM
    assert "dirty.txt" not in await _sh(backend, ref, "ls /workspace")
    assert abs(int(await _sh(backend, ref, "date +%s")) - time.time()) < 5
    next_pid = qemu.read_pid(standby)
    assert next_pid is not None
    assert next_pid != standby_pid
    # QEMU reopens its disk by the path it was started with when a migration ends (stop,
    # snapshot): that path must still lead to the disk.
    await backend.stop(ref)
    await backend.start(ref, spec)
    assert "dirty.txt" not in await _sh(backend, ref, "ls /workspace")
    await backend.reset_to_baseline(ref)  # no standby after a stop: this makes one
    await backend.reset_to_baseline(ref)
    snap = await backend.snapshot(ref, new_id("snap"))
    await backend.delete_snapshot(snap)

    # The host changes the standby's overlay before it is used: the reset must notice.
    with open(standby / "disk.qcow2", "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(ResetVerificationFailed) as caught:
        await backend.reset_to_baseline(ref)
    assert caught.value.details["diverged"] == ["disk"]

    pids = [qemu.read_pid(vm_dir), qemu.read_pid(standby)]
    await backend.destroy(ref)
    assert not vm_dir.exists()
    for pid in pids:
        assert pid is None or not Path(f"/proc/{pid}").exists() or _zombie(pid)


async def test_create_resumes_the_standby_the_create_before_made(
    backend: MicrovmBackend, spec: SandboxSpec, microvm_state: Path
) -> None:
    # An object's first create makes none (a one-shot CLI process would only remove it).
    await backend.destroy(await backend.create(new_id("sb"), spec))
    assert not list((microvm_state / "standby").glob("*/ready"))
    first = await backend.create(new_id("sb"), spec)
    [ready] = list((microvm_state / "standby").glob("*/ready"))
    standby_pid = qemu.read_pid(ready)
    assert standby_pid is not None
    async with await backend._qmp(ready) as q:
        assert await q.status() == "paused"

    second = await backend.create(new_id("sb"), spec)
    assert qemu.read_pid(backend._vm_dir(second)) == standby_pid  # the standby became it
    assert abs(int(await _sh(backend, second, "date +%s")) - time.time()) < 5
    await _write(backend, second, "/workspace/mine.txt", b"second")
    assert "mine.txt" not in await _sh(backend, first, "ls /workspace")  # disks of their own
    next_pid = qemu.read_pid(ready)
    assert next_pid is not None
    assert next_pid != standby_pid
    await backend.stop(second)  # its files moved after QEMU started
    await backend.start(second, spec)
    assert (await _sh(backend, second, "cat /workspace/mine.txt")) == "second"

    await backend.aclose()  # removes the standby this object made
    assert not ready.exists()
    assert not Path(f"/proc/{next_pid}").exists() or _zombie(next_pid)


async def test_reset_notices_a_changed_guest(backend: MicrovmBackend, spec: SandboxSpec) -> None:
    ref = await backend.create(new_id("sb"), spec)
    await backend.reset_to_baseline(ref)
    # An extra open descriptor in the guest (a background process holding files).
    channel = await backend.channel(ref)
    try:
        await channel.start_process(["sh", "-c", "exec 7</etc/hostname; sleep 1000"])
    finally:
        await channel.close()
    with pytest.raises(ResetVerificationFailed) as caught:
        await backend.verify(ref)
    assert "guest_fds" in caught.value.details["diverged"]
    assert (await backend.reset_to_baseline(ref)).ok
    await backend.destroy(ref)


async def test_both_fd_counts_see_a_process_left_behind(
    backend: MicrovmBackend, spec: SandboxSpec
) -> None:
    # New baselines count with the agent's fd.count; baselines made before it existed keep
    # being compared with the shell script's count. Both must see the same leftover.
    ref = await backend.create(new_id("sb"), spec)
    baseline = backend._record(ref).baseline
    assert baseline is not None
    assert baseline.fd_source == "agent"
    channel = await backend._agent(ref, backend._vm_dir(ref))
    before = {s: await backend._fd_count(channel, s) for s in ("agent", "shell")}
    assert before["agent"] == baseline.fd_count
    proc = await channel.start_process(["sh", "-c", "exec 7</etc/hostname; sleep 1000"])
    # The process is started, not necessarily past its redirection: wait until sleep runs.
    with anyio.fail_after(10):
        while "sleep" not in (await channel.exec(["sh", "-c", "cat /proc/[0-9]*/comm"])).stdout:
            await anyio.sleep(0.05)
    after = {s: await backend._fd_count(channel, s) for s in ("agent", "shell")}
    # sh holds 0-2 and 7 (then sleep inherits them): at least four more either way.
    assert after["agent"] >= before["agent"] + 4
    assert after["shell"] >= before["shell"] + 4
    await channel.signal_process(proc.id, 9)
    await backend.destroy(ref)


async def test_resources_map_to_the_vm(backend: MicrovmBackend) -> None:
    spec = SandboxSpec(network="deny-all", resources=Resources(memory_mb=384, vcpus=1.5))
    ref = await backend.create(new_id("sb"), spec)
    out = await _sh(backend, ref, "nproc; grep MemTotal /proc/meminfo")
    lines = out.split("\n")
    assert lines[0] == "2"  # 1.5 vCPUs round up
    mem_kb = int(lines[1].split()[1])
    assert 300_000 < mem_kb <= 384 * 1024
    await backend.destroy(ref)


async def test_refuses_what_it_cannot_enforce(backend: MicrovmBackend) -> None:
    kinds = backend.capabilities().network
    # What the host offers decides the kinds: a policy is never claimed it cannot enforce.
    root_tools = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "nft", "nsenter"))
    assert kinds == {"deny-all"} | ({"allowlist"} if shutil.which("socat") else set()) | (
        {"allow-all"} if root_tools else set()
    )
    for policy in ("allow-all", NetworkAllowlist(allow_domains=["example.com"])):
        kind = "allow-all" if policy == "allow-all" else "allowlist"
        if kind not in kinds:  # e.g. allow-all without root, allowlists without socat
            with pytest.raises(NotSupported):
                await backend.create(new_id("sb"), SandboxSpec(network=policy))
    with pytest.raises(NotSupported):
        await backend.create(new_id("sb"), SandboxSpec(network="deny-all", ports=[8080]))
    with pytest.raises(NotSupported):
        await backend.expose_port("sb-x", 80)
    assert await backend.list_owned() == {}


async def test_warm_pool_claim_and_drain(microvm_image: ImagePaths, microvm_state: Path) -> None:
    backend = MicrovmBackend(microvm_state, image=microvm_image, pool_size=1)
    backend._spawn_refill = lambda machine: None  # type: ignore[method-assign]  # no detached refill in a test
    try:
        assert await backend.fill_pool() == 1
        assert await backend.fill_pool() == 0  # full already
        [pooled] = list((microvm_state / "pool").glob("*/pool-*"))
        pooled_pid = qemu.read_pid(pooled)
        assert pooled_pid is not None

        sid = new_id("sb")
        started = time.monotonic()
        ref = await backend.create(sid, SandboxSpec(network="deny-all"))
        assert time.monotonic() - started < 1.0  # a rename, not a restore
        assert not pooled.exists()
        assert qemu.read_pid(backend._vm_dir(ref)) == pooled_pid  # the same QEMU, moved
        out = await _sh(backend, ref, "echo pooled; date +%s")
        assert out.split()[0] == "pooled"
        assert abs(int(out.split()[1]) - time.time()) < 5
        # Its files moved after QEMU started; saving its memory must still work.
        await backend.stop(ref)
        await backend.start(ref, SandboxSpec(network="deny-all"))
        assert (await _sh(backend, ref, "echo again")).strip() == "again"
        await backend.destroy(ref)
        assert qemu.read_pid(backend._vm_dir(ref)) is None

        assert await backend.fill_pool() == 1
        await backend.drain_pool()
        assert list((microvm_state / "pool").glob("*/pool-*")) == []
    finally:
        await backend.drain_pool()
        await backend.aclose()
