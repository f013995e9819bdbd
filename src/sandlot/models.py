"""Wire models: one pydantic schema for the SDK, the store, HTTP and MCP.

This module owns what a sandbox *is* (its spec and its record) and what operations return,
including the plain records the HTTP client reads back (a reconcile report, a held operation's
approval, a policy verdict and its explanation): the client imports this module, never the
Manager, the gate or the policy engines that produce them. It validates user input with one
clear message naming the field, and imports nothing from sandlot but :mod:`sandlot.errors`.
"""

from __future__ import annotations

import enum
import ipaddress
import posixpath
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, TypeAlias, TypeVar, final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
)

from sandlot.errors import InvalidRequest, PolicyDenied

__all__ = [
    "LOCAL_ACTOR",
    "SYSTEM_PRINCIPAL",
    "Actor",
    "Approval",
    "Command",
    "CommandSpec",
    "DeathCertificate",
    "Decision",
    "ExecResult",
    "Explanation",
    "FileInfo",
    "GitSource",
    "JsonValue",
    "NetworkAllowlist",
    "NetworkPolicy",
    "Outcome",
    "OutputChunk",
    "PolicyTrace",
    "PortMapping",
    "ProcessInfo",
    "ReasonCode",
    "ReconcileReport",
    "Resources",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxStatus",
    "SnapshotInfo",
    "UnitTrace",
    "new_id",
    "parse_model",
    "system_actor",
    "utcnow",
]

M = TypeVar("M", bound=BaseModel)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?$")


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A short random id such as ``sb-3f9c2a7d1e04``; 48 bits is plenty per installation."""
    return f"{prefix}-{secrets.token_hex(6)}"


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        msg = f"must be an absolute path, got {path!r}"
        raise ValueError(msg)
    if "\x00" in path:
        msg = "must not contain NUL bytes"
        raise ValueError(msg)
    return posixpath.normpath(path) if path != "/" else "/"


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            msg = f"{name!r} is not a valid environment variable name"
            raise ValueError(msg)
        if "\x00" in value:
            msg = f"the value of {name} contains a NUL byte"
            raise ValueError(msg)
    return env


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, use_attribute_docstrings=True)


class Actor(_Model):
    """Who asks: the principal (a user or an agent) and the tenant it acts for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = "default"
    """Every record belongs to one tenant; an actor sees only its own tenant's."""
    principal: str = "local"
    """The user or agent, as policy and receipts name it."""
    admin: bool = False
    """Admins see every tenant (operators, reconcile)."""


LOCAL_ACTOR = Actor()
"""The actor of the embedded SDK and CLI: the local user, default tenant."""

SYSTEM_PRINCIPAL = "system"
"""The principal of sandlot's own duties (TTL and idle stops, discarding failed sandboxes,
reaping orphans); no API key may act as it."""


def system_actor(tenant: str) -> Actor:
    """Who sandlot's own duties act as on a sandbox of ``tenant``: the system principal in the
    sandbox's own tenant, so a policy's tenant boundary holds and receipts name the system."""
    return Actor(tenant=tenant, principal=SYSTEM_PRINCIPAL, admin=True)


class CommandSpec(_Model):
    """A command run with an exact argv, no shell."""

    cmd: str = Field(min_length=1)
    """The program (looked up on PATH inside the sandbox when it has no slash)."""
    args: list[str] = Field(default_factory=list)
    """Arguments after the program."""
    cwd: str | None = None
    """Working directory; default is the sandbox's workdir."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables."""

    @field_validator("cwd")
    @classmethod
    def _cwd_absolute(cls, v: str | None) -> str | None:
        return None if v is None else _absolute(v)

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    def argv(self) -> list[str]:
        """The full argv."""
        return [self.cmd, *self.args]


Command: TypeAlias = str | CommandSpec
"""A string runs with ``sh -c``; a :class:`CommandSpec` runs with an exact argv."""


class GitSource(_Model):
    """A repository cloned into the workdir when the sandbox is created."""

    url: str = Field(min_length=1)
    """Clone URL (https, ssh or a local path)."""
    revision: str | None = None
    """Branch, tag or commit to check out; default is the remote's HEAD."""
    depth: int | None = Field(default=None, gt=0)
    """Shallow clone depth."""
    auth: str | None = Field(default=None, exclude=True, repr=False)
    """An ``Authorization`` header value sent once while cloning; never stored or written into
    the repository's config."""


