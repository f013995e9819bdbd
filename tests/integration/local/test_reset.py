"""Verified reset of local sandboxes: back to the baseline or a snapshot, checked from the host."""

from __future__ import annotations

import json

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.errors import VerificationFailed
from sandlot.models import ExecResult, new_id


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(["sh", "-c", script], timeout=60)
    finally:
        await channel.close()


def sources(report: dict[str, object]) -> dict[str, dict[str, object]]:
    checks = report["checks"]
    assert isinstance(checks, list)
    return {str(c["source"]): c for c in checks}


async def test_reset_to_the_baseline_discards_files_and_processes(
    backend, isolation, spec_for
) -> None:
    assert backend.capabilities().reset
    spec = spec_for(isolation, workdir="/srv/app", env={"WHO": "me"})
    ref = await backend.create(new_id("sb"), spec)
    made = await sh(
        backend,
        ref,
        "echo dirty > /srv/app/f; echo x > /etc/motd; rm /etc/hostname;"
        " setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo started",
    )
    assert made.stdout == "started\n"
    assert "sleep 300" in (await sh(backend, ref, "ps -eo args")).stdout

    report = await backend.reset(ref, None, spec)

    assert report["ok"] is True
    assert report["target"] == "baseline"
    assert report["diverged"] == []
    checks = sources(report)
    assert set(checks) == {"layers", "upper", "processes", "runtime"}
    assert all(c["ok"] for c in checks.values())
    after = await sh(
        backend,
        ref,
        'ls -A /srv/app; test -e /etc/motd && echo motd; cat /etc/hostname; echo "$WHO $(pwd)"',
    )
    assert after.stdout == "sandbox\nme /srv/app\n"
    assert "sleep 300" not in (await sh(backend, ref, "ps -eo args")).stdout
    # Resetting again gives the very same verified state.
    again = await backend.reset(ref, None, spec)
    assert sources(again)["upper"]["actual"] == checks["upper"]["actual"]


async def test_reset_to_a_snapshot(backend, spec_for) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, "mkdir -p /workspace/p && echo v1 > /workspace/p/a; rm /etc/hostname")
    snap = await backend.snapshot(ref, new_id("snap"))
    await sh(backend, ref, "echo v2 > /workspace/p/a; echo new > /workspace/new")

    report = await backend.reset(ref, snap, spec)

    assert report["ok"] is True
    assert report["target"] == f"snapshot:{snap.ref}"
    checks = sources(report)
    assert checks["snapshot"]["actual"] == snap.metadata["manifest_sha256"]
    result = await sh(backend, ref, "cat /workspace/p/a; ls /workspace; test -e /etc/hostname")
    assert result.stdout == "v1\np\n"
    assert result.exit_code == 1
    # And back to the baseline, which predates the snapshot.
    await backend.reset(ref, None, spec)
    result = await sh(backend, ref, "ls -A /workspace; cat /etc/hostname")
    assert result.stdout == "sandbox\n"


async def test_tampering_with_the_layer_after_a_reset_fails_the_next_verification(
    backend, isolation, spec_for
) -> None:
    spec = spec_for(isolation)
    ref = await backend.create(new_id("sb"), spec)
    await backend.reset(ref, None, spec)
    assert (await backend.verify(ref))["ok"] is True

    # The host (not the sandbox) slips a file into the sandbox's writable layer.
    upper = backend.state_dir / ref / "layer" / "upper"
    (upper / "planted").write_text("not from the baseline\n")
    with pytest.raises(VerificationFailed) as caught:
        await backend.verify(ref)
    err = caught.value
    assert err.details["diverged"] == ["upper"]
    report = err.details["verification"]
    assert isinstance(report, dict)
    assert report["ok"] is False
    upper_check = sources(report)["upper"]
    assert upper_check["expected"] != upper_check["actual"]
    assert upper_check["detail"] == "planted"

    # A reset puts it right, and verifies that it did.
    assert (await backend.reset(ref, None, spec))["ok"] is True
    assert (await backend.verify(ref))["ok"] is True
    assert not (upper / "planted").exists()


