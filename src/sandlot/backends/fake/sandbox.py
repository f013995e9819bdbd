"""What a fake sandbox holds, and what a test sees of the calls a fake backend received.

:class:`FakeSandbox` is one sandbox's whole state (files, directories, background processes
and their output, the egress log) and its JSON form in the state file; :class:`FakeCall` is
one recorded call, :class:`FakeExec` what an ``exec_handler`` is asked. Imports only the wire
models; must not import the rest of the fake, the store or the Manager.
"""

from __future__ import annotations

import base64
import json
import posixpath
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from sandlot.models import ExecResult, JsonValue, OutputChunk, ProcessInfo, SandboxSpec

__all__ = ["ExecHandler", "FakeCall", "FakeExec", "FakeSandbox"]


@dataclass(frozen=True)
class FakeCall:
    """One call a fake backend (or one of its channels) received."""

    ref: str | None
    op: str
    args: dict[str, object]
    at: float


@dataclass(frozen=True)
class FakeExec:
    """What an ``exec_handler`` is asked to answer."""

    ref: str
    argv: list[str]
    cwd: str | None
    env: dict[str, str]
    stdin: bytes
    timeout: float | None
    sandbox: FakeSandbox


ExecHandler = Callable[[FakeExec], Awaitable[ExecResult | None] | ExecResult | None]
"""Returns the result, or None to fall back to the built-ins."""


@dataclass
class FakeSandbox:
    """One fake sandbox's state."""

    ref: str
    sandbox_id: str
    spec: SandboxSpec
    state: Literal["running", "stopped"] = "running"
    stop_reason: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/tmp"})
    processes: dict[str, ProcessInfo] = field(default_factory=dict)
    process_output: dict[str, list[OutputChunk]] = field(default_factory=dict)
    process_deadlines: dict[str, float] = field(default_factory=dict)
    """Background ``sleep N`` processes: when they exit (epoch seconds)."""
    process_echo: set[str] = field(default_factory=set)
    """Background ``cat`` processes: their stdin comes back as output."""
    boots: int = 0
    baseline: dict[str, bytes] = field(default_factory=dict)
    egress: list[dict[str, JsonValue]] = field(default_factory=list)

    def append_log(self, path: str, data: bytes) -> None:
        """Append to a file (the main process log)."""
        self._parents(path)
        self.files[path] = self.files.get(path, b"") + data

    def add_output(self, process_id: str, data: bytes, stream: str = "stdout") -> None:
        """Append a chunk to a background process's output."""
        chunks = self.process_output.setdefault(process_id, [])
        chunks.append(
            OutputChunk(
                seq=len(chunks), stream="stderr" if stream == "stderr" else "stdout", data=data
            )
        )

    def end_process(self, process_id: str, exit_code: int) -> None:
        """Mark a background process exited."""
        p = self.processes[process_id]
        self.processes[process_id] = p.model_copy(update={"running": False, "exit_code": exit_code})
        self.process_deadlines.pop(process_id, None)
        self.process_echo.discard(process_id)

    def settle_processes(self) -> None:
        """End ``sleep`` processes whose time is up."""
        now = time.time()
        for pid, deadline in list(self.process_deadlines.items()):
            if deadline <= now and self.processes[pid].running:
                self.end_process(pid, 0)

    def _parents(self, path: str) -> None:
        parent = posixpath.dirname(path)
        while parent not in self.dirs:
            self.dirs.add(parent)
            parent = posixpath.dirname(parent)

    def to_json(self) -> dict[str, object]:
        """For the state file."""
        return {
            "ref": self.ref,
            "sandbox_id": self.sandbox_id,
            "spec": json.loads(self.spec.model_dump_json()),
            "state": self.state,
            "stop_reason": self.stop_reason,
            "files": {p: base64.b64encode(d).decode() for p, d in self.files.items()},
            "modes": self.modes,
            "dirs": sorted(self.dirs),
            "processes": {k: json.loads(v.model_dump_json()) for k, v in self.processes.items()},
            "process_output": {
                k: [[c.stream, base64.b64encode(c.data).decode()] for c in v]
                for k, v in self.process_output.items()
            },
            "process_deadlines": self.process_deadlines,
            "process_echo": sorted(self.process_echo),
            "boots": self.boots,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> FakeSandbox:
        """From the state file."""
        files = data["files"]
        procs = data["processes"]
        assert isinstance(files, dict)
        assert isinstance(procs, dict)
        sb = cls(
            ref=str(data["ref"]),
            sandbox_id=str(data["sandbox_id"]),
            spec=SandboxSpec.model_validate(data["spec"]),
            state="running" if data["state"] == "running" else "stopped",
            stop_reason=data["stop_reason"] if isinstance(data["stop_reason"], str) else None,
        )
        sb.files = {str(p): base64.b64decode(str(d)) for p, d in files.items()}
        modes = data["modes"]
        assert isinstance(modes, dict)
        sb.modes = {str(p): int(m) for p, m in modes.items()}
        dirs = data["dirs"]
        assert isinstance(dirs, list)
        sb.dirs = {str(d) for d in dirs}
        sb.processes = {str(k): ProcessInfo.model_validate(v) for k, v in procs.items()}
        outputs = data.get("process_output", {})
        assert isinstance(outputs, dict)
        for pid, chunks in outputs.items():
            sb.process_output[str(pid)] = []
            for stream, b64 in chunks:
                sb.add_output(str(pid), base64.b64decode(b64), stream)
        deadlines = data.get("process_deadlines", {})
        assert isinstance(deadlines, dict)
        sb.process_deadlines = {str(k): float(v) for k, v in deadlines.items()}
        echo = data.get("process_echo", [])
        assert isinstance(echo, list)
        sb.process_echo = {str(p) for p in echo}
        boots = data["boots"]
        sb.boots = boots if isinstance(boots, int) else 0
        return sb