class Resources(_Model):
    """Resource limits, enforced by backends that say so in their capabilities."""

    vcpus: float | None = Field(default=None, gt=0)
    """CPU quota in cores (``0.5`` is half a core)."""
    memory_mb: int | None = Field(default=None, gt=0)
    """Memory limit in MiB; going over it kills the offending process (cause ``oom``)."""
    pids: int | None = Field(default=None, gt=0)
    """Maximum number of processes and threads."""
    disk_mb: int | None = Field(default=None, gt=0)
    """Size of the writable layer in MiB."""


def _check_cidrs(values: list[str]) -> list[str]:
    out = []
    for v in values:
        try:
            out.append(str(ipaddress.ip_network(v, strict=False)))
        except ValueError:
            msg = f"{v!r} is not a valid CIDR"
            raise ValueError(msg) from None
    return out


_DOMAIN = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


class NetworkAllowlist(_Model):
    """Outbound access limited to listed domains and address ranges."""

    allow_domains: list[str] = Field(default_factory=list)
    """``example.com`` matches itself; ``*.example.com`` matches its subdomains only."""
    allow_cidrs: list[str] = Field(default_factory=list)
    """Address ranges that may be reached (by IP, or by a name resolving into them)."""
    deny_cidrs: list[str] = Field(default_factory=list)
    """Address ranges that are never reached; these win over both allow lists."""
    record: bool = False
    """Record mode: log everything allowed, to learn the least-privilege allowlist."""

    @field_validator("allow_domains")
    @classmethod
    def _domains(cls, v: list[str]) -> list[str]:
        out = []
        for d in v:
            d = d.strip().lower().rstrip(".")
            if not _DOMAIN.match(d):
                msg = f"{d!r} is not a domain name or *.domain pattern"
                raise ValueError(msg)
            out.append(d)
        return out

    @field_validator("allow_cidrs")
    @classmethod
    def _allow(cls, v: list[str]) -> list[str]:
        return _check_cidrs(v)

    @field_validator("deny_cidrs")
    @classmethod
    def _deny(cls, v: list[str]) -> list[str]:
        return _check_cidrs(v)


NetworkPolicy: TypeAlias = Literal["allow-all", "deny-all"] | NetworkAllowlist
"""``"allow-all"`` (default), ``"deny-all"`` (loopback only) or an allowlist."""

_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.DOTALL)
# Each one is a few hundred bytes in every record and receipt of the sandbox; a whole
# distribution bundle (about 150) belongs in the image, not in a spec.
_MAX_CA_CERTIFICATES = 100


def _check_certificates(values: list[str]) -> list[str]:
    """One canonical PEM certificate per item, in order, without duplicates."""
    if not values:
        return values
    # Imported here: cryptography's X.509 module costs every process that imports the models
    # (the CLI, each command) about 30 ms, and only specs with certificates need it.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.serialization import Encoding

    out: list[str] = []
    seen: set[bytes] = set()
    for i, text in enumerate(values):
        blocks = list(_PEM_BLOCK.finditer(text))
        if not blocks:
            msg = f"entry {i}: no PEM certificate in it (expected a BEGIN CERTIFICATE block)"
            raise ValueError(msg)
        for block in blocks:
            kind = block.group(1)
            if kind != "CERTIFICATE":
                # Refused rather than dropped: a key pasted with its certificate would
                # otherwise be stored with the spec and signed into receipts.
                what = "a private key" if "PRIVATE KEY" in kind else f"a {kind} block"
                msg = f"entry {i}: it holds {what}; give only certificates (BEGIN CERTIFICATE)"
                raise ValueError(msg)
        for n, block in enumerate(blocks):
            try:
                cert = x509.load_pem_x509_certificate(block.group(0).encode())
            except ValueError as e:
                why = str(e).split(":", 1)[0]  # the rest is the parser's internal state
                msg = f"entry {i}: certificate {n} in it is not valid X.509 ({why})"
                raise ValueError(msg) from None
            fingerprint = cert.fingerprint(hashes.SHA256())
            if fingerprint not in seen:
                seen.add(fingerprint)
                out.append(cert.public_bytes(Encoding.PEM).decode())
    if len(out) > _MAX_CA_CERTIFICATES:
        msg = (
            f"at most {_MAX_CA_CERTIFICATES} certificates, got {len(out)}: give only the CAs "
            "the sandbox lacks (its distribution's own are trusted already)"
        )
        raise ValueError(msg)
    return out