async def test_a_process_left_running_fails_verification(backend, spec_for) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, "setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
    with pytest.raises(VerificationFailed) as caught:
        await backend.verify(ref)
    assert caught.value.details["diverged"] == ["processes"]
    assert (await backend.reset(ref, None, spec))["ok"] is True


async def test_a_tampered_snapshot_fails_reset_and_leaves_the_sandbox_alone(
    backend, spec_for
) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, "echo v1 > /workspace/a")
    snap = await backend.snapshot(ref, new_id("snap"))
    await sh(backend, ref, "echo v2 > /workspace/a")
    layer = backend.state_dir / ".snapshots" / snap.ref / "layer"
    (layer / "workspace" / "a").write_text("tampered\n")

    with pytest.raises(VerificationFailed) as caught:
        await backend.reset(ref, snap, spec)
    assert caught.value.details["diverged"] == ["snapshot"]
    check = sources(caught.value.details["verification"])["snapshot"]  # type: ignore[arg-type]
    assert "workspace/a has a different content" in str(check["actual"])
    # Nothing was changed: the sandbox runs on with its own files.
    assert (await sh(backend, ref, "cat /workspace/a")).stdout == "v2\n"

    # A sandbox forked from a snapshot keeps it as its baseline, and a reset re-checks it.
    (layer / "workspace" / "a").write_text("v1\n")
    [fork] = await backend.fork(snap, [new_id("fork")], spec)
    (layer / "workspace" / "a").write_text("tampered again\n")
    with pytest.raises(VerificationFailed) as caught:
        await backend.reset(fork, None, spec)
    assert caught.value.details["diverged"] == ["layers"]


async def test_reset_with_a_disk_limit(backend, spec_for) -> None:
    spec = spec_for("namespaces", resources={"disk_mb": 16})
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, "head -c 1000000 /dev/zero > /workspace/big")
    report = await backend.reset(ref, None, spec)
    assert report["ok"] is True
    assert (await sh(backend, ref, "ls -A /workspace")).stdout == ""


async def test_reset_boots_a_stopped_sandbox(backend, spec_for) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await sh(backend, ref, "echo x > /workspace/x")
    await backend.stop(ref)
    assert (await backend.inspect(ref)).state == "stopped"
    assert (await backend.reset(ref, None, spec))["ok"] is True
    assert (await backend.inspect(ref)).state == "running"
    assert (await sh(backend, ref, "ls -A /workspace")).stdout == ""


def container_of(backend: LocalBackend, ref: str) -> str:
    return str(json.loads((backend.state_dir / ref / "meta.json").read_text())["container"])


async def test_reset_from_the_warm_pool_swaps_in_a_verified_sandbox(make_backend, spec_for) -> None:
    backend = make_backend(pool={"namespaces": 1})
    spec = spec_for("namespaces", workdir="/srv/app", env={"WHO": "me"})
    # Made cold (the pool is empty), reset from the pool: the baselines must be the same.
    ref = await backend.create(new_id("sb"), spec)
    cold = container_of(backend, ref)
    await backend.fill_pool()
    [pooled] = backend.pooled()
    await sh(backend, ref, "echo dirty > /srv/app/f; setsid sleep 300 > /dev/null 2>&1 &")

    report = await backend.reset(ref, None, spec)

    assert report["ok"] is True
    assert report["via"] == "pool"
    assert {c["source"] for c in report["checks"]} == {"layers", "upper", "processes", "runtime"}
    assert container_of(backend, ref) == pooled
    assert backend.pooled() == []
    result = await sh(backend, ref, 'ls -A /srv/app; echo "$WHO $(pwd)"; ps -eo args')
    assert result.stdout.startswith("me /srv/app\n")
    assert "sleep 300" not in result.stdout
    # The swapped-out sandbox is gone entirely: container, uid range, directory.
    assert cold not in {c for rt in ("crun",) for c in backend._runtimes[rt].names()}
    assert list(backend.uid_ranges().values()) == [pooled]
    assert list((backend.state_dir / ".trash").iterdir()) == []
    assert (await backend.verify(ref))["ok"] is True
    # With the pool empty, the next reset restarts the sandbox in place.
    report = await backend.reset(ref, None, spec)
    assert report["ok"] is True
    assert "via" not in report
    assert container_of(backend, ref) == pooled
