"""sandlot's Cedar schema, as data, and its rendering to Cedar schema text.

The schema is kept as Python data so that the Cedar engine can render a *pruned* copy per
policy version: Cedar's cost per decision grows with every context attribute it parses and
validates (about 7 µs each on our CI machine), so the engine sends only the attributes the
loaded policies read, with a schema that declares exactly those. The full schema is what
policies are validated against at load time, and what ``docs/policies/schema.cedarschema``
shows (a test keeps that file equal to :func:`render_schema`).

This module imports only :mod:`sandlot.policy.request`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from sandlot.policy.request import ACTION_GROUPS, ACTIONS, ContextKind

__all__ = ["CONTEXT_TYPES", "render_schema"]

CONTEXT_TYPES: Final[Mapping[ContextKind, tuple[tuple[str, str, str], ...]]] = {
    ContextKind.COMMAND: (
        ("program", "String", 'basename after unwrapping sudo/env/...; "" for a bare redirection'),
        ("argv0", "String", 'the program as written ("/bin/rm")'),
        ("args", "Set<String>", 'arguments; combined short flags split ("-rf" -> "-r", "-f")'),
        (
            "flags",
            "Set<String>",
            'canonical names for known programs ("recursive"), else as written',
        ),
        ("operands", "Set<String>", "non-option arguments as written"),
        (
            "paths",
            "Set<String>",
            "absolute normal paths named (operands, redirections, -o FILE...)",
        ),
        ("glob_dirs", "Set<String>", 'directories whose entries a glob names ("/*" -> "/")'),
        ("writes", "Set<String>", "paths created, modified or removed (not /dev/null and friends)"),
        ("writes_within", "Set<String>", "directories every write is within (empty: no writes)"),
        ("devices", "Set<String>", "device nodes named (/dev/sda; not /dev/null, /dev/fd/*...)"),
        ("device_writes", "Set<String>", "device nodes written"),
        ("via", "Set<String>", 'wrappers and shells passed through ("sudo", "env", "bash")'),
        ("env", "Set<String>", "names of environment variables set for it"),
        ("cwd", "String", "where the request starts"),
        ("shell", "Bool", "a shell string was read"),
        (
            "shell_undecidable",
            "Bool",
            "something only the running shell can decide ($X, $(..), eval)",
        ),
        ("shell_features", "Set<String>", '"variable", "command_substitution", "heredoc", ...'),
        ("raw", "String", "the command as given"),
        ("programs", "Set<String>", "every program and wrapper in the request"),
        ("command_count", "Long", "how many simple commands the request runs"),
    ),
    ContextKind.PATH: (
        ("path", "String", "absolute, normal"),
        ("within", "Set<String>", "the path and every directory above it"),
        ("recursive", "Bool", "recursive listing or removal"),
        ("device", "Bool", "a device node, as in device_writes (not /dev/null, /dev/shm/...)"),
    ),
    ContextKind.CHMOD: (
        ("path", "String", "absolute, normal"),
        ("within", "Set<String>", "the path and every directory above it"),
        ("recursive", "Bool", "always false today"),
        ("device", "Bool", "a device node, as in device_writes (not /dev/null, /dev/shm/...)"),
        ("mode", "Long", "the new mode bits (0o755 is 493)"),
    ),
    ContextKind.CREATE: (
        ("image", "String", '"" for the default root'),
        ("workdir", "String", "absolute"),
        ("ports", "Set<Long>", "ports exposed at create"),
        ("vcpus_milli", "Long", "CPU limit in thousandths of a core; 0 = none"),
        ("memory_mb", "Long", "0 = none"),
        ("pids", "Long", "0 = none"),
        ("disk_mb", "Long", "0 = none"),
        ("timeout_s", "Long", "time to live; 0 = none"),
        ("idle_timeout_s", "Long", "0 = none"),
        ("git_url", "String", '"" when no repository is cloned'),
        ("env", "Set<String>", "environment variable names"),
        ("has_setup", "Bool", "setup commands run at create (each is also gated as exec)"),
        ("has_start", "Bool", "a main process is started"),
        ("network", "String", '"allow-all", "deny-all" or "allowlist"'),
        ("allow_domains", "Set<String>", "for an allowlist"),
        ("allow_cidrs", "Set<String>", "for an allowlist"),
        ("deny_cidrs", "Set<String>", "for an allowlist"),
    ),
    ContextKind.PORT: (("port", "Long", "the sandbox port"),),
    ContextKind.SIGNAL: (
        ("process_id", "String", 'the process handle ("" for process.list)'),
        ("signal", "Long", "signal number (0 for operations that send none)"),
    ),
    ContextKind.NETWORK: (
        ("network", "String", '"allow-all", "deny-all" or "allowlist"'),
        ("allow_domains", "Set<String>", "for an allowlist"),
        ("allow_cidrs", "Set<String>", "for an allowlist"),
        ("deny_cidrs", "Set<String>", "for an allowlist"),
    ),
    ContextKind.SNAPSHOT: (
        ("snapshot_id", "String", '"" when a new snapshot is made'),
        ("count", "Long", "fork: how many copies; else 1"),
    ),
    ContextKind.NONE: (),
}
"""Per context kind: (attribute, Cedar type, meaning), in documentation order."""

_TYPE_NAMES: Final = {
    ContextKind.COMMAND: "CommandContext",
    ContextKind.PATH: "PathContext",
    ContextKind.CHMOD: "ChmodContext",
    ContextKind.CREATE: "CreateContext",
    ContextKind.PORT: "PortContext",
    ContextKind.SIGNAL: "SignalContext",
    ContextKind.NETWORK: "NetworkContext",
    ContextKind.SNAPSHOT: "SnapshotContext",
}

_HEADER: Final = """\
// The shape of every request sandlot's policy gate sends to Cedar (schema version 1).
// Generated from sandlot/policy/schema.py; docs/policies/README.md explains the attributes.

