"""The contract every Backend (and its Channel) must keep, run against each implementation.

Real backends join the parametrization as they land; one whose runtime is missing on this
host skips naming the prerequisite (CI installs them, so nothing skips there).
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sandlot.backends.base import Backend
from sandlot.errors import NotFound
from sandlot.models import SandboxSpec, new_id
from sandlot.testing import FakeBackend


def _fake(_: Path) -> Backend:
    return FakeBackend()


def _microvm(state: Path) -> Backend:
    from sandlot.backends.microvm import MicrovmBackend, build_image, doctor

    missing = [
        c for c in doctor() if not c.ok and c.required and c.name != "microvm guest image built"
    ]
    if missing:
        pytest.skip(f"microvm needs: {'; '.join(f'{c.name} ({c.fix})' for c in missing)}")
    # Built here when the cache has none for this agent and kernel (about a minute): a
    # contract test must not skip just because it ran before the microvm suite built it.
    return MicrovmBackend(state, image=build_image())


def _local(state: Path) -> Backend:
    from sandlot.backends.local import LocalBackend
    from sandlot.network.service import SandboxNetworks

    backend = LocalBackend(state, networks=SandboxNetworks(state / "network"))
    reason = backend.unavailable()
    if reason:
        pytest.skip(f"local backend unavailable: {reason}")
    return backend


def _local_gvisor(state: Path) -> Backend:
    if shutil.which("runsc") is None:
        pytest.skip("local with gVisor needs runsc (Debian package runsc)")
    return _local(state)


BACKENDS: dict[str, Callable[[Path], Backend]] = {
    "fake": _fake,
    "local": _local,
    "local-gvisor": _local_gvisor,
    "microvm": _microvm,
}
SLOW = {"microvm"}

# Every backend can enforce "no network at all", so the contract uses it throughout.
SPEC = SandboxSpec(network="deny-all")
# The local backend picks its runtime per sandbox, from the spec.
SPECS = {
    "local-gvisor": SPEC.model_copy(update={"backend_options": {"local": {"isolation": "gvisor"}}})
}


@pytest.fixture(
    params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(BACKENDS)]
)
def backend_factory(request: pytest.FixtureRequest) -> Callable[[Path], Backend]:
    return BACKENDS[request.param]


@pytest.fixture
def spec(request: pytest.FixtureRequest) -> SandboxSpec:
    """The spec the contract's sandboxes are made with on this backend."""
    return SPECS.get(request.node.callspec.params["backend_factory"], SPEC)


@pytest.fixture
async def backend(
    backend_factory: Callable[[Path], Backend], tmp_path: Path
) -> AsyncIterator[Backend]:
    impl = backend_factory(tmp_path / "state")
    yield impl
    for ref in (await impl.list_owned()).values():
        await impl.destroy(ref)
    await impl.aclose()


async def test_lifecycle_keeps_files_across_stop(backend: Backend, spec: SandboxSpec) -> None:
    sid = new_id("sb")
    ref = await backend.create(sid, spec)
    assert (await backend.inspect(ref)).state == "running"
    assert (await backend.list_owned()).get(sid) == ref
    channel = await backend.channel(ref)
    result = await channel.exec(["echo", "hello"])
    assert (result.exit_code, result.stdout) == (0, "hello\n")
    assert (await channel.exec(["sh", "-c", "exit 3"])).exit_code == 3
    await channel.write_file("/workspace/keep.txt", b"kept")
    await channel.close()

    await backend.stop(ref)
    assert (await backend.inspect(ref)).state == "stopped"
    await backend.start(ref, spec)
    assert (await backend.inspect(ref)).state == "running"
    channel = await backend.channel(ref)
    assert b"".join([c async for c in channel.read_file("/workspace/keep.txt")]) == b"kept"
    await channel.close()

    await backend.destroy(ref)
    assert (await backend.inspect(ref)).state == "missing"
    assert sid not in await backend.list_owned()
    await backend.destroy(ref)


async def test_create_is_idempotent_per_sandbox_id(backend: Backend, spec: SandboxSpec) -> None:
    sid = new_id("sb")
    ref = await backend.create(sid, spec)
    again = await backend.create(sid, spec)
    assert again == ref
    assert list((await backend.list_owned()).items()).count((sid, ref)) == 1


async def test_channel_files(backend: Backend, spec: SandboxSpec) -> None:
    ref = await backend.create(new_id("sb"), spec)
    channel = await backend.channel(ref)
    payload = bytes(range(256)) * 4096
    info = await channel.write_file("/workspace/dir/blob.bin", payload, mode=0o600)
    assert (info.size, info.type) == (len(payload), "file")
    back = b"".join([c async for c in channel.read_file("/workspace/dir/blob.bin")])
    assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
    assert [f.name for f in await channel.list_files("/workspace/dir")] == ["blob.bin"]
    assert (await channel.stat("/workspace/dir")).type == "dir"
    await channel.mkdir("/workspace/a/b/c")
    assert (await channel.stat("/workspace/a/b/c")).type == "dir"
    await channel.remove("/workspace/dir", recursive=True)
    with pytest.raises(NotFound):
        await channel.stat("/workspace/dir/blob.bin")
    with pytest.raises(NotFound):
        _ = [c async for c in channel.read_file("/workspace/missing")]
    await channel.close()


async def test_snapshot_restore_and_fork_when_supported(
    backend: Backend, spec: SandboxSpec
) -> None:
    caps = backend.capabilities()
    if not caps.snapshot:
        pytest.skip(f"{backend.name} does not claim snapshots")
    ref = await backend.create(new_id("sb"), spec)
    channel = await backend.channel(ref)
    await channel.write_file("/workspace/v.txt", b"one")
    snap = await backend.snapshot(ref, new_id("snap"))
    if channel.closed:
        channel = await backend.channel(ref)
    await channel.write_file("/workspace/v.txt", b"two")
    await channel.close()
    await backend.restore(ref, snap, spec)
    channel = await backend.channel(ref)
    assert b"".join([c async for c in channel.read_file("/workspace/v.txt")]) == b"one"
    await channel.close()
    if caps.fork:
        ids = [new_id("sb") for _ in range(3)]
        refs = await backend.fork(snap, ids, spec)
        assert len(set(refs)) == 3
        owned = await backend.list_owned()
        for sid, child in zip(ids, refs, strict=True):
            assert owned[sid] == child
            ch = await backend.channel(child)
            assert b"".join([c async for c in ch.read_file("/workspace/v.txt")]) == b"one"
            await ch.close()
    await backend.delete_snapshot(snap)
