"""Lifecycle of local sandboxes: create, stop, start, destroy, adoption, and leaving nothing."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import anyio
import pytest

from sandlot.backends.base import BackendState
from sandlot.backends.local import LocalBackend
from sandlot.backends.local.ids import RANGE_SIZE
from sandlot.errors import InvalidRequest, InvalidState, NotSupported
from sandlot.models import ExecResult, SandboxSpec, new_id


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(["sh", "-c", script], timeout=60)
    finally:
        await channel.close()


async def wait_stopped(backend: LocalBackend, ref: str) -> BackendState:
    with anyio.fail_after(10):
        while (state := await backend.inspect(ref)).state == "running":
            await anyio.sleep(0.01)
    return state


async def test_stop_keeps_the_writable_layer(backend, isolation, spec_for) -> None:
    sid = new_id("sb")
    spec = spec_for(isolation, env={"GREETING": "hello"}, workdir="/work/dir")
    ref = await backend.create(sid, spec)
    assert ref == sid
    assert (await backend.inspect(ref)).state == "running"
    assert (await backend.list_owned()) == {sid: ref}

    result = await sh(backend, ref, 'echo "$GREETING from $(pwd)"; echo kept > /etc/marker')
    assert (result.exit_code, result.stdout) == (0, "hello from /work/dir\n")
    channel = await backend.channel(ref)
    await channel.write_file("/work/dir/data.bin", b"\x00\x01" * 1000)
    await channel.close()

    await backend.stop(ref)
    state = await backend.inspect(ref)
    assert (state.state, state.reason) == ("stopped", "stopped")
    with pytest.raises(InvalidState):
        await backend.channel(ref)

    await backend.start(ref, spec)
    assert (await backend.inspect(ref)).state == "running"
    result = await sh(backend, ref, "cat /etc/marker; wc -c < /work/dir/data.bin")
    assert result.stdout.split() == ["kept", "2000"]

    await backend.destroy(ref)
    assert (await backend.inspect(ref)).state == "missing"
    assert await backend.list_owned() == {}
    await backend.destroy(ref)  # a missing sandbox is not an error


async def test_create_adopts_what_an_earlier_attempt_made(make_backend, spec_for) -> None:
    first = make_backend()
    sid = new_id("sb")
    spec = spec_for("namespaces")
    ref = await first.create(sid, spec)
    await sh(first, ref, "echo one > /workspace/f")

    # Another process (a retried create after a crash) finds the same sandbox running.
    second = make_backend()
    assert await second.create(sid, spec) == ref
    assert (await sh(second, ref, "cat /workspace/f")).stdout == "one\n"
    assert list((await second.list_owned()).items()) == [(sid, ref)]

    # Its init died behind our back: create again boots it, with its files.
    pid = int((Path(second.state_dir) / sid / "init.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    assert (await wait_stopped(second, ref)).state == "stopped"
    assert await second.create(sid, spec) == ref
    assert (await second.inspect(ref)).state == "running"
    assert (await sh(second, ref, "cat /workspace/f")).stdout == "one\n"


async def test_inspect_reports_why_it_stopped(backend, spec_for) -> None:
    ref = await backend.create(new_id("sb"), spec_for("namespaces"))
    pid = int((backend.state_dir / ref / "init.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    state = await wait_stopped(backend, ref)
    assert (state.state, state.reason) == ("stopped", "exited")
    assert "SIGKILL" in state.detail
    assert (await backend.inspect("sb-nope")).state == "missing"


async def test_requests_it_cannot_honour_are_refused(backend) -> None:
    sid = new_id("sb")
    with pytest.raises(InvalidRequest, match="'speed'"):
        await backend.create(
            sid, SandboxSpec(network="deny-all", backend_options={"local": {"speed": 1}})
        )
    with pytest.raises(InvalidRequest, match="isolation"):
        await backend.create(
            sid, SandboxSpec(network="deny-all", backend_options={"local": {"isolation": "vm"}})
        )
    with pytest.raises(NotSupported, match="allow-all"):
        await backend.create(sid, SandboxSpec())
    with pytest.raises(NotSupported, match="ports"):
        await backend.create(sid, SandboxSpec(network="deny-all", ports=[8080]))
    with pytest.raises(InvalidRequest):
        await backend.create("../escape", SandboxSpec(network="deny-all"))
    assert await backend.list_owned() == {}
    ref = await backend.create(sid, SandboxSpec(network="deny-all"))
    with pytest.raises(NotSupported):
        await backend.expose_port(ref, 8080)


def _footprint(backend: LocalBackend, ranges: set[int] | None = None) -> dict[str, set[str]]:
    """Everything on the host that could belong to this backend's sandboxes.

    Processes count when they name this backend's directories or run under one of its uid
    ranges (``ranges``: first uids, default those recorded now); other suites may run sandboxes
    of their own on this host at the same time.
    """
    bases = set(backend.uid_ranges()) if ranges is None else ranges
    state = str(backend.state_dir)
    run = str(backend.run_dir)
    tag = backend.run_dir.name
    mounts = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split(" ")[4]
            if point.startswith((state, run)):
                mounts.add(point)
    cgroups = set()
    for root in Path("/sys/fs/cgroup").iterdir():
        base = root / "sandlot" / tag
        if base.is_dir():
            cgroups.update(str(p) for p in base.iterdir() if p.is_dir())
    processes = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            uid = (entry / "status").read_text().split("\nUid:\t", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        ours = any(b <= int(uid) < b + RANGE_SIZE for b in bases)
        if run in cmdline or state in cmdline or ours:
            processes.add(f"{entry.name} {cmdline}")
    runtime_state = {
        str(p)
        for sub in ("crun", "runsc", "mnt")
        if (backend.run_dir / sub).is_dir()
        for p in (backend.run_dir / sub).iterdir()
    }
    loops = set()
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().startswith(state):
                loops.add(str(backing.parent.parent.name))
    files = {str(p) for p in backend.state_dir.iterdir() if not p.name.startswith(".")} | {
        str(p) for p in (backend.state_dir / ".locks").iterdir()
    }
    return {
        "mounts": mounts,
        "cgroups": cgroups,
        "processes": processes,
        "runtime": runtime_state,
        "files": files,
        "uid_ranges": {str(b) for b in backend.uid_ranges()},
        "loop_devices": loops,
    }


async def test_destroy_leaves_nothing(backend, isolation, spec_for) -> None:
    before = _footprint(backend)
    refs = [
        await backend.create(new_id("sb"), spec_for(isolation, resources={"memory_mb": 128})),
        await backend.create(new_id("sb"), spec_for(isolation, resources={"disk_mb": 16})),
    ]
    for ref in refs:
        # Leave work behind: a background process and files in the writable layer.
        channel = await backend.channel(ref)
        await channel.start_process(["sleep", "600"])
        await channel.write_file("/tmp/x", b"x")
        await channel.close()
    ranges = set(backend.uid_ranges())
    during = _footprint(backend, ranges)
    assert during["mounts"] - before["mounts"]
    assert during["processes"] - before["processes"]
    assert during["runtime"] - before["runtime"]
    assert len(during["uid_ranges"] - before["uid_ranges"]) == 2
    assert len(during["loop_devices"] - before["loop_devices"]) == 1
    await backend.stop(refs[1])
    for ref in refs:
        await backend.destroy(ref)
    assert _footprint(backend, ranges) == before


async def test_orphans_are_found_and_reaped(backend, isolation, spec_for) -> None:
    before = _footprint(backend)
    ref = await backend.create(new_id("sb"), spec_for(isolation))
    ranges = set(backend.uid_ranges())
    assert _footprint(backend, ranges)["processes"]
    # A crash mid-destroy: the record is gone, the container, mounts and cgroups are not.
    (backend.state_dir / ref / "meta.json").unlink()
    assert (await backend.list_owned()) == {ref: ref}
    await backend.destroy(ref)
    assert await backend.list_owned() == {}
    after = _footprint(backend, ranges)
    # The sandbox's processes are gone (killed by the runtime); nothing else is left either.
    assert after == before


async def test_a_create_killed_before_its_record_leaves_nothing_a_destroy_misses(backend) -> None:
    # A server killed between making a sandbox's directory and writing meta.json in it: the
    # Manager, with no backend ref recorded, asks list_owned for what the backend holds under
    # the id, so the bare directory must be listed (it leaked in a crash-suite run).
    sid = new_id("sb")
    (backend.state_dir / sid).mkdir(mode=0o711)
    (backend.state_dir / sid / "layer").mkdir()
    assert (await backend.list_owned()).get(sid) == sid
    await backend.destroy(sid)
    assert not (backend.state_dir / sid).exists()
    assert sid not in await backend.list_owned()


async def test_leaked_uid_ranges_are_freed_only_when_old(backend) -> None:
    registry = Path("/var/lib/sandlot/uid-ranges")
    old = backend._uids.allocate(backend.state_dir, "sl-crashed")
    fresh = backend._uids.allocate(backend.state_dir, "sl-in-flight")
    os.utime(registry / str(old), (0, 0))
    await backend.list_owned()
    assert set(backend.uid_ranges()) == {fresh}
    backend._uids.release(fresh)
