"""Which operations the gate reads on the event loop and which on a thread.

Whether a large one stalls other tenants is measured end to end, against a real server, in
tests/security/test_noisy_commands.py (in one process the collector's pauses drown it out)."""

from __future__ import annotations

import time

import anyio

from sandlot.gate.offload import INLINE_BYTES, Offload
from sandlot.models import CommandSpec


def test_small_operations_are_read_inline_and_large_ones_are_not() -> None:
    offload = Offload()
    assert offload.inline({"command": "ls -la", "cwd": "/workspace"})
    assert offload.inline({"command": ["git", "status"], "env": {"A": "1"}})
    assert offload.inline({"path": "/workspace/src/main.py"})
    assert not offload.inline({"command": "x" * (INLINE_BYTES + 1)})
    assert not offload.inline({"command": ["echo"] + ["x"] * INLINE_BYTES})
    assert not offload.inline({"command": CommandSpec(cmd="echo", args=["x" * INLINE_BYTES])})


async def test_one_tenants_queue_of_large_operations_leaves_another_tenant_a_thread() -> None:
    offload = Offload()
    done: list[str] = []

    def slow() -> None:
        time.sleep(0.3)  # a large command being read
        done.append("b")

    async def tenant_b() -> None:
        await offload.run(slow, "b")

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(tenant_b)
        await anyio.sleep(0.05)
        await offload.run(lambda: done.append("a"), "a")
        waited = time.perf_counter() - started
    assert done[0] == "a", done
    assert waited < 0.25, f"tenant a waited {waited:.2f} s behind tenant b"
    # Tenant b's own operations ran one at a time.
    assert time.perf_counter() - started >= 0.9
