"""A warm pool turned on in sandlot.toml: the SDK's creates claim from it, and a short-lived
process (a CLI command) that drew on it leaves a detached refill behind."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import anyio
import pytest

from sandlot import wiring
from sandlot.backends.local import LocalBackend
from sandlot.network.service import SandboxNetworks
from sandlot.sdk import AsyncSandlot

from .conftest import cleanup


def _container(state: Path, ref: str) -> str:
    return str(json.loads((state / ref / "meta.json").read_text())["container"])


async def test_a_pool_from_the_file_serves_creates_and_is_topped_up(
    home: Path, rootfs_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_CACHE", str(rootfs_cache))
    home.mkdir(parents=True, exist_ok=True)
    (home / "sandlot.toml").write_text('backend = "local"\n[backends.local.pool]\nnamespaces = 1\n')
    state = home / "backends" / "local"
    try:
        async with AsyncSandlot() as client:
            local = client.manager.backends["local"]
            assert isinstance(local, LocalBackend)
            assert local.pool_sizes() == {"namespaces": 1}
            await wiring.fill_pools(client.manager)
            pooled = local.pooled("namespaces")
            assert len(pooled) == 1

            sb = await client.create(network="deny-all")
            assert sb.info.backend_ref is not None
            # A pool hit: the sandbox is the pooled container, renamed into place.
            assert _container(state, sb.info.backend_ref) == pooled[0]
            assert local.pooled("namespaces") == []
            assert (await sb.exec("echo warm")).stdout == "warm\n"
            await sb.destroy()
        # Closing drew a detached refill: the pool is full again without this process.
        with anyio.fail_after(90):
            while len(_ready(state)) < 1:
                await anyio.sleep(0.1)
        await anyio.to_thread.run_sync(_wait_for_refill, home)
        assert len(_ready(state)) == 1
    finally:
        await anyio.to_thread.run_sync(_wait_for_refill, home)
        await cleanup(
            LocalBackend(state, networks=SandboxNetworks(state / "network"), cache=rootfs_cache)
        )


def _ready(state: Path) -> list[Path]:
    return [p for p in (state / ".pool" / "namespaces").glob("*") if (p / "ready").exists()]


def _wait_for_refill(home: Path) -> None:
    """Block until no refill process holds the home's refill lock."""
    lock = home / "backends" / ".pool-refill.lock"
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


async def test_warm_pools_keeps_a_configured_pool_full_while_it_runs(
    home: Path, rootfs_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``sandlot serve`` runs for its lifetime."""
    monkeypatch.setenv("SANDLOT_CACHE", str(rootfs_cache))
    home.mkdir(parents=True, exist_ok=True)
    (home / "sandlot.toml").write_text('backend = "local"\n[backends.local.pool]\nnamespaces = 1\n')
    state = home / "backends" / "local"
    try:
        async with AsyncSandlot() as client, wiring.warm_pools(client.manager):
            with anyio.fail_after(90):
                while len(_ready(state)) < 1:
                    await anyio.sleep(0.1)
            first = _ready(state)[0].name
            sb = await client.create(network="deny-all")
            assert sb.info.backend_ref is not None
            assert _container(state, sb.info.backend_ref) == first
            with anyio.fail_after(90):
                while len(_ready(state)) < 1:
                    await anyio.sleep(0.1)
            assert _ready(state)[0].name != first
            await sb.destroy()
    finally:
        await anyio.to_thread.run_sync(_wait_for_refill, home)
        await cleanup(
            LocalBackend(state, networks=SandboxNetworks(state / "network"), cache=rootfs_cache)
        )
