"""The normalized request every policy engine decides on, and the registry of actions.

A :class:`PolicyRequest` is *who* (:class:`Principal`) wants to do *what* (an action from
:data:`ACTIONS`) to *which sandbox* (:class:`Resource`), with the operation's arguments already
normalized into ``context`` (see :mod:`sandlot.policy.normalize` and
``docs/policies/README.md``). It is plain JSON data: :meth:`PolicyRequest.canonical` is what the
receipts hash (RFC 8785) and what a remote decision point receives as ``input``.

This module owns the request shape and the action names; it must not import engines, the
store, backends or front ends.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from sandlot.models import Actor, SandboxInfo, SandboxSpec

__all__ = [
    "ACTIONS",
    "ACTION_GROUPS",
    "ActionInfo",
    "ContextKind",
    "PolicyRequest",
    "Principal",
    "Resource",
]


class ContextKind(enum.StrEnum):
    """Which context shape an action carries (documented in ``docs/policies/README.md``)."""

    COMMAND = "command"
    PATH = "path"
    CHMOD = "chmod"
    CREATE = "create"
    PORT = "port"
    SIGNAL = "signal"
    NETWORK = "network"
    SNAPSHOT = "snapshot"
    NONE = "none"


@final
@dataclass(frozen=True, slots=True)
class ActionInfo:
    """One operation the gate decides on."""

    name: str
    """The action id (``Action::"<name>"`` in Cedar)."""
    kind: ContextKind
    """The shape of its context."""
    groups: tuple[str, ...]
    """Action groups it belongs to (``action in Action::"write"`` in Cedar)."""
    summary: str
    """What it does, for docs and ``explain``."""


def _a(name: str, kind: ContextKind, groups: tuple[str, ...], summary: str) -> ActionInfo:
    return ActionInfo(name=name, kind=kind, groups=groups, summary=summary)


_C, _P = ContextKind.COMMAND, ContextKind.PATH
ACTIONS: Mapping[str, ActionInfo] = MappingProxyType(
    {
        a.name: a
        for a in (
            _a(
                "sandbox.create", ContextKind.CREATE, ("lifecycle",), "create a sandbox from a spec"
            ),
            _a("exec", _C, ("run",), "run a command to completion"),
            _a("process.start", _C, ("run",), "start a background process"),
            _a("pty.open", _C, ("run",), "open an interactive terminal running a command"),
            _a(
                "exec.program",
                _C,
                ("run",),
                "a program started inside a strict sandbox (every execve, decided in the kernel)",
            ),
            _a("process.signal", ContextKind.SIGNAL, ("processes",), "send a signal to a process"),
            # The other process operations share the SIGNAL shape (signal 0: none is sent), so
            # a policy scoped to the "processes" group can read context.process_id for all.
            _a("process.list", ContextKind.SIGNAL, ("processes",), "list background processes"),
            _a(
                "process.output",
                ContextKind.SIGNAL,
                ("processes",),
                "read a background process's output",
            ),
            _a(
                "process.wait",
                ContextKind.SIGNAL,
                ("processes",),
                "wait for a background process to exit",
            ),
            _a(
                "process.stdin",
                ContextKind.SIGNAL,
                ("processes",),
                "write to a background process's standard input",
            ),
            _a("fs.read", _P, ("files", "read"), "read a file"),
            _a("fs.list", _P, ("files", "read"), "list a directory"),
            _a("fs.stat", _P, ("files", "read"), "stat a path"),
            _a("fs.write", _P, ("files", "write"), "write a file"),
            _a("fs.mkdir", _P, ("files", "write"), "create a directory"),
            _a("fs.remove", _P, ("files", "write"), "remove a file or directory"),
            _a("fs.chmod", ContextKind.CHMOD, ("files", "write"), "change a path's mode"),
            _a("port.expose", ContextKind.PORT, ("network",), "publish a sandbox port on the host"),
            _a(
                "network.update",
                ContextKind.NETWORK,
                ("network",),
                "change outbound network policy",
            ),
            _a("snapshot", ContextKind.SNAPSHOT, ("lifecycle",), "save the sandbox's state"),
            _a(
                "restore",
                ContextKind.SNAPSHOT,
                ("lifecycle",),
                "restore a snapshot into the sandbox",
            ),
            _a("fork", ContextKind.SNAPSHOT, ("lifecycle",), "make new sandboxes from this one"),
            _a("stop", ContextKind.NONE, ("lifecycle",), "stop the sandbox, keeping its files"),
            _a("resume", ContextKind.NONE, ("lifecycle",), "start a stopped sandbox again"),
            _a("destroy", ContextKind.NONE, ("lifecycle",), "destroy the sandbox and its files"),
            _a("keep_alive", ContextKind.NONE, ("lifecycle",), "extend the sandbox's time to live"),
            _a(
                "snapshot.delete",
                ContextKind.SNAPSHOT,
                ("lifecycle",),
                "delete a snapshot of the sandbox",
            ),
            _a(
                "reset",
                ContextKind.SNAPSHOT,
                ("lifecycle",),
                "return the sandbox to a snapshot and verify it",
            ),
        )
    }
)
"""Every action the gate knows. Adding one means adding it here and in ``schema.cedarschema``
(a test checks that both agree)."""

ACTION_GROUPS: tuple[str, ...] = (
    "run",
    "processes",
    "files",
    "read",
    "write",
    "network",
    "lifecycle",
)
"""Action groups. Members of one group share a context shape (except ``lifecycle``), so a
policy scoped to a group can read the context attributes of that shape."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


