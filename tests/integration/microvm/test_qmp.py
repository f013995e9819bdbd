"""The QMP client and VM process handling against a real QEMU that never boots a guest (fast)."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.qmp import QmpClient, QmpError


@pytest.fixture
def vm_dir(tmp_path: Path) -> Path:
    if shutil.which(qemu.QEMU_BINARY) is None:
        pytest.skip("needs qemu-system-x86_64 (apt-get install qemu-system-x86)")
    # Deep enough that the socket path is over sun_path's 108 bytes.
    path = tmp_path / ("d" * 60) / ("e" * 60)
    path.mkdir(parents=True)
    return path


def _argv(vm_dir: Path) -> list[str]:
    return [
        qemu.QEMU_BINARY, "-M", "microvm", "-accel", "tcg", "-S", "-nodefaults",
        "-display", "none", "-m", "64M", "-qmp", f"unix:{qemu.QMP_SOCKET},server=on,wait=off",
        "-daemonize", "-pidfile", str(vm_dir / "qemu.pid"),
    ]  # fmt: skip


async def test_qmp_round_trip_and_kill(vm_dir: Path) -> None:
    assert len(str(vm_dir / qemu.QMP_SOCKET)) > 108
    pid = await qemu.launch(vm_dir, _argv(vm_dir))
    assert qemu.read_pid(vm_dir) == pid
    async with await QmpClient.connect(vm_dir / qemu.QMP_SOCKET) as q:
        assert await q.status() == "prelaunch"
        with pytest.raises(QmpError) as caught:
            await q.execute("no-such-command")
        assert caught.value.details["qmp_class"] == "CommandNotFound"
        await q.execute("cont")
        assert await q.status() == "running"
        await q.execute("stop")
        with anyio.fail_after(5):
            event = await q.wait_event("STOP")
        assert event["event"] == "STOP"
    await qemu.kill_vm(vm_dir)
    assert qemu.read_pid(vm_dir) is None
    assert not (vm_dir / qemu.QMP_SOCKET).exists()
    await qemu.kill_vm(vm_dir)  # already gone: fine


async def test_a_recycled_pid_is_not_ours(vm_dir: Path) -> None:
    (vm_dir / "qemu.pid").write_text("1\n")
    assert qemu.read_pid(vm_dir) is None
    assert not qemu.is_running(vm_dir)


async def test_launch_reports_qemu_errors(vm_dir: Path) -> None:
    from sandlot.errors import BackendError

    with pytest.raises(BackendError, match="QEMU failed to start"):
        await qemu.launch(vm_dir, [*_argv(vm_dir), "-device", "no-such-device"])


def test_vcpus_round_up() -> None:
    assert qemu.vcpus_for(None) == 1
    assert qemu.vcpus_for(0.5) == 1
    assert qemu.vcpus_for(1.5) == 2
    assert qemu.vcpus_for(2) == 2