entity Tenant;

// Who asks. `principal in Tenant::"acme"` and `principal.tenant == "acme"` both work.
entity Agent in [Tenant] { tenant: String, roles: Set<String> };
entity User in [Tenant] { tenant: String, roles: Set<String> };

// The sandbox. Labels are tags: `resource.hasTag("env") && resource.getTag("env") == "dev"`.
entity Sandbox in [Tenant] {
  tenant: String,
  backend: String,
  owner: String,
  workdir: String,
} tags String;
"""


def context_fields(kind: ContextKind, keep: Iterable[str] | None = None) -> list[str]:
    """The attribute names of a context kind (only those in ``keep`` when given)."""
    names = [name for name, _, _ in CONTEXT_TYPES[kind]]
    if keep is None:
        return names
    wanted = set(keep)
    return [n for n in names if n in wanted]


def render_schema(keep: Iterable[str] | None = None, *, comments: bool = True) -> str:
    """The Cedar schema text.

    Args:
        keep: When given, context types declare only these attributes (the others are left
            out, so requests must leave them out too).
        comments: Include the attribute explanations.
    """
    wanted = None if keep is None else set(keep)
    out = [_HEADER]
    for kind, type_name in _TYPE_NAMES.items():
        fields = [f for f in CONTEXT_TYPES[kind] if wanted is None or f[0] in wanted]
        if not fields:
            out.append(f"type {type_name} = {{}};")
            continue
        out.append(f"type {type_name} = {{")
        for name, cedar_type, meaning in fields:
            note = f"  // {meaning}" if comments else ""
            out.append(f"  {name}: {cedar_type},{note}")
        out.append("};")
    out.append("")
    out.append("// Action groups: members of a group share a context type (except lifecycle).")
    out.append("action " + ", ".join(f'"{g}"' for g in ACTION_GROUPS) + ";")
    for info in ACTIONS.values():
        groups = ", ".join(f'Action::"{g}"' for g in info.groups)
        context = _TYPE_NAMES.get(info.kind, "{}")
        out.append(
            f'action "{info.name}" in [{groups}]\n'
            f"  appliesTo {{ principal: [Agent, User], resource: [Sandbox], context: {context} }};"
        )
    return "\n".join(out) + "\n"
