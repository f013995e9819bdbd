"""Which operations the gate reads on the event loop and which on a thread.

Whether a large one stalls other tenants is measured end to end, against a real server, in
tests/security/test_noisy_commands.py (in one process the collector's pauses drown it out)."""

from __future__ import annotations

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
