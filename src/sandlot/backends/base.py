"""The Backend protocol: where a sandbox lives.

A backend provisions, boots, stops and destroys sandboxes on one kind of runtime and hands out
a :class:`~sandlot.channel.base.Channel` to a running one. It never touches the store: the
Manager tells it everything it needs (the sandbox id, the spec, its own ``ref``), so a backend is
testable alone. A call a backend cannot honour raises ``NotSupported``; it never silently
downgrades (an unenforceable limit or network policy is refused at ``create``).

Every sandbox a backend makes carries an ownership mark (a label, a name prefix, a directory
under the backend's state root) from which :meth:`Backend.list_owned` finds it again, so that
``reconcile`` can reap what has no record. Names are derived from the sandbox id alone, so a
retried ``create`` after a crash finds what the first attempt made instead of making a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sandlot.channel.base import Channel
    from sandlot.models import JsonValue, NetworkAllowlist, NetworkPolicy, PortMapping, SandboxSpec

__all__ = [
    "Backend",
    "BackendState",
    "Capabilities",
    "DoctorCheck",
    "NetworkControl",
    "SnapshotRef",
]


@dataclass(frozen=True)
class Capabilities:
    """What a backend really enforces and supports."""

    network: frozenset[str] = frozenset({"allow-all"})
    """Network policy kinds it enforces: ``allow-all``, ``deny-all``, ``allowlist``."""
    limits: frozenset[str] = frozenset()
    """Resource limits it enforces: ``vcpus``, ``memory_mb``, ``pids``, ``disk_mb``."""
    pause_memory: bool = False
    """``stop`` keeps memory (processes survive a stop/resume)."""
    snapshot: bool = False
    """``snapshot``/``restore`` work."""
    fork: bool = False
    """``fork`` works."""
    ports: bool = False
    """``expose_port`` works."""
    images: bool = False
    """``spec.image`` is honoured."""
    reset: bool = False
    """``reset`` works (back to a snapshot or the baseline, verified)."""
    isolation: str = "none"
    """A word on the isolation boundary (``none``, ``namespaces``, ``gvisor``, ``vm``)."""
    host_local: bool = False
    """Sandboxes live on the host that made them (only that host's Manager can reach them)."""
    missing: Mapping[str, str] = field(default_factory=dict)
    """Why a network kind or limit is not offered, and its fix, by its name (``allow-all``,
    ``memory_mb``, …): a refusal quotes it, so the user learns what to change."""


@dataclass(frozen=True)
class BackendState:
    """What a backend reports about one of its sandboxes."""

    state: Literal["running", "stopped", "missing"]
    """``missing`` means provably absent (the backend answered and has no such sandbox)."""
    reason: str | None = None
    """Why it is not running when the backend knows (``oom``, ``exited``, …)."""
    detail: str = ""
    """Free text for the death certificate."""


@dataclass(frozen=True)
class DoctorCheck:
    """One thing ``sandlot doctor`` checked about a backend on this host.

    Each backend package offers ``doctor() -> list[DoctorCheck]``, cheap and side-effect free
    (it may run a probe, never change the host).
    """

    name: str
    """What was checked (``crun installed``, ``user namespaces``, …)."""
    ok: bool
    """Whether it is fine."""
    detail: str = ""
    """What was found (a version, the exact error)."""
    fix: str = ""
    """How to fix it, when not ok (a command to run)."""
    required: bool = True
    """False for what only an optional feature needs (the backend is usable without it)."""


@dataclass(frozen=True)
class SnapshotRef:
    """A backend's handle for a snapshot it made."""

    ref: str
    size_bytes: int = 0
    metadata: dict[str, JsonValue] = field(default_factory=dict)


class Backend(Protocol):
    """One kind of place where sandboxes live."""

    @property
    def name(self) -> str:
        """The backend's registered name (``local``, ``fake``, …)."""
        ...

    def capabilities(self) -> Capabilities:
        """What this backend enforces and supports."""
        ...

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> str:
        """Provision and boot a sandbox; return the backend's ``ref`` for it.

        Must be safe to call again for the same ``sandbox_id`` after a crash: it adopts what an
        earlier attempt made rather than making a second one.
        """
        ...

    async def start(self, ref: str, spec: SandboxSpec) -> None:
        """Boot a stopped sandbox again (its filesystem as it was)."""
        ...

    async def stop(self, ref: str) -> None:
        """End every process; keep the filesystem (and memory, if ``pause_memory``)."""
        ...

    async def destroy(self, ref: str) -> None:
        """Remove everything the sandbox had; a missing sandbox is not an error."""
        ...

    async def inspect(self, ref: str) -> BackendState:
        """The sandbox's state as the runtime sees it (``BackendUnavailable`` if it cannot
        answer)."""
        ...

    async def list_owned(self) -> dict[str, str]:
        """Every sandbox this backend owns, as ``{sandbox_id: ref}``."""
        ...

    async def channel(self, ref: str) -> Channel:
        """Connect to a running sandbox."""
        ...

    async def snapshot(self, ref: str, snapshot_id: str) -> SnapshotRef:
        """Save the sandbox's state (``NotSupported`` where it cannot). Channels handed out
        earlier may be closed by it (see :attr:`Channel.closed`)."""
        ...

    async def restore(self, ref: str, snapshot: SnapshotRef, spec: SandboxSpec) -> None:
        """Put the sandbox back to a snapshot's state and boot it."""
        ...

    async def fork(
        self, snapshot: SnapshotRef, sandbox_ids: list[str], spec: SandboxSpec
    ) -> list[str]:
        """Make one new sandbox per id from a snapshot; their refs, in order."""
        ...

    async def reset(
        self, ref: str, snapshot: SnapshotRef | None, spec: SandboxSpec
    ) -> dict[str, JsonValue]:
        """Return the sandbox to ``snapshot`` (None: its baseline, the state right after it was
        created), check that it really is in that state, and boot it.

        Returns the verification report (which sources were checked, expected and found).
        Raises ``VerificationFailed`` naming the sources that diverged (the sandbox is then
        left as it is, for inspection), ``NotSupported`` where the backend cannot reset.
        """
        ...

    async def delete_snapshot(self, snapshot: SnapshotRef) -> None:
        """Remove a snapshot's data; a missing one is not an error."""
        ...

    async def expose_port(self, ref: str, port: int) -> PortMapping:
        """Publish a sandbox port on the host."""
        ...

    async def aclose(self) -> None:
        """Release what the backend object holds (not the sandboxes)."""
        ...


@runtime_checkable
class NetworkControl(Protocol):
    """What a backend that enforces egress policy offers beyond :class:`Backend`."""

    async def update_network(self, ref: str, policy: NetworkPolicy) -> None:
        """Change a sandbox's policy; new connections follow it within a second."""
        ...

    def network_events(self, ref: str, offset: int = 0) -> tuple[list[dict[str, JsonValue]], int]:
        """Egress decisions logged since ``offset``, as JSON objects, and the next offset."""
        ...

    def suggest_network(self, ref: str) -> NetworkAllowlist:
        """The least-privilege allowlist covering the connections the sandbox made."""
        ...
