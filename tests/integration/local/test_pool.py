"""The warm pool: create claims a booted sandbox, safely across processes, and refills."""

from __future__ import annotations

import json
import time

import anyio

from sandlot.backends.local import LocalBackend
from sandlot.models import ExecResult, new_id


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(["sh", "-c", script], timeout=60)
    finally:
        await channel.close()


def container_of(backend: LocalBackend, ref: str) -> str:
    return str(json.loads((backend.state_dir / ref / "meta.json").read_text())["container"])


async def test_create_claims_a_pooled_sandbox(make_backend, isolation, spec_for) -> None:
    backend = make_backend(pool={isolation: 2})
    await backend.fill_pool()
    pooled = backend.pooled(isolation)
    assert len(pooled) == 2
    assert await backend.list_owned() == {}

    sid = new_id("sb")
    start = time.monotonic()
    ref = await backend.create(sid, spec_for(isolation, env={"WHO": "claimed"}, workdir="/srv/app"))
    channel = await backend.channel(ref)
    result = await channel.exec(["sh", "-c", 'echo "$WHO in $(pwd)"'])
    first_exec = time.monotonic() - start
    await channel.close()
    assert result.stdout == "claimed in /srv/app\n"
    assert container_of(backend, ref) in pooled
    assert len(backend.pooled(isolation)) == 1
    assert await backend.list_owned() == {sid: ref}
    # Claiming is the cheap path; a cold create boots a runtime and an interpreter.
    assert first_exec < 5

    # A claimed sandbox lives like any other: stop, start, destroy.
    await backend.stop(ref)
    await backend.start(ref, spec_for(isolation))
    assert (await sh(backend, ref, "test -d /srv/app && echo ok")).stdout == "ok\n"
    await backend.destroy(ref)
    assert len(backend.uid_ranges()) == 1  # the remaining pooled sandbox's


async def test_specs_the_pool_cannot_serve_boot_cold(make_backend, spec_for, tmp_path) -> None:
    backend = make_backend(pool={"namespaces": 1})
    await backend.fill_pool()
    ref = await backend.create(new_id("sb"), spec_for("namespaces", resources={"disk_mb": 16}))
    assert not container_of(backend, ref).startswith("slp-")
    image = tmp_path / "img"
    (image / "bin").mkdir(parents=True)
    ref = await backend.create(new_id("sb"), spec_for("namespaces", image=str(image)))
    assert not container_of(backend, ref).startswith("slp-")
    ref = await backend.create(new_id("sb"), spec_for("gvisor"))
    assert not container_of(backend, ref).startswith("slp-")
    assert len(backend.pooled()) == 1


async def test_concurrent_claims_never_share_a_sandbox(make_backend, spec_for) -> None:
    filler = make_backend(pool={"namespaces": 3})
    await filler.fill_pool()
    # Two backends on one state directory stand for two processes.
    a, b = make_backend(pool={"namespaces": 3}), make_backend(pool={"namespaces": 3})
    refs: list[str] = []

    async def create(backend: LocalBackend) -> None:
        refs.append(await backend.create(new_id("sb"), spec_for("namespaces")))

    async with anyio.create_task_group() as tg:
        for backend in (a, b, a, b):
            tg.start_soon(create, backend)
    containers = [container_of(a, ref) for ref in refs]
    assert len(set(containers)) == 4
    assert sum(c.startswith("slp-") for c in containers) == 3
    for ref in refs:
        assert (await sh(a, ref, "echo ok")).stdout == "ok\n"


async def test_the_refiller_tops_the_pool_up(make_backend, spec_for) -> None:
    backend = make_backend(pool={"namespaces": 2})
    async with backend.pool_refiller():
        with anyio.fail_after(60):
            while len(backend.pooled()) < 2:
                await anyio.sleep(0.05)
        await backend.create(new_id("sb"), spec_for("namespaces"))
        await backend.create(new_id("sb"), spec_for("namespaces"))
        with anyio.fail_after(60):
            while len(backend.pooled()) < 2:
                await anyio.sleep(0.05)
    await backend.drain_pool()
    assert backend.pooled() == []
    assert len(backend.uid_ranges()) == 2