class SandboxSpec(_Model):
    """What a sandbox should be. Every field is optional; defaults give a working sandbox."""

    image: str | None = None
    """Root filesystem: a directory, a rootfs tarball or ``oci:PATH:TAG``; default is the host's
    root view (read-only ``/usr``)."""
    workdir: str = "/workspace"
    """Absolute working directory, created if missing."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment for every command."""
    git: GitSource | None = None
    """A repository cloned into the workdir at create."""
    setup: Command | list[Command] | None = None
    """Run once after create; stops at the first non-zero exit, which fails the sandbox."""
    start: Command | None = None
    """The main process, launched detached; output goes to the sandbox log."""
    resume: Command | None = None
    """Launched on resume instead of ``start``; defaults to ``start``."""
    ports: list[int] = Field(default_factory=list)
    """Ports to expose on the host at create."""
    timeout: float | None = Field(default=None)
    """Time to live in seconds from create; on expiry the sandbox is stopped (cause ``ttl``)."""
    idle_timeout: float | None = Field(default=None)
    """Seconds without an operation after which the sandbox is stopped (cause ``idle``)."""
    resources: Resources = Field(default_factory=Resources)
    """Resource limits."""
    network: NetworkPolicy = "allow-all"
    """Outbound network policy."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Free-form labels; ``list`` filters on them."""
    owner: str | None = None
    """Who owns the sandbox (a user or agent name)."""
    backend_options: dict[str, dict[str, JsonValue]] = Field(default_factory=dict)
    """Per-backend options, keyed by backend name (``{"local": {"isolation": "gvisor"}}``)."""
    ca_certificates: list[str] = Field(default_factory=list)
    """Extra CA certificates (PEM text) the sandbox trusts, added to its system trust at create
    (see docs/network.md); stored one canonical certificate per item."""

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        return _absolute(v)

    @field_validator("network", mode="before")
    @classmethod
    def _network_kind(cls, v: object) -> object:
        if isinstance(v, str) and v not in ("allow-all", "deny-all"):
            msg = f"must be 'allow-all', 'deny-all' or an allowlist object, got {v!r}"
            raise ValueError(msg)
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 1 <= p <= 65535:
                msg = f"{p} is outside 1..65535"
                raise ValueError(msg)
        return sorted(set(v))

    @field_validator("timeout", "idle_timeout")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            msg = f"must be a positive number of seconds, got {v}"
            raise ValueError(msg)
        return v

    @field_validator("ca_certificates")
    @classmethod
    def _ca_certificates(cls, v: list[str]) -> list[str]:
        return _check_certificates(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _LABEL_KEY.match(k):
                msg = f"{k!r} is not a valid label key (letters, digits, . _ / -)"
                raise ValueError(msg)
        return v

    def setup_steps(self) -> list[Command]:
        """``setup`` as a list of commands."""
        if self.setup is None:
            return []
        return list(self.setup) if isinstance(self.setup, list) else [self.setup]

    def resume_command(self) -> Command | None:
        """What to launch on resume."""
        return self.resume if self.resume is not None else self.start

    def options_for(self, backend: str) -> dict[str, JsonValue]:
        """The ``backend_options`` entry for one backend (empty when absent)."""
        return dict(self.backend_options.get(backend, {}))


class SandboxStatus(enum.StrEnum):
    """Where a sandbox is in its lifecycle (see DESIGN.md)."""

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

    @property
    def transitional(self) -> bool:
        """True while a transition is in flight (another process may be driving it)."""
        return self in _TRANSITIONAL

    @property
    def terminal(self) -> bool:
        """True when nothing more happens to the sandbox without a user asking."""
        return self in (SandboxStatus.DESTROYED, SandboxStatus.FAILED, SandboxStatus.STOPPED)


_TRANSITIONAL = frozenset(
    {
        SandboxStatus.PROVISIONING,
        SandboxStatus.SETTING_UP,
        SandboxStatus.STARTING,
        SandboxStatus.STOPPING,
        SandboxStatus.RESUMING,
        SandboxStatus.DESTROYING,
    }
)


class DeathCertificate(_Model):
    """Why a sandbox stopped, failed or was destroyed: the answer to "why did it die"."""

    cause: str
    """``ttl``, ``idle``, ``oom``, ``destroyed``, ``stopped``, ``backend_error``, ``setup_failed``,
    ``vanished``, ``exited``, ``abandoned``, …"""
    message: str = ""
    """A human-readable explanation (the error, the exit code)."""
    last_output: list[str] = Field(default_factory=list)
    """The last lines of the main process's (or the failing step's) output."""
    at: datetime = Field(default_factory=utcnow)
    """When it happened."""


class PortMapping(_Model):
    """A sandbox port published on the host."""

    port: int
    """Port inside the sandbox."""
    host: str
    """Host address it is published on."""
    host_port: int
    """Port on the host."""
    url: str
    """``http://host:host_port``."""


class SandboxInfo(_Model):
    """The durable record of one sandbox."""

    id: str
    """Stable id, such as ``sb-3f9c2a7d1e04``."""
    backend: str
    """The backend it lives on."""
    status: SandboxStatus
    """Lifecycle status."""
    spec: SandboxSpec
    """What it was created with."""
    tenant: str = "default"
    """The tenant it belongs to."""
    version: int = 0
    """Compare-and-set counter; bumped by every change."""
    created_at: datetime = Field(default_factory=utcnow)
    """Creation time."""
    updated_at: datetime = Field(default_factory=utcnow)
    """Last change to this record."""
    last_active_at: datetime = Field(default_factory=utcnow)
    """Last operation on the sandbox (drives ``idle_timeout``)."""
    expires_at: datetime | None = None
    """When the TTL runs out."""
    backend_ref: str | None = None
    """The backend's own handle for the sandbox."""
    host: str | None = None
    """For backends whose sandboxes live on one host (``local``, ``microvm``): that host."""
    transition_owner: str | None = None
    """Who drives the transition in flight (``host:pid:nonce``), to settle abandoned ones."""
    transition_deadline: datetime | None = None
    """After this, a transition in flight is considered abandoned."""
    error: str | None = None
    """The last error, for ``failed`` sandboxes."""
    death: DeathCertificate | None = None
    """Why it stopped, failed or was destroyed."""
    setup_done: bool = False
    """True once setup has succeeded (a retried resume does not run it again)."""
    ports: list[PortMapping] = Field(default_factory=list)
    """Exposed ports."""
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """Backend and manager bookkeeping."""

    @property
    def labels(self) -> dict[str, str]:
        """The spec's labels."""
        return self.spec.labels

    @property
    def owner(self) -> str | None:
        """The spec's owner."""
        return self.spec.owner


class ExecResult(_Model):
    """What a finished command left behind."""

    exit_code: int
    """Exit status; ``128 + N`` when killed by signal N, ``124`` on timeout."""
    stdout: str = ""
    """Collected standard output (decoded as UTF-8, invalid bytes replaced)."""
    stderr: str = ""
    """Collected standard error."""
    duration_ms: float = 0.0
    """Wall time from start to exit."""
    signal: int | None = None
    """The signal that killed it, if any."""
    timed_out: bool = False
    """True when the timeout killed it."""
    oom_killed: bool = False
    """True when the memory limit killed it."""

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_code == 0


class OutputChunk(_Model):
    """A piece of a command's output, numbered so a reader can resume where it stopped."""

    seq: int
    """Position in the command's output stream, starting at 0."""
    stream: Literal["stdout", "stderr"]
    """Which stream."""
    data: bytes
    """The bytes."""


class FileInfo(_Model):
    """A file or directory inside a sandbox."""

    path: str
    """Absolute path inside the sandbox."""
    name: str
    """Last path component."""
    type: Literal["file", "dir", "symlink", "other"]
    """Kind of entry (symlinks are not followed)."""
    size: int = 0
    """Size in bytes."""
    mode: int = 0
    """Permission bits."""
    mtime: float = 0.0
    """Modification time (seconds since the epoch)."""
    target: str | None = None
    """Where a symlink points."""


class ProcessInfo(_Model):
    """A background process inside a sandbox."""

    id: str
    """Stable handle (unique within the sandbox)."""
    pid: int
    """Process id inside the sandbox."""
    command: list[str]
    """Its argv."""
    name: str | None = None
    """An optional name given at start (``main`` for the main process)."""
    running: bool = True
    """False once it exited."""
    exit_code: int | None = None
    """Exit status once it exited."""
    started_at: float = 0.0
    """Start time (seconds since the epoch)."""


class SnapshotInfo(_Model):
    """A saved state of a sandbox from which new sandboxes can be made."""

    id: str
    """Snapshot id."""
    sandbox_id: str
    """The sandbox it was taken from."""
    backend: str
    """The backend that made it (snapshots do not cross backends)."""
    created_at: datetime = Field(default_factory=utcnow)
    """When it was taken."""
    ref: str
    """The backend's handle for it."""
    size_bytes: int = 0
    """Size on disk, when known."""
    spec: SandboxSpec | None = None
    """The spec of the sandbox it came from."""
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """Backend details (checksum manifest, …)."""


def _describe(e: ValidationError) -> str:
    """One readable line per field; for unions, the error that explains the most."""
    by_field: dict[str, list[tuple[str, str, str]]] = {}
    for err in e.errors():
        # Drop union-branch tags ("str", "NetworkAllowlist", "list[...]") from the location.
        loc = [
            str(x)
            for x in err["loc"]
            if isinstance(x, int) or not (str(x)[:1].isupper() or "[" in str(x) or str(x) in _TYPES)
        ]
        where = ".".join(loc)
        by_field.setdefault(loc[0] if loc else "", []).append(
            (where, err["type"], str(err["msg"]).removeprefix("Value error, "))
        )
    parts = []
    for errors in by_field.values():
        own = [x for x in errors if x[1] == "value_error"] or errors
        for where, _, msg in dict.fromkeys(own):
            parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


_TYPES = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after"})


def parse_model(cls: type[M], data: object) -> M:
    """Validate ``data`` as ``cls``, turning pydantic's error into one clear ``InvalidRequest``."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        msg = f"invalid {cls.__name__}: {_describe(e)}"
        raise InvalidRequest(msg) from None


# -- records of the control plane's housekeeping and policy ------------------------------------


@dataclass
class ReconcileReport:
    """What ``reconcile`` changed."""

    checked: int = 0
    updated: dict[str, str] = field(default_factory=dict)
    """Sandbox id -> what happened (``running -> stopped (oom)``, …)."""
    reaped: list[str] = field(default_factory=list)
    """Backend sandboxes with our mark but no record, destroyed."""
    errors: dict[str, str] = field(default_factory=dict)
    """Backends or sandboxes that could not be checked (or stopped, or destroyed), and why."""
    expired: list[str] = field(default_factory=list)
    """Running sandboxes past their time to live or idle timeout, stopped."""
    discarded: list[str] = field(default_factory=list)
    """Failed creations whose time for inspection ran out, destroyed."""


@dataclass(frozen=True)
class Approval:
    """A HOLD decision and its answer."""

    id: str
    tenant: str
    principal: str
    sandbox_id: str | None
    action: str
    summary: str
    question: str
    status: str
    """``pending``, ``approved``, ``denied`` or ``expired``."""
    hold_seq: int
    created_at: float
    expires_at: float
    decided_by: str | None = None
    decided_at: float | None = None

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data."""
        return dict(self.__dict__.items())


class Outcome(enum.StrEnum):
    """What the gate does with the operation."""

    ALLOW = "ALLOW"
    DENY = "DENY"
    HOLD = "HOLD"
    """Wait for a human (or another agent) to approve or deny; a timeout denies."""


class ReasonCode(enum.StrEnum):
    """Why: a closed set of stable strings that receipts, errors and clients rely on."""

    OK = "OK"
    """Allowed by a permit."""
    POLICY_VIOLATION = "POLICY_VIOLATION"
    """A forbid matched."""
    NO_MATCHING_PERMIT = "NO_MATCHING_PERMIT"
    """Nothing permits it (default deny)."""
    HOLD_REQUIRED = "HOLD_REQUIRED"
    """A permit marked ``@hold`` matched: approval needed."""
    POLICY_ERROR = "POLICY_ERROR"
    """The engine failed to evaluate (an erroring policy, an undefined remote result)."""
    POLICY_ERROR_FAIL_OPEN = "POLICY_ERROR_FAIL_OPEN"
    """The engine failed and the operator chose ``on_error = "allow"``."""
    SCHEMA_VIOLATION = "SCHEMA_VIOLATION"
    """The request does not fit the policy schema (a missing or mistyped attribute)."""
    REMOTE_UNAVAILABLE = "REMOTE_UNAVAILABLE"
    """A remote decision point could not be reached or timed out."""


@final
@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict on one request."""

    outcome: Outcome
    """ALLOW, DENY or HOLD."""
    reason_code: ReasonCode
    """Why (stable)."""
    engine: str
    """The engine that decided (``cedar``, ``builtin``, ``opa``)."""
    policy_hash: str
    """``sha256:<hex>`` of the policy version that decided."""
    matched: tuple[str, ...] = ()
    """The policies that determined the outcome (their ``@id``, else the engine's id)."""
    message: str = ""
    """A sentence for humans."""
    hold_reason: str | None = None
    """For HOLD: what the approver is asked (from ``@hold("...")``)."""
    errors: tuple[str, ...] = ()
    """Evaluation errors, when the reason code is an error (or fail-open)."""
    duration_ns: int = 0
    """Time spent deciding."""

    @property
    def allowed(self) -> bool:
        """True when the operation may run now."""
        return self.outcome is Outcome.ALLOW

    def to_dict(self) -> dict[str, JsonValue]:
        """The decision as JSON data (for receipts, HTTP and MCP)."""
        return {
            "outcome": self.outcome.value,
            "reason_code": self.reason_code.value,
            "engine": self.engine,
            "policy_hash": self.policy_hash,
            "matched": list(self.matched),
            "message": self.message,
            "hold_reason": self.hold_reason,
            "errors": list(self.errors),
            "duration_ns": self.duration_ns,
        }

    def denial(self, receipt_id: str | None = None) -> PolicyDenied:
        """The error a front end raises for this decision (DENY, or a HOLD that timed out)."""
        return PolicyDenied(
            self.message or "denied by policy",
            reason_code=self.reason_code.value,
            receipt_id=receipt_id,
        )


@final
@dataclass(frozen=True, slots=True)
class PolicyTrace:
    """One policy (or rule) and what it did for one unit of a request."""

    policy_id: str
    """Its ``@id`` (or the engine's id)."""
    effect: str
    """``permit`` or ``forbid`` (``hold`` for a builtin hold rule)."""
    satisfied: bool
    """True when its scope and conditions held."""
    determining: bool = False
    """True when it is among the policies that decided the unit."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Its annotations (``@id``, ``@hold``, ``@reason``...)."""
    error: str | None = None
    """The evaluation error it raised, if any."""

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data."""
        return {
            "policy_id": self.policy_id,
            "effect": self.effect,
            "satisfied": self.satisfied,
            "determining": self.determining,
            "annotations": dict(self.annotations),
            "error": self.error,
        }


@final
@dataclass(frozen=True, slots=True)
class UnitTrace:
    """One evaluated unit (a whole request, or one command of a command action)."""

    label: str
    """``request``, or ``command 2: rm``."""
    context: Mapping[str, JsonValue]
    """The context the engine saw for this unit."""
    outcome: Outcome
    """The unit's own verdict."""
    policies: tuple[PolicyTrace, ...] = ()
    """Every policy considered, with what it did."""
    errors: tuple[str, ...] = ()
    """Errors raised while evaluating the unit."""

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data."""
        return {
            "label": self.label,
            "context": dict(self.context),
            "outcome": self.outcome.value,
            "policies": [p.to_dict() for p in self.policies],
            "errors": list(self.errors),
        }


@final
@dataclass(frozen=True, slots=True)
class Explanation:
    """A dry run: the decision, and per unit which policies were considered and matched."""

    decision: Decision
    """What :meth:`PolicyEngine.decide` would return."""
    units: tuple[UnitTrace, ...] = ()
    """What each unit saw and which policies matched it."""
    notes: tuple[str, ...] = ()
    """Anything else worth saying (how HOLD was derived, what a remote returned)."""

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data (``sandlot policy explain --json``)."""
        return {
            "decision": self.decision.to_dict(),
            "units": [u.to_dict() for u in self.units],
            "notes": list(self.notes),
        }

    def render(self) -> str:
        """A human-readable report."""
        d = self.decision
        lines = [f"{d.outcome.value} ({d.reason_code.value}) by {d.engine} {d.policy_hash[:19]}"]
        if d.message:
            lines.append(f"  {d.message}")
        for unit in self.units:
            lines.append(f"- {unit.label}: {unit.outcome.value}")
            for p in unit.policies:
                mark = "*" if p.determining else ("+" if p.satisfied else " ")
                state = "error" if p.error else ("matched" if p.satisfied else "not matched")
                lines.append(f"    {mark} {p.effect:<6} {p.policy_id}: {state}")
                if p.error:
                    lines.append(f"        {p.error}")
            lines.extend(f"    error: {e}" for e in unit.errors)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)
