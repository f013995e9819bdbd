"""The options and arguments commands share, declared once as ``Annotated`` types.

typer reads a command's signature when it builds the command line, for ``--help`` too, so
every type named here must be cheap to import: this module imports typer and the standard
library only: a sandbox status is offered as :class:`StatusName` rather than
:class:`~sandlot.models.SandboxStatus` for that reason.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

__all__ = [
    "AllowCidrOpt",
    "AllowDomainOpt",
    "CaCertOpt",
    "CpusOpt",
    "DenyCidrOpt",
    "DiskOpt",
    "EnvOpt",
    "GitAuthOpt",
    "GitDepthOpt",
    "GitOpt",
    "GitRevOpt",
    "IdArg",
    "IdleOpt",
    "ImageOpt",
    "JsonOpt",
    "KeyOpt",
    "LabelOpt",
    "MemoryOpt",
    "NetworkOpt",
    "NewBackendOpt",
    "OptionOpt",
    "OwnerOpt",
    "PidsOpt",
    "PortOpt",
    "ResumeOpt",
    "SetupOpt",
    "SpecOpt",
    "StartOpt",
    "StatusName",
    "TimeoutOpt",
    "WorkdirOpt",
]


class StatusName(enum.StrEnum):
    """The values of :class:`~sandlot.models.SandboxStatus`, in its order (a test keeps them
    equal): ``list --status`` offers them without importing the wire models."""

    PROVISIONING = "provisioning"
    SETTING_UP = "setting_up"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    RESUMING = "resuming"
    DESTROYING = "destroying"
    DESTROYED = "destroyed"
    FAILED = "failed"


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--idempotency-key",
        help="Retry-safe key: a repeat with the same request returns the first outcome.",
    ),
]
IdArg = Annotated[str, typer.Argument(help="Sandbox id.", show_default=False)]
NewBackendOpt = Annotated[
    str | None,
    typer.Option(
        "--backend",
        "-b",
        help="Backend for this sandbox (local, microvm, fake, …); default: the global --backend.",
    ),
]
ImageOpt = Annotated[
    str | None,
    typer.Option(
        "--image", help="Root filesystem: a directory, a rootfs tarball, or oci:PATH:TAG."
    ),
]
WorkdirOpt = Annotated[
    str | None, typer.Option("--workdir", help="Absolute working directory (default /workspace).")
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option("--env", "-e", help="Environment variable KEY=VALUE (repeatable)."),
]
LabelOpt = Annotated[
    list[str] | None, typer.Option("--label", "-l", help="Label KEY=VALUE (repeatable).")
]
NetworkOpt = Annotated[
    str | None, typer.Option("--network", help="allow-all, deny-all, or a JSON allowlist.")
]
AllowDomainOpt = Annotated[
    list[str] | None,
    typer.Option("--allow-domain", help="Allow egress to a domain (*.example.com for subdomains)."),
]
AllowCidrOpt = Annotated[
    list[str] | None, typer.Option("--allow-cidr", help="Allow egress to an address range.")
]
DenyCidrOpt = Annotated[
    list[str] | None, typer.Option("--deny-cidr", help="Never allow egress to an address range.")
]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", help="Time to live in seconds.")]
IdleOpt = Annotated[
    float | None, typer.Option("--idle-timeout", help="Stop after this many idle seconds.")
]
SetupOpt = Annotated[
    list[str] | None,
    typer.Option("--setup", help="Setup command run once after create (repeatable, in order)."),
]
StartOpt = Annotated[str | None, typer.Option("--start", help="Main process, launched detached.")]
ResumeOpt = Annotated[
    str | None, typer.Option("--resume", help="Launched on resume (default: --start).")
]
PortOpt = Annotated[
    list[int] | None,
    typer.Option("--port", "-p", help="Expose a sandbox port on the host (repeatable)."),
]
CpusOpt = Annotated[float | None, typer.Option("--cpus", help="CPU limit in cores.")]
MemoryOpt = Annotated[int | None, typer.Option("--memory", help="Memory limit in MiB.")]
PidsOpt = Annotated[int | None, typer.Option("--pids", help="Process limit.")]
DiskOpt = Annotated[int | None, typer.Option("--disk", help="Writable layer size in MiB.")]
OwnerOpt = Annotated[str | None, typer.Option("--owner", help="Owner name.")]
GitOpt = Annotated[
    str | None, typer.Option("--git", help="Repository URL cloned into the workdir.")
]
GitRevOpt = Annotated[
    str | None, typer.Option("--git-revision", help="Branch, tag or commit to check out.")
]
GitDepthOpt = Annotated[int | None, typer.Option("--git-depth", help="Shallow clone depth.")]
GitAuthOpt = Annotated[
    str | None,
    typer.Option(
        "--git-auth",
        envvar="SANDLOT_GIT_AUTH",
        help="Authorization header value for the clone (never stored).",
        show_envvar=True,
    ),
]
OptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        "-o",
        help="Backend option BACKEND.KEY=VALUE (value parsed as JSON if it can be).",
    ),
]
CaCertOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ca-cert",
        help=(
            "Trust this CA inside the sandbox: a PEM file, or 'host' for the CAs this host adds "
            "to its distribution's (/usr/local/share/ca-certificates); repeatable."
        ),
    ),
]
SpecOpt = Annotated[
    Path | None,
    typer.Option("--spec", help="A whole spec as a JSON or TOML file; options override it."),
]
