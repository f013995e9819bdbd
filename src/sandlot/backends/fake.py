"""The ``fake`` backend: sandboxes in memory that record every call.

For users' own tests and for the Manager's unit tests (like httpx's MockTransport): no
isolation, no processes. Commands are answered by an ``exec_handler`` the test supplies (a
handful of built-ins otherwise: ``echo``, ``true``, ``false``, ``cat``, ``exit N``, ``sleep``,
``sh -c`` of those), files live in a dict, and a test can simulate what real runtimes do behind
our back: a stop, a vanished sandbox, an OOM, main-process output, a failing call.

Background processes of the built-ins behave like the real thing in miniature: ``echo`` prints
and exits, ``sleep N`` runs for N seconds, ``cat`` echoes its stdin until it is closed; any
other program runs until signalled (a test adds its output with ``emit_process_output`` and ends
it with ``finish_process``). Terminals echo what is typed, answer ``stty size`` and end on
``exit [N]``.

With ``state_file`` the sandboxes persist in a JSON file, so the CLI (one process per command)
can be tried on the fake backend. This module must not import the store or the Manager.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import posixpath
import shlex
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, final

import anyio

from sandlot.backends.base import BackendState, Capabilities, SnapshotRef
from sandlot.channel.base import OutputCallback, Stdin
from sandlot.errors import BackendError, InvalidRequest, InvalidState, NotFound, SandboxTimeout
from sandlot.models import (
    ExecResult,
    FileInfo,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    SandboxSpec,
)

__all__ = ["FakeBackend", "FakeCall", "FakeExec", "FakeSandbox"]


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


_ALL_CAPABILITIES = Capabilities(
    network=frozenset({"allow-all", "deny-all", "allowlist"}),
    limits=frozenset({"vcpus", "memory_mb", "pids", "disk_mb"}),
    pause_memory=False,
    snapshot=True,
    fork=True,
    ports=True,
    images=True,
    reset=True,
    isolation="none",
)


@final
class FakeBackend:
    """An in-memory :class:`~sandlot.backends.base.Backend` that records every call.

    Args:
        exec_handler: Answers commands; return None to fall back to the built-ins.
        capabilities: What the fake claims to enforce (everything by default).
        state_file: Persist sandboxes to this JSON file (for the CLI).
        name: The backend name it registers as.
    """

    def __init__(
        self,
        *,
        exec_handler: ExecHandler | None = None,
        capabilities: Capabilities = _ALL_CAPABILITIES,
        state_file: Path | None = None,
        name: str = "fake",
    ) -> None:
        self._name = name
        self.exec_handler = exec_handler
        self._capabilities = capabilities
        self.state_file = state_file
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.snapshots: dict[str, dict[str, object]] = {}
        self.calls: list[FakeCall] = []
        self._fail_next: dict[str, Exception] = {}
        self._unreachable = False
        self._load()

    # -- what tests use -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The registered name."""
        return self._name

    def calls_for(self, sandbox_id: str | None, op: str | None = None) -> list[FakeCall]:
        """Calls that concerned one sandbox (by id or ref), optionally of one ``op``."""
        refs = {sandbox_id, _ref_for(sandbox_id)} if sandbox_id is not None else {None}
        return [c for c in self.calls if c.ref in refs and (op is None or c.op == op)]

    def fail_next(self, op: str, error: Exception | None = None) -> None:
        """Make the next call of ``op`` (``create``, ``start``, ``exec``, …) raise."""
        self._fail_next[op] = error or BackendError(f"injected failure in {op}")

    def set_unreachable(self, unreachable: bool = True) -> None:
        """Make ``inspect``/``list_owned`` fail as if the runtime could not answer."""
        self._unreachable = unreachable

    def external_stop(self, sandbox_id: str, reason: str = "exited") -> None:
        """Stop a sandbox behind the Manager's back (as a host reboot or an OOM would)."""
        sb = self._get(_ref_for(sandbox_id))
        sb.state = "stopped"
        sb.stop_reason = reason
        self._save()

    def vanish(self, sandbox_id: str) -> None:
        """Make a sandbox disappear from the runtime entirely."""
        self.sandboxes.pop(_ref_for(sandbox_id), None)
        self._save()

    def emit_log(self, sandbox_id: str, text: str) -> None:
        """Append output to the sandbox's main-process log."""
        from sandlot.channel.base import MAIN_LOG

        self._get(_ref_for(sandbox_id)).append_log(MAIN_LOG, text.encode())
        self._save()

    def emit_egress(self, sandbox_id: str, host: str, *, allowed: bool, port: int = 443) -> None:
        """Log an egress decision as the egress proxy of a real backend would."""
        self._get(_ref_for(sandbox_id)).egress.append(
            {
                "host": host,
                "port": port,
                "decision": "allow" if allowed else "deny",
                "reason": "OK" if allowed else "NOT_ALLOWED",
                "time": time.time(),
            }
        )

    def emit_process_output(
        self, sandbox_id: str, process_id: str, text: str | bytes, stream: str = "stdout"
    ) -> None:
        """Add output to a background process (as if it printed it)."""
        sb = self._get(_ref_for(sandbox_id))
        sb.add_output(process_id, text.encode() if isinstance(text, str) else text, stream)
        self._save()

    def finish_process(self, sandbox_id: str, process_id: str, exit_code: int = 0) -> None:
        """End a background process with ``exit_code`` (as if it exited by itself)."""
        sb = self._get(_ref_for(sandbox_id))
        sb.end_process(process_id, exit_code)
        self._save()

    def adopt_orphan(self, sandbox_id: str, spec: SandboxSpec | None = None) -> str:
        """Make a sandbox the runtime has but no record knows about (for reconcile tests)."""
        ref = _ref_for(sandbox_id)
        self.sandboxes[ref] = FakeSandbox(
            ref=ref, sandbox_id=sandbox_id, spec=spec or SandboxSpec()
        )
        self._save()
        return ref

    # -- the Backend protocol -------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """What the fake claims."""
        return self._capabilities

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> str:
        """Make (or adopt) an in-memory sandbox."""
        ref = _ref_for(sandbox_id)
        self._record(ref, "create", spec=spec.model_dump(mode="json"))
        if ref not in self.sandboxes:
            sb = FakeSandbox(ref=ref, sandbox_id=sandbox_id, spec=spec)
            sb.dirs.add(spec.workdir)
            sb._parents(spec.workdir)
            sb.baseline = dict(sb.files)
            self.sandboxes[ref] = sb
        self.sandboxes[ref].boots += 1
        self._save()
        return ref

    async def start(self, ref: str, spec: SandboxSpec) -> None:
        """Boot a stopped sandbox."""
        self._record(ref, "start")
        sb = self._get(ref)
        sb.state = "running"
        sb.stop_reason = None
        sb.boots += 1
        self._save()

    async def stop(self, ref: str) -> None:
        """Stop a sandbox; background processes end, files stay."""
        self._record(ref, "stop")
        sb = self._get(ref)
        sb.state = "stopped"
        for pid, p in sb.processes.items():
            if p.running:
                sb.processes[pid] = p.model_copy(update={"running": False, "exit_code": 143})
        self._save()

    async def destroy(self, ref: str) -> None:
        """Forget a sandbox."""
        self._record(ref, "destroy")
        self.sandboxes.pop(ref, None)
        self._save()

    async def inspect(self, ref: str) -> BackendState:
        """Running, stopped or missing."""
        self._record(ref, "inspect")
        if self._unreachable:
            from sandlot.errors import BackendUnavailable

            msg = "fake backend set unreachable"
            raise BackendUnavailable(msg)
        self._load()
        sb = self.sandboxes.get(ref)
        if sb is None:
            return BackendState("missing")
        if sb.state == "running":
            return BackendState("running")
        return BackendState("stopped", reason=sb.stop_reason)

    async def list_owned(self) -> dict[str, str]:
        """Every fake sandbox."""
        self._record(None, "list_owned")
        if self._unreachable:
            from sandlot.errors import BackendUnavailable

            msg = "fake backend set unreachable"
            raise BackendUnavailable(msg)
        self._load()
        return {sb.sandbox_id: ref for ref, sb in self.sandboxes.items()}

    async def channel(self, ref: str) -> FakeChannel:
        """A channel to a running fake sandbox (refused, as real backends do, when it is not
        running)."""
        self._record(ref, "channel")
        if self._get(ref).state != "running":
            msg = f"fake sandbox {ref} is not running"
            raise InvalidState(msg)
        return FakeChannel(self, ref)

    async def snapshot(self, ref: str, snapshot_id: str) -> SnapshotRef:
        """Copy the files."""
        self._record(ref, "snapshot", snapshot_id=snapshot_id)
        sb = self._get(ref)
        self.snapshots[snapshot_id] = {
            "files": dict(sb.files),
            "modes": dict(sb.modes),
            "dirs": set(sb.dirs),
        }
        size = sum(len(d) for d in sb.files.values())
        return SnapshotRef(ref=snapshot_id, size_bytes=size, metadata={"files": len(sb.files)})

    async def restore(self, ref: str, snapshot: SnapshotRef, spec: SandboxSpec) -> None:
        """Put the files back as they were in the snapshot."""
        self._record(ref, "restore", snapshot=snapshot.ref)
        sb = self._get(ref)
        self._apply_snapshot(sb, snapshot)
        sb.state = "running"
        sb.processes.clear()
        self._save()

    async def fork(
        self, snapshot: SnapshotRef, sandbox_ids: list[str], spec: SandboxSpec
    ) -> list[str]:
        """New sandboxes holding the snapshot's files."""
        self._record(None, "fork", snapshot=snapshot.ref, ids=list(sandbox_ids))
        refs = []
        for sid in sandbox_ids:
            ref = await self.create(sid, spec)
            self._apply_snapshot(self.sandboxes[ref], snapshot)
            refs.append(ref)
        self._save()
        return refs

    async def reset(
        self, ref: str, snapshot: SnapshotRef | None, spec: SandboxSpec
    ) -> dict[str, JsonValue]:
        """Put the files back to the snapshot (or as created) and 'verify' them."""
        self._record(ref, "reset", snapshot=None if snapshot is None else snapshot.ref)
        sb = self._get(ref)
        if snapshot is not None:
            self._apply_snapshot(sb, snapshot)
        else:
            sb.files = dict(sb.baseline)
        sb.state = "running"
        sb.processes.clear()
        self._save()
        digest = hashlib.sha256(
            json.dumps(sorted((p, d.hex()) for p, d in sb.files.items())).encode()
        )
        return {"ok": True, "checks": [{"source": "files", "found": digest.hexdigest()}]}

    async def update_network(self, ref: str, policy: NetworkPolicy) -> None:
        """Record the new policy."""
        self._record(
            ref,
            "update_network",
            policy=policy if isinstance(policy, str) else policy.model_dump(mode="json"),
        )
        sb = self._get(ref)
        sb.spec = sb.spec.model_copy(update={"network": policy})
        self._save()

    def network_events(self, ref: str, offset: int = 0) -> tuple[list[dict[str, JsonValue]], int]:
        """Egress events emitted with :meth:`emit_egress`, from index ``offset``."""
        events = self._get(ref).egress
        return list(events[offset:]), len(events)

    def suggest_network(self, ref: str) -> NetworkAllowlist:
        """The domains of the allowed egress events."""
        hosts = sorted(
            {str(e["host"]) for e in self._get(ref).egress if e.get("decision") == "allow"}
        )
        return NetworkAllowlist(allow_domains=hosts)

    async def delete_snapshot(self, snapshot: SnapshotRef) -> None:
        """Forget a snapshot."""
        self._record(None, "delete_snapshot", snapshot=snapshot.ref)
        self.snapshots.pop(snapshot.ref, None)

    async def expose_port(self, ref: str, port: int) -> PortMapping:
        """Pretend to publish a port (nothing listens)."""
        self._record(ref, "expose_port", port=port)
        self._get(ref)
        host_port = 40000 + port % 20000
        return PortMapping(
            port=port, host="127.0.0.1", host_port=host_port, url=f"http://127.0.0.1:{host_port}"
        )

    async def aclose(self) -> None:
        """Nothing to release."""

    # -- internals -------------------------------------------------------------------------

    def _apply_snapshot(self, sb: FakeSandbox, snapshot: SnapshotRef) -> None:
        data = self.snapshots.get(snapshot.ref)
        if data is None:
            msg = f"fake snapshot {snapshot.ref} does not exist"
            raise NotFound(msg)
        files, modes, dirs = data["files"], data["modes"], data["dirs"]
        assert isinstance(files, dict)
        assert isinstance(modes, dict)
        assert isinstance(dirs, set)
        sb.files = dict(files)
        sb.modes = dict(modes)
        sb.dirs = set(dirs)

    def _record(self, ref: str | None, op: str, **args: object) -> None:
        self.calls.append(FakeCall(ref=ref, op=op, args=args, at=time.time()))
        error = self._fail_next.pop(op, None)
        if error is not None:
            raise error

    def _get(self, ref: str) -> FakeSandbox:
        # With a state file the fake stands for a runtime shared by processes: see what the
        # others did before answering.
        self._load()
        sb = self.sandboxes.get(ref)
        if sb is None:
            msg = f"fake sandbox {ref} does not exist"
            raise BackendError(msg)
        return sb

    def _running(self, ref: str) -> FakeSandbox:
        sb = self._get(ref)
        if sb.state != "running":
            msg = f"fake sandbox {ref} is not running"
            raise BackendError(msg)
        return sb

    def _load(self) -> None:
        if self.state_file is None or not self.state_file.exists():
            return
        data = json.loads(self.state_file.read_text())
        self.sandboxes = {d["ref"]: FakeSandbox.from_json(d) for d in data["sandboxes"]}
        self.snapshots = {
            sid: {
                "files": {p: base64.b64decode(b) for p, b in snap["files"].items()},
                "modes": snap["modes"],
                "dirs": set(snap["dirs"]),
            }
            for sid, snap in data.get("snapshots", {}).items()
        }

    def _save(self) -> None:
        if self.state_file is None:
            return
        snaps = {}
        for sid, snap in self.snapshots.items():
            files, dirs = snap["files"], snap["dirs"]
            assert isinstance(files, dict)
            assert isinstance(dirs, set)
            snaps[sid] = {
                "files": {p: base64.b64encode(b).decode() for p, b in files.items()},
                "modes": snap["modes"],
                "dirs": sorted(dirs),
            }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {"sandboxes": [sb.to_json() for sb in self.sandboxes.values()], "snapshots": snaps}
            )
        )
        tmp.replace(self.state_file)