@final
class Principal(_Frozen):
    """Who asks: an agent or a user, in a tenant."""

    id: str = Field(min_length=1)
    """Stable id of the agent or user."""
    tenant: str = "default"
    """The tenant it acts for."""
    kind: Literal["agent", "user"] = "agent"
    """``Agent`` or ``User`` entity type in Cedar."""
    roles: tuple[str, ...] = ()
    """Free-form roles (``"admin"``...) that policies may test."""

    @field_validator("roles")
    @classmethod
    def _sorted_roles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(v)))

    @classmethod
    def of(cls, actor: Actor, *, kind: Literal["agent", "user"] = "agent") -> Principal:
        """The principal for a Manager :class:`~sandlot.models.Actor` (admins get role ``admin``)."""
        return cls(
            id=actor.principal,
            tenant=actor.tenant,
            kind=kind,
            roles=("admin",) if actor.admin else (),
        )


@final
class Resource(_Frozen):
    """The sandbox an operation targets (for ``sandbox.create``: the one about to exist)."""

    sandbox_id: str = Field(min_length=1)
    """The sandbox id."""
    tenant: str = "default"
    """The tenant that owns it."""
    backend: str = ""
    """The backend it lives on."""
    owner: str = ""
    """Its owner (``""`` when none)."""
    workdir: str = "/workspace"
    """Its working directory (absolute)."""
    labels: Mapping[str, str] = Field(default_factory=dict)
    """Its labels (Cedar tags: ``resource.hasTag("env") && resource.getTag("env") == "dev"``)."""

    @classmethod
    def of(cls, sandbox: SandboxInfo) -> Resource:
        """The resource for an existing sandbox record."""
        return cls.for_spec(
            sandbox.id, sandbox.spec, backend=sandbox.backend, tenant=sandbox.tenant
        )

    @classmethod
    def for_spec(
        cls, sandbox_id: str, spec: SandboxSpec, *, backend: str, tenant: str = "default"
    ) -> Resource:
        """The resource for a sandbox made from ``spec`` (used for ``sandbox.create``)."""
        return cls(
            sandbox_id=sandbox_id,
            tenant=tenant,
            backend=backend,
            owner=spec.owner or "",
            workdir=spec.workdir,
            labels=dict(spec.labels),
        )


@final
class PolicyRequest(_Frozen):
    """A normalized operation: the input of every engine and of the receipt's request hash."""

    principal: Principal
    """Who asks."""
    action: str
    """One of :data:`ACTIONS`."""
    resource: Resource
    """The sandbox."""
    context: dict[str, JsonValue]
    """The normalized arguments; its shape depends on the action's :class:`ContextKind`."""

    @field_validator("action")
    @classmethod
    def _known_action(cls, v: str) -> str:
        if v not in ACTIONS:
            msg = f"unknown action {v!r}; known: {', '.join(sorted(ACTIONS))}"
            raise ValueError(msg)
        return v

    @property
    def info(self) -> ActionInfo:
        """The action's registry entry."""
        return ACTIONS[self.action]

    def canonical(self) -> dict[str, JsonValue]:
        """The request as JSON data with sorted keys: what receipts hash (with RFC 8785).

        Only strings, booleans, integers, lists and objects appear, so every canonical JSON
        encoder produces the same bytes for it.
        """
        p, r = self.principal, self.resource
        return {
            "action": self.action,
            "context": self.context,
            "principal": {"id": p.id, "kind": p.kind, "roles": list(p.roles), "tenant": p.tenant},
            "resource": {
                "backend": r.backend,
                "labels": dict(sorted(r.labels.items())),
                "owner": r.owner,
                "sandbox_id": r.sandbox_id,
                "tenant": r.tenant,
                "workdir": r.workdir,
            },
        }
