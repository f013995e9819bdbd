"""The ``fake`` backend itself: :class:`FakeBackend`, the Backend protocol in memory.

It owns the fake sandboxes and snapshots, records every call (its channels' too), injects
failures, persists to the state file, and offers the hooks a test uses to act behind the
Manager's back (a stop, a vanished sandbox, egress events, process output). This module must
not import the store or the Manager.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path
from typing import final

from sandlot.backends.base import BackendState, Capabilities, SnapshotRef
from sandlot.backends.fake.channel import FakeChannel
from sandlot.backends.fake.sandbox import ExecHandler, FakeCall, FakeSandbox
from sandlot.errors import BackendError, InvalidState, NotFound
from sandlot.models import (
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    PortMapping,
    SandboxSpec,
)

__all__ = ["FakeBackend"]


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
