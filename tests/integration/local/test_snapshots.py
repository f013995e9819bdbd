"""Snapshots of local sandboxes: capture, verified restore, fork, and deletion."""

from __future__ import annotations

import time

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.errors import BackendError, NotFound
from sandlot.models import ExecResult, new_id


async def run(backend: LocalBackend, ref: str, *argv: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(list(argv), timeout=60)
    finally:
        await channel.close()


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    return await run(backend, ref, "sh", "-c", script)


async def check(backend: LocalBackend, ref: str) -> str:
    result = await run(backend, ref, "python3", "-c", CHECK)
    assert result.exit_code == 0, result.stderr
    return result.stdout


SETUP = (
    "mkdir -p /workspace/proj/sub && echo v1 > /workspace/proj/a.txt && echo keep > /workspace/b;"
    " ln -s a.txt /workspace/proj/link; rm /etc/hostname; chmod 640 /workspace/b;"
    " chown 1000:1000 /workspace/proj/sub"
)
CHECK = (
    "import os\n"
    "print(open('/workspace/proj/a.txt').read() + open('/workspace/b').read(), end='')\n"
    "print(os.readlink('/workspace/proj/link'))\n"
    "if os.path.exists('/etc/hostname'): print('hostname-back')\n"
    "for p in ('/workspace/b', '/workspace/proj/sub'):\n"
    "    st = os.stat(p); print(oct(st.st_mode & 0o777)[2:], st.st_uid)\n"
    "if os.path.exists('/new'): print('new-still-there')\n"
)
EXPECTED = "v1\nkeep\na.txt\n640 0\n755 1000\n"


async def test_restore_returns_to_the_snapshot(backend, isolation, spec_for) -> None:
    spec = spec_for(isolation)
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, SETUP)
    snap = await backend.snapshot(ref, new_id("snap"))
    assert snap.size_bytes > 0
    assert len(str(snap.metadata["manifest_sha256"])) == 64

    await sh(backend, ref, "echo v2 > /workspace/proj/a.txt; rm /workspace/b; echo new > /new")
    await backend.restore(ref, snap, spec)
    assert await check(backend, ref) == EXPECTED
    # The restored sandbox writes on top of the snapshot; the snapshot itself never changes.
    await sh(backend, ref, "echo v3 > /workspace/proj/a.txt")
    await backend.restore(ref, snap, spec)
    assert (await sh(backend, ref, "cat /workspace/proj/a.txt")).stdout == "v1\n"


async def test_fork_makes_independent_sandboxes(backend, spec_for) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, SETUP)
    snap = await backend.snapshot(ref, new_id("snap"))
    ids = [new_id("fork") for _ in range(4)]
    start = time.monotonic()
    refs = await backend.fork(snap, ids, spec)
    elapsed = time.monotonic() - start
    assert refs == ids
    assert elapsed < 30
    for i, fref in enumerate(refs):
        assert await check(backend, fref) == EXPECTED
        await sh(backend, fref, f"echo fork{i} > /workspace/proj/a.txt")
    for i, fref in enumerate(refs):
        assert (await sh(backend, fref, "cat /workspace/proj/a.txt")).stdout == f"fork{i}\n"
    ranges = backend.uid_ranges()
    assert len(ranges) == 5  # every fork has its own uid range
    # The source is untouched and can be destroyed while forks live on.
    assert (await sh(backend, ref, "cat /workspace/proj/a.txt")).stdout == "v1\n"
    await backend.destroy(ref)
    await backend.delete_snapshot(snap)
    assert (await sh(backend, refs[0], "cat /workspace/b")).stdout == "keep\n"
    await backend.stop(refs[0])
    await backend.start(refs[0], spec)
    assert (await sh(backend, refs[0], "cat /workspace/b")).stdout == "keep\n"
    with pytest.raises(NotFound):
        await backend.fork(snap, [new_id("fork")], spec)
    # The deleted snapshot's layer goes with the last sandbox that uses it.
    sdir = backend.state_dir / ".snapshots" / snap.ref
    assert sdir.exists()
    for fref in refs:
        await backend.destroy(fref)
    assert not sdir.exists()


async def test_a_corrupted_snapshot_is_refused(backend, spec_for) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, SETUP)
    snap = await backend.snapshot(ref, new_id("snap"))
    layer = backend.state_dir / ".snapshots" / snap.ref / "layer"
    target = layer / "workspace" / "proj" / "a.txt"
    target.write_text("tampered\n")
    with pytest.raises(
        BackendError, match=r"corrupt: workspace/proj/a.txt has a different content"
    ):
        await backend.restore(ref, snap, spec)
    with pytest.raises(BackendError, match="corrupt"):
        await backend.fork(snap, [new_id("fork")], spec)
    target.write_text("v1\n")
    (layer / "workspace" / "extra").write_text("x")
    with pytest.raises(BackendError, match="unexpected file workspace/extra"):
        await backend.restore(ref, snap, spec)
    (layer / "workspace" / "extra").unlink()
    manifest = backend.state_dir / ".snapshots" / snap.ref / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b" ")
    with pytest.raises(BackendError, match="manifest"):
        await backend.restore(ref, snap, spec)
    with pytest.raises(NotFound):
        await backend.restore(ref, snap.__class__(ref="no-such-snapshot"), spec)


async def test_snapshot_of_a_stopped_sandbox_with_a_disk_limit(backend, spec_for) -> None:
    spec = spec_for("namespaces", resources={"disk_mb": 16})
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, SETUP)
    await backend.stop(ref)
    snap = await backend.snapshot(ref, new_id("snap"))
    assert (await backend.inspect(ref)).state == "stopped"
    [fork] = await backend.fork(snap, [new_id("fork")], spec)
    assert await check(backend, fork) == EXPECTED
    await backend.delete_snapshot(snap)
    await backend.delete_snapshot(snap)  # a missing snapshot is not an error