def _ref_for(sandbox_id: str | None) -> str:
    return f"fake-{sandbox_id}"


class _FakePty:
    """A terminal in miniature: echoes keystrokes (as a terminal in cooked mode does) and runs
    a line-oriented toy shell: ``stty size`` answers the size, ``exit [N]`` ends it."""

    def __init__(self, pty_id: str, argv: list[str], rows: int, cols: int) -> None:
        self._id = pty_id
        self.argv = argv
        self.rows, self.cols = rows, cols
        self.exit_code: int | None = None
        self._buffer = bytearray()
        self._line = bytearray()
        self._changed = anyio.Event()

    @property
    def id(self) -> str:
        return self._id

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def write(self, data: bytes) -> None:
        if self.exit_code is not None:
            msg = f"terminal {self._id} has exited"
            raise BackendError(msg)
        for byte in data:
            if byte in (0x0D, 0x0A):
                self._buffer.extend(b"\r\n")
                self._run(self._line.decode(errors="replace").strip())
                self._line.clear()
                if self.exit_code is not None:
                    break
            else:
                self._buffer.append(byte)
                self._line.append(byte)
        self._notify()

    def _run(self, line: str) -> None:
        words = line.split()
        if words == ["stty", "size"]:
            self._buffer.extend(f"{self.rows} {self.cols}\r\n".encode())
        elif words[:1] == ["exit"]:
            self.exit_code = int(words[1]) if len(words) > 1 and words[1].isdigit() else 0

    async def resize(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols

    async def read(self) -> bytes:
        while not self._buffer and self.exit_code is None:
            await self._changed.wait()
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def wait(self) -> int:
        while self.exit_code is None:
            await self._changed.wait()
        return self.exit_code

    async def close(self) -> None:
        if self.exit_code is None:
            self.exit_code = 129  # hung up: 128 + SIGHUP
        self._notify()


@final
class FakeChannel:
    """The fake's :class:`~sandlot.channel.base.Channel`."""

    def __init__(self, backend: FakeBackend, ref: str) -> None:
        self._backend = backend
        self._ref = ref
        self._next_pid = 100
        self._closed = False

    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._closed

    async def exec(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        collect: bool = True,
    ) -> ExecResult:
        """Answer with the ``exec_handler`` or the built-ins, streaming the output."""
        self._backend._record(self._ref, "exec", argv=list(argv), cwd=cwd, timeout=timeout)
        sb = self._backend._running(self._ref)
        data = await _collect(stdin)
        started = time.perf_counter()
        request = FakeExec(self._ref, list(argv), cwd, dict(env or {}), data, timeout, sb)
        result: ExecResult | None = None
        if self._backend.exec_handler is not None:
            answer = self._backend.exec_handler(request)
            result = await answer if inspect.isawaitable(answer) else answer
        if result is None:
            result = await _builtin(request)
        if result.exit_code == 124 and result.timed_out and timeout is None:
            msg = "exec_handler returned timed_out without a timeout"
            raise InvalidRequest(msg)
        seq = 0
        if on_output is not None:
            for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
                if text:
                    maybe = on_output(OutputChunk(seq=seq, stream=stream, data=text.encode()))
                    if inspect.isawaitable(maybe):
                        await maybe
                    seq += 1
        duration = (time.perf_counter() - started) * 1000
        update: dict[str, object] = {"duration_ms": result.duration_ms or duration}
        if not collect:
            update |= {"stdout": "", "stderr": ""}
        return result.model_copy(update=update)

    async def start_process(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        log_path: str | None = None,
    ) -> ProcessInfo:
        """Record a background process; it 'runs' until stopped or signalled."""
        self._backend._record(self._ref, "start_process", argv=list(argv), name=name)
        sb = self._backend._running(self._ref)
        self._next_pid += 1
        pid = f"p{len(sb.processes) + 1}"
        info = ProcessInfo(
            id=pid, pid=self._next_pid, command=list(argv), name=name, started_at=time.time()
        )
        sb.processes[pid] = info
        sb.process_output[pid] = []
        self._plan(sb, pid, list(argv))
        if log_path is not None:
            sb.append_log(log_path, b"".join(c.data for c in sb.process_output[pid]))
        self._backend._save()
        return sb.processes[pid]

    @staticmethod
    def _plan(sb: FakeSandbox, pid: str, argv: list[str]) -> None:
        """What a background process of the built-ins does (others run until signalled)."""
        if len(argv) >= 3 and posixpath.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
            try:
                argv = shlex.split(argv[2])
            except ValueError:
                argv = []
        if not argv:
            return
        prog, args = posixpath.basename(argv[0]), argv[1:]
        if prog == "echo":
            sb.add_output(pid, (" ".join(args) + "\n").encode())
            sb.end_process(pid, 0)
        elif prog in ("true", "false", "exit"):
            code = {"true": 0, "false": 1}.get(prog)
            if code is None:
                code = int(args[0]) if args and args[0].isdigit() else 0
            sb.end_process(pid, code)
        elif prog == "sleep":
            try:
                seconds = float(args[0]) if args else 0.0
            except ValueError:
                seconds = 0.0
            sb.process_deadlines[pid] = time.time() + seconds
        elif prog == "cat" and not args:
            sb.process_echo.add(pid)

    async def list_processes(self) -> list[ProcessInfo]:
        """Background processes."""
        sb = self._backend._running(self._ref)
        sb.settle_processes()
        return list(sb.processes.values())

    async def signal_process(self, process_id: str, signum: int) -> None:
        """'Kill' a background process (``InvalidState`` once it exited)."""
        self._backend._record(self._ref, "signal_process", id=process_id, signum=signum)
        sb = self._backend._running(self._ref)
        if not self._process(sb, process_id).running:
            msg = f"process {process_id} has exited"
            raise InvalidState(msg, process=process_id)
        sb.end_process(process_id, 128 + signum)
        self._backend._save()

    async def wait_process(self, process_id: str, timeout: float | None = None) -> ProcessInfo:
        """Wait until the process exits (polls)."""
        sb = self._backend._running(self._ref)
        with anyio.move_on_after(timeout):
            # Polls: the state lives in plain dicts that tests (and, with a state file, other
            # processes) change.
            while self._process(sb, process_id).running:
                await anyio.sleep(0.01)
                sb = self._backend._running(self._ref)
            return self._process(sb, process_id)
        msg = f"process {process_id} still running after {timeout}s"
        raise SandboxTimeout(msg)

    async def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """Buffered output from chunk ``offset``; with ``follow``, polls until it exits."""
        while True:
            sb = self._backend._running(self._ref)
            running = self._process(sb, process_id).running
            chunks = sb.process_output.get(process_id, [])
            for chunk in chunks[offset:]:
                yield chunk
            offset = max(offset, len(chunks))
            if not follow or not running:
                return
            await anyio.sleep(0.02)

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool = False) -> None:
        """Record the input (a ``cat`` echoes it; closing its stdin ends it)."""
        self._backend._record(self._ref, "write_stdin", id=process_id, data=data, close=close)
        sb = self._backend._running(self._ref)
        if not self._process(sb, process_id).running:
            msg = f"process {process_id} has exited"
            raise InvalidState(msg, process=process_id)
        if process_id in sb.process_echo:
            if data:
                sb.add_output(process_id, data)
            if close:
                sb.end_process(process_id, 0)
        self._backend._save()

    async def open_pty(
        self,
        argv: list[str],
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> _FakePty:
        """An echoing fake terminal."""
        self._backend._record(self._ref, "open_pty", argv=list(argv))
        self._backend._running(self._ref)
        self._next_pid += 1
        return _FakePty(f"pty{self._next_pid}", list(argv), rows, cols)

    async def resolve(self, path: str, *, follow_last: bool = True) -> str:
        """The path made normal (the fake filesystem has no symlinks)."""
        self._backend._running(self._ref)
        return posixpath.normpath(path).replace("//", "/")

    async def read_file(self, path: str, *, nofollow: bool = False) -> AsyncIterator[bytes]:
        """A file's bytes."""
        self._backend._record(self._ref, "read_file", path=path)
        sb = self._backend._running(self._ref)
        if path not in sb.files:
            msg = f"no such file {path!r}"
            raise NotFound(msg, path=path)
        data = sb.files[path]
        for i in range(0, max(len(data), 1), 1 << 16):
            yield data[i : i + (1 << 16)]

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        nofollow: bool = False,
    ) -> FileInfo:
        """Store a file."""
        body = await _collect(data)
        self._backend._record(self._ref, "write_file", path=path, size=len(body))
        sb = self._backend._running(self._ref)
        if path in sb.dirs:
            msg = f"{path} is a directory"
            raise InvalidRequest(msg, path=path)
        sb._parents(path)
        sb.files[path] = body
        sb.modes[path] = mode if mode is not None else sb.modes.get(path, 0o644)
        self._backend._save()
        return self._info(sb, path)

    async def list_files(self, path: str, *, nofollow: bool = False) -> list[FileInfo]:
        """Entries directly under ``path``."""
        self._backend._record(self._ref, "list_files", path=path)
        sb = self._backend._running(self._ref)
        if path not in sb.dirs:
            msg = f"no such directory {path!r}"
            raise NotFound(msg, path=path)
        names = {p for p in (*sb.files, *sb.dirs) if p != path and posixpath.dirname(p) == path}
        return [self._info(sb, p) for p in sorted(names)]

    async def stat(self, path: str) -> FileInfo:
        """One entry."""
        sb = self._backend._running(self._ref)
        if path not in sb.files and path not in sb.dirs:
            msg = f"no such file {path!r}"
            raise NotFound(msg, path=path)
        return self._info(sb, path)

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents."""
        self._backend._record(self._ref, "mkdir", path=path)
        sb = self._backend._running(self._ref)
        sb._parents(path + "/x")
        self._backend._save()

    async def remove(self, path: str, *, recursive: bool = False, nofollow: bool = False) -> None:
        """Remove a file or a tree."""
        self._backend._record(self._ref, "remove", path=path, recursive=recursive)
        sb = self._backend._running(self._ref)
        if path in sb.files:
            del sb.files[path]
        elif path in sb.dirs:
            inside = [p for p in (*sb.files, *sb.dirs) if p.startswith(path.rstrip("/") + "/")]
            if inside and not recursive:
                msg = f"{path} is a non-empty directory (use recursive)"
                raise InvalidRequest(msg, path=path)
            for p in inside:
                sb.files.pop(p, None)
                sb.dirs.discard(p)
            sb.dirs.discard(path)
        else:
            msg = f"no such file {path!r}"
            raise NotFound(msg, path=path)
        self._backend._save()

    async def chmod(self, path: str, mode: int) -> None:
        """Change a file's mode."""
        sb = self._backend._running(self._ref)
        await self.stat(path)
        sb.modes[path] = mode
        self._backend._save()

    async def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file from ``offset``; with ``follow``, poll for appended data."""
        sb = self._backend._running(self._ref)
        while True:
            data = sb.files.get(path, b"")
            if len(data) > offset:
                yield data[offset:]
                offset = len(data)
            if not follow:
                return
            await anyio.sleep(0.05)

    async def close(self) -> None:
        """Mark the channel closed."""
        self._closed = True

    def _process(self, sb: FakeSandbox, process_id: str) -> ProcessInfo:
        sb.settle_processes()
        p = sb.processes.get(process_id)
        if p is None:
            msg = f"no process {process_id!r}"
            raise NotFound(msg, process=process_id)
        return p

    def _info(self, sb: FakeSandbox, path: str) -> FileInfo:
        is_dir = path in sb.dirs
        return FileInfo(
            path=path,
            name=posixpath.basename(path) or "/",
            type="dir" if is_dir else "file",
            size=0 if is_dir else len(sb.files.get(path, b"")),
            mode=0o755 if is_dir else sb.modes.get(path, 0o644),
            mtime=time.time(),
        )


async def _collect(data: Stdin | bytes) -> bytes:
    if data is None:
        return b""
    if isinstance(data, bytes):
        return data
    parts = [chunk async for chunk in data]
    return b"".join(parts)


async def _builtin(req: FakeExec) -> ExecResult:
    """A few commands, enough to try the CLI and the SDK on the fake backend."""
    argv = req.argv
    if len(argv) >= 3 and posixpath.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
        try:
            argv = shlex.split(argv[2])
        except ValueError:
            return ExecResult(exit_code=2, stderr="fake sh: cannot parse command\n")
    if not argv:
        return ExecResult(exit_code=0)
    prog, args = posixpath.basename(argv[0]), argv[1:]
    if prog == "echo":
        return ExecResult(exit_code=0, stdout=" ".join(args) + "\n")
    if prog == "true":
        return ExecResult(exit_code=0)
    if prog == "false":
        return ExecResult(exit_code=1)
    if prog == "exit":
        if args and not args[0].lstrip("-").isdigit():
            return ExecResult(
                exit_code=2, stderr=f"fake sh: exit: {args[0]}: numeric argument required\n"
            )
        return ExecResult(exit_code=int(args[0]) if args else 0)
    if prog == "sleep":
        try:
            seconds = float(args[0]) if args else 0.0
        except ValueError:
            return ExecResult(
                exit_code=1, stderr=f"fake sleep: invalid time interval {args[0]!r}\n"
            )
        if req.timeout is not None and seconds > req.timeout:
            await anyio.sleep(req.timeout)
            return ExecResult(exit_code=124, timed_out=True)
        await anyio.sleep(seconds)
        return ExecResult(exit_code=0)
    if prog == "cat":
        if not args:
            return ExecResult(exit_code=0, stdout=req.stdin.decode(errors="replace"))
        out = []
        for path in args:
            full = posixpath.normpath(posixpath.join(req.cwd or "/", path))
            if full not in req.sandbox.files:
                return ExecResult(exit_code=1, stderr=f"cat: {path}: No such file or directory\n")
            out.append(req.sandbox.files[full].decode(errors="replace"))
        return ExecResult(exit_code=0, stdout="".join(out))
    return ExecResult(exit_code=127, stderr=f"fake backend: {prog}: command not found\n")
