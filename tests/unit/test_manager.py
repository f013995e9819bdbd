"""The Manager's lifecycle on the fake backend: what a user of the SDK would notice."""

from __future__ import annotations

import os
import subprocess
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from sandlot import (
    ExecFailed,
    ExecResult,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotSupported,
    SandboxStatus,
)
from sandlot.backends.base import Capabilities
from sandlot.errors import BackendError
from sandlot.models import OutputChunk, utcnow
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend, FakeExec

S = SandboxStatus


async def test_create_runs_setup_then_start_and_is_running(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    seen: list[bytes] = []
    sb = await aclient.create(
        setup=["echo one", "echo two"],
        start="sleep 1000",
        on_setup_output=lambda c: seen.append(c.data),
    )
    assert sb.status is S.RUNNING
    assert sb.info.setup_done
    argvs = [c.args["argv"] for c in fake.calls_for(sb.id, "exec")]
    assert argvs == [["sh", "-c", "echo one"], ["sh", "-c", "echo two"]]
    (main,) = fake.calls_for(sb.id, "start_process")
    assert main.args == {"argv": ["sh", "-c", "sleep 1000"], "name": "main"}
    assert b"".join(seen) == b"one\ntwo\n"


async def test_failing_setup_marks_failed_keeps_backend_and_stops_at_first_error(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    with pytest.raises(ExecFailed) as info:
        await aclient.create(setup=["echo before", "exit 3", "echo never"], start="sleep 1")
    assert info.value.result.exit_code == 3
    (sb,) = await aclient.list(status=S.FAILED)
    assert sb.death is not None
    assert sb.death.cause == "setup_failed"
    assert sb.death.last_output == ["before"]
    assert "step 2" in (sb.error or "")
    argvs = [c.args["argv"][2] for c in fake.calls_for(sb.id, "exec")]
    assert argvs == ["echo before", "exit 3"]
    assert not fake.calls_for(sb.id, "start_process")
    assert f"fake-{sb.id}" in fake.sandboxes, "the backend's sandbox is kept for inspection"
    assert not fake.calls_for(sb.id, "destroy")


async def test_resume_retries_failed_sandbox_without_rerunning_setup(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    with pytest.raises(ExecFailed):
        await aclient.create(setup="exit 1", start="serve")
    (info,) = await aclient.list(status=S.FAILED)
    handle = await aclient.get(info.id)
    execs_before = len(fake.calls_for(info.id, "exec"))
    resumed = await handle.resume()
    assert resumed.status is S.RUNNING
    assert resumed.error is None
    assert len(fake.calls_for(info.id, "exec")) == execs_before
    assert fake.calls_for(info.id, "start_process")[-1].args["argv"] == ["sh", "-c", "serve"]


async def test_backend_create_error_marks_failed_with_cause(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    fake.fail_next("create", BackendError("disk full"))
    with pytest.raises(BackendError, match="disk full"):
        await aclient.create()
    (sb,) = await aclient.list(status=S.FAILED)
    assert sb.death is not None
    assert sb.death.cause == "backend_error"
    assert "disk full" in sb.death.message


async def test_exec_streams_and_collects_and_check_raises(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    def handler(req: FakeExec) -> ExecResult | None:
        if req.argv[0] == "build":
            return ExecResult(exit_code=2, stdout="compiling\n", stderr="error: x\n")
        return None

    fake.exec_handler = handler
    sb = await aclient.create()
    chunks: list[OutputChunk] = []
    out_text: list[str] = []
    result = await sb.exec(["build"], on_output=chunks.append, on_stdout=out_text.append)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "compiling\n", "error: x\n")
    assert [c.stream for c in chunks] == ["stdout", "stderr"]
    assert out_text == ["compiling\n"]
    with pytest.raises(ExecFailed) as info:
        await sb.exec(["build"], check=True)
    assert info.value.result.stderr == "error: x\n"
    assert isinstance(info.value, ExecFailed)


async def test_exec_env_and_cwd_layering(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    seen: list[FakeExec] = []

    def handler(req: FakeExec) -> ExecResult:
        seen.append(req)
        return ExecResult(exit_code=0)

    fake.exec_handler = handler
    sb = await aclient.create(env={"A": "spec", "B": "spec"}, workdir="/src")
    await sb.exec("true", env={"B": "call"})
    await sb.exec(["true"], cwd="/tmp")
    assert seen[0].env == {"A": "spec", "B": "call"}
    assert seen[0].cwd == "/src"
    assert seen[1].cwd == "/tmp"


async def test_bad_exec_input_is_a_clear_error(aclient: AsyncSandlot) -> None:
    sb = await aclient.create()
    with pytest.raises(InvalidRequest, match="timeout"):
        await sb.exec("true", timeout=0)
    with pytest.raises(InvalidRequest, match="cwd"):
        await sb.exec("true", cwd="relative")
    with pytest.raises(InvalidRequest, match="empty argv"):
        await sb.exec([])
    with pytest.raises(InvalidRequest, match="absolute"):
        await sb.read_file("etc/passwd")


async def test_unknown_id_is_not_found_naming_it(aclient: AsyncSandlot) -> None:
    with pytest.raises(NotFound, match="sb-nope") as info:
        await aclient.get("sb-nope")
    assert isinstance(info.value, LookupError)


async def test_any_operation_on_stopped_sandbox_resumes_it(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create(start="serve", resume="serve --warm")
    await sb.stop()
    assert (await sb.refresh()).status is S.STOPPED
    assert (await sb.exec("echo back")).stdout == "back\n"
    info = await sb.refresh()
    assert info.status is S.RUNNING
    assert len(fake.calls_for(sb.id, "start")) == 1
    assert fake.calls_for(sb.id, "start_process")[-1].args["argv"] == ["sh", "-c", "serve --warm"]


async def test_auto_resume_off_refuses(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create()
    await sb.stop()
    with pytest.raises(InvalidState, match="auto_resume is off"):
        await sb.exec("true", auto_resume=False)
    assert not fake.calls_for(sb.id, "start")


async def test_concurrent_requests_on_stopped_sandbox_resume_exactly_once(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    await sb.stop()
    results: list[str] = []

    async def one(i: int) -> None:
        results.append((await sb.exec(f"echo {i}")).stdout)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert sorted(results) == sorted(f"{i}\n" for i in range(20))
    assert len(fake.calls_for(sb.id, "start")) == 1


async def test_destroy_keeps_record_hidden_with_certificate(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    fake.emit_log(sb.id, "line 1\nline 2\n")
    done = await sb.destroy()
    assert done.status is S.DESTROYED
    assert done.death is not None
    assert done.death.cause == "destroyed"
    assert done.death.last_output == ["line 1", "line 2"]
    assert await aclient.list() == []
    assert [s.id for s in await aclient.list(include_destroyed=True)] == [sb.id]
    assert (await sb.destroy()).status is S.DESTROYED, "destroying twice is fine"
    with pytest.raises(InvalidState, match="destroyed"):
        await sb.exec("true")


async def test_stop_records_last_output(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create(start="serve")
    fake.emit_log(sb.id, "".join(f"l{i}\n" for i in range(50)))
    info = await sb.stop()
    assert info.death is not None
    assert info.death.cause == "stopped"
    assert info.death.last_output == [f"l{i}" for i in range(30, 50)]


async def test_logs_follow_the_main_log(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create(start="serve")
    fake.emit_log(sb.id, "hello\n")
    assert b"".join([c async for c in sb.logs()]) == b"hello\n"
    got: list[bytes] = []
    with anyio.move_on_after(1):
        async for chunk in sb.logs(follow=True):
            got.append(chunk)
            if len(got) == 1:
                fake.emit_log(sb.id, "more\n")
            if b"".join(got) == b"hello\nmore\n":
                break
    assert b"".join(got) == b"hello\nmore\n"


async def test_files_round_trip(aclient: AsyncSandlot) -> None:
    sb = await aclient.create()
    await sb.write_files({"/workspace/a.txt": "alpha", "/workspace/sub/b.bin": b"\x00\xff"})
    assert await sb.read_file("/workspace/sub/b.bin") == b"\x00\xff"
    names = [f.name for f in await sb.list_files()]
    assert names == ["a.txt", "sub"]
    await sb.remove_file("/workspace/sub", recursive=True)
    assert [f.name for f in await sb.list_files()] == ["a.txt"]
    with pytest.raises(NotFound):
        await sb.read_file("/workspace/sub/b.bin")


async def test_unenforceable_spec_refused_before_anything_is_made(home: Path) -> None:
    weak = FakeBackend(capabilities=Capabilities(network=frozenset({"allow-all"})))
    async with AsyncSandlot(home, backends={"fake": weak}) as client:
        with pytest.raises(NotSupported, match="deny-all"):
            await client.create(network="deny-all")
        with pytest.raises(NotSupported, match="memory_mb"):
            await client.create(resources={"memory_mb": 256})
        with pytest.raises(NotSupported, match="images"):
            await client.create(image="/srv/rootfs")
        assert await client.list(include_destroyed=True) == []
    assert weak.calls == []


async def test_git_clone_passes_auth_only_through_environment(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    seen: list[FakeExec] = []

    def handler(req: FakeExec) -> ExecResult:
        seen.append(req)
        return ExecResult(exit_code=0)

    fake.exec_handler = handler
    sb = await aclient.create(
        git={
            "url": "https://example.com/r.git",
            "revision": "v1.2",
            "depth": 1,
            "auth": "Bearer s3cret",
        }
    )
    clone, fetch, checkout = seen
    assert clone.argv == [
        "git",
        "clone",
        "--depth",
        "1",
        "--",
        "https://example.com/r.git",
        "/workspace",
    ]
    assert fetch.argv[-2:] == ["origin", "v1.2"]
    assert checkout.argv[-1] == "FETCH_HEAD"
    assert clone.env["GIT_CONFIG_VALUE_0"] == "Authorization: Bearer s3cret"
    assert all("s3cret" not in " ".join(r.argv) for r in seen)
    stored = (await aclient.get(sb.id)).info
    assert "s3cret" not in stored.model_dump_json()


async def test_failed_clone_fails_sandbox(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    fake.exec_handler = lambda req: ExecResult(
        exit_code=128, stderr="fatal: repository not found\n"
    )
    with pytest.raises(ExecFailed, match="git clone"):
        await aclient.create(git={"url": "https://example.com/missing.git"})
    (sb,) = await aclient.list(status=S.FAILED)
    assert sb.death is not None
    assert sb.death.cause == "git_failed"
    assert sb.death.last_output == ["fatal: repository not found"]


async def test_reconcile_external_stop_vanish_and_orphans(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    a = await aclient.create()
    b = await aclient.create()
    fake.external_stop(a.id, reason="oom")
    fake.vanish(b.id)
    fake.adopt_orphan("sb-orphan")
    report = await aclient.reconcile()
    assert report.updated == {
        a.id: "running -> stopped (oom)",
        b.id: "running -> failed (vanished)",
    }
    assert report.reaped == ["sb-orphan"]
    assert "fake-sb-orphan" not in fake.sandboxes
    info_a = (await aclient.get(a.id)).info
    assert info_a.status is S.STOPPED
    assert info_a.death is not None
    assert info_a.death.cause == "oom"
    info_b = (await aclient.get(b.id)).info
    assert info_b.status is S.FAILED
    assert info_b.death is not None
    assert info_b.death.cause == "vanished"
    assert (await aclient.reconcile()).updated == {}


async def test_reconcile_when_backend_cannot_answer_changes_nothing(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    fake.set_unreachable()
    report = await aclient.reconcile()
    assert sb.id in report.errors
    assert "fake" in report.errors
    assert (await aclient.get(sb.id)).info.status is S.RUNNING


def _ticks(pid: int) -> str:
    from sandlot.journal.owner import _start_ticks

    return _start_ticks(pid) or "?"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_abandoned_transition_is_settled_by_next_request(
    aclient: AsyncSandlot, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process's change is seen at once (not after the hot path's record cache ages).
    monkeypatch.setattr("sandlot.manager.tuning.RECENT", 0.0)
    sb = await aclient.create()
    store = aclient.manager.store
    info = await store.get(sb.id)
    # A process that died mid-stop left the record in `stopping`.
    await store.update(
        sb.id,
        info.version,
        {"status": S.STOPPING, "transition_owner": f"{os.uname().nodename}:{_dead_pid()}:abc"},
    )
    result = await sb.exec("echo alive")
    assert result.stdout == "alive\n"
    info = (await aclient.get(sb.id)).info
    assert info.status is S.RUNNING
    assert len(fake.calls_for(sb.id, "start")) == 1


async def test_abandoned_creation_is_failed_by_reconcile_and_kept(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    store = aclient.manager.store
    info = await store.get(sb.id)
    await store.update(
        sb.id,
        info.version,
        {
            "status": S.SETTING_UP,
            "transition_owner": "otherhost:1:x",
            "transition_deadline": utcnow() - timedelta(seconds=1),
        },
    )
    report = await aclient.reconcile()
    assert report.updated == {sb.id: "setting_up (abandoned) -> failed"}
    info = (await aclient.get(sb.id)).info
    assert info.death is not None
    assert info.death.cause == "abandoned"
    assert f"fake-{sb.id}" in fake.sandboxes


async def test_transition_in_flight_by_live_owner_is_waited_for(
    aclient: AsyncSandlot, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sandlot.manager.tuning.RECENT", 0.0)
    aclient.manager.transition_timeout = 0.3
    sb = await aclient.create()
    store = aclient.manager.store
    info = await store.get(sb.id)
    await store.update(
        sb.id,
        info.version,
        {
            "status": S.RESUMING,
            # A live process (our parent) drives it.
            "transition_owner": f"{os.uname().nodename}:{os.getppid()}:{_ticks(os.getppid())}/x",
            "transition_deadline": utcnow() + timedelta(minutes=5),
        },
    )
    from sandlot import SandboxTimeout

    with pytest.raises(SandboxTimeout, match="resuming"):
        await sb.exec("true")


async def test_ttl_and_idle_expiry(aclient: AsyncSandlot) -> None:
    ttl = await aclient.create(timeout=60)
    idle = await aclient.create(idle_timeout=30)
    fresh = await aclient.create(timeout=3600, idle_timeout=3600)
    manager = aclient.manager
    assert (await manager.stop_expired()).expired == []
    later = utcnow() + timedelta(seconds=61)
    assert sorted((await manager.stop_expired(now=later)).expired) == sorted([ttl.id, idle.id])
    for handle, cause in ((ttl, "ttl"), (idle, "idle")):
        info = await handle.refresh()
        assert info.status is S.STOPPED
        assert info.death is not None
        assert info.death.cause == cause
    assert (await fresh.refresh()).status is S.RUNNING


async def test_activity_defers_idle_expiry(
    aclient: AsyncSandlot, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sandlot.manager.tuning.TOUCH_EVERY", 0.0)
    sb = await aclient.create(idle_timeout=30)
    await anyio.sleep(0.01)
    await sb.exec("true")
    info = await sb.refresh()
    assert info.last_active_at > info.created_at
    report = await aclient.manager.stop_expired(now=info.last_active_at + timedelta(seconds=29))
    assert report.expired == []


async def test_keep_alive_extends_never_shortens(aclient: AsyncSandlot) -> None:
    sb = await aclient.create(timeout=60)
    first = sb.info.expires_at
    assert first is not None
    longer = await sb.keep_alive(3600)
    assert longer.expires_at is not None
    assert longer.expires_at > first + timedelta(minutes=50)
    shorter = await sb.keep_alive(10)
    assert shorter.expires_at == longer.expires_at
    with pytest.raises(InvalidRequest):
        await sb.keep_alive(0)


async def test_snapshot_restore_fork(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create(start="serve", labels={"team": "a"})
    await sb.write_file("/workspace/state.txt", "v1")
    snap = await sb.snapshot()
    await sb.write_file("/workspace/state.txt", "v2")
    restored = await sb.restore(snap.id)
    assert restored.status is S.RUNNING
    assert await sb.read_file("/workspace/state.txt") == b"v1"
    children = await sb.fork(3)
    assert len(children) == 3
    assert len({c.id for c in children} | {sb.id}) == 4
    for child in children:
        assert child.status is S.RUNNING
        assert child.info.labels == {"team": "a"}
        assert await child.read_file("/workspace/state.txt") == b"v1"
    assert [s.id for s in await aclient.list_snapshots(sb.id)][-1] == snap.id
    from_snap = await aclient.fork(snap.id, 1)
    assert await from_snap[0].read_file("/workspace/state.txt") == b"v1"
    await aclient.delete_snapshot(snap.id)
    with pytest.raises(NotFound):
        await aclient.fork(snap.id)


async def test_snapshot_not_supported_is_loud(home: Path) -> None:
    plain = FakeBackend(capabilities=Capabilities(network=frozenset({"allow-all"})))
    async with AsyncSandlot(home, backends={"fake": plain}) as client:
        sb = await client.create()
        with pytest.raises(NotSupported, match="snapshot"):
            await sb.snapshot()
        with pytest.raises(NotSupported, match="ports"):
            await sb.expose_port(8080)


async def test_ports_are_recorded(aclient: AsyncSandlot) -> None:
    sb = await aclient.create(ports=[8080])
    assert [p.port for p in sb.info.ports] == [8080]
    mapping = await sb.expose_port(9000)
    assert mapping.url.startswith("http://127.0.0.1:")
    assert [p.port for p in await sb.list_ports()] == [8080, 9000]


async def test_list_filters(aclient: AsyncSandlot) -> None:
    a = await aclient.create(labels={"team": "a", "env": "dev"}, owner="alice")
    b = await aclient.create(labels={"team": "b"})
    await b.stop()
    assert [s.id for s in await aclient.list(labels={"team": "a"})] == [a.id]
    assert [s.id for s in await aclient.list(labels={"team": "a", "env": "prod"})] == []
    assert [s.id for s in await aclient.list(status=S.STOPPED)] == [b.id]
    assert [s.id for s in await aclient.list(owner="alice")] == [a.id]
    assert [s.id for s in await aclient.list()] == [b.id, a.id]
    assert [s.id for s in await aclient.list(limit=1, offset=1)] == [a.id]


async def test_destroy_during_create_stops_the_creator(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    manager = aclient.manager

    async def slow_setup(req: FakeExec) -> ExecResult:
        (created,) = await manager.list()
        await manager.destroy(created.id)
        return ExecResult(exit_code=0)

    fake.exec_handler = slow_setup
    with pytest.raises(InvalidState, match=r"destroying|destroyed"):
        await aclient.create(setup="slow")
    (info,) = await aclient.list(include_destroyed=True)
    assert info.status is S.DESTROYED


async def test_exec_without_collecting_only_streams_and_receipts_each_stream(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    import hashlib

    fake.exec_handler = lambda req: ExecResult(exit_code=0, stdout="out\n", stderr="err\n")
    sb = await aclient.create()
    seen: list[tuple[str, bytes]] = []
    result = await sb.exec(
        ["report"], on_output=lambda c: seen.append((c.stream, c.data)), collect_output=False
    )
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    assert seen == [("stdout", b"out\n"), ("stderr", b"err\n")]
    await aclient.manager.flush_receipts()
    (execution,) = [
        r.body
        for r in aclient.receipts.tail(10, sandbox_id=sb.id)
        if r.type == "execution" and r.body["op"] == "exec"
    ]
    detail = execution["detail"]
    assert isinstance(detail, dict)
    out_hash = hashlib.sha256(b"out\n").hexdigest()
    err_hash = hashlib.sha256(b"err\n").hexdigest()
    assert detail["stdout"] == {"sha256": "sha256:" + out_hash, "bytes": 4}
    assert detail["stderr"] == {"sha256": "sha256:" + err_hash, "bytes": 4}
    # The same output hash as when the output is kept: one definition, from the raw bytes.
    both = f"stdout:{out_hash}\nstderr:{err_hash}\n".encode()
    assert execution["output_hash"] == "sha256:" + hashlib.sha256(both).hexdigest()


async def test_a_replayed_exec_gives_its_output_to_the_callback_again(
    aclient: AsyncSandlot,
) -> None:
    sb = await aclient.create()
    first: list[bytes] = []
    again: list[bytes] = []
    await sb.exec("echo once", idempotency_key="k1", on_output=lambda c: first.append(c.data))
    result = await sb.exec(
        "echo once", idempotency_key="k1", on_output=lambda c: again.append(c.data)
    )
    assert result.stdout == "once\n"
    assert b"".join(again) == b"".join(first) == b"once\n"
