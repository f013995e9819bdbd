"""What every part of the ``local`` backend shares: its state directory and the records in it.

:class:`Meta` is the record of one sandbox (``<state_dir>/<sandbox_id>/meta.json``).
:class:`LocalState` is the base of the parts :class:`~.backend.LocalBackend` is composed of
(:mod:`.lifecycle`, :mod:`.boot`, :mod:`.bundle`, :mod:`.filesystem`, :mod:`.strict`,
:mod:`.teardown`, :mod:`.snapshots`, :mod:`.reset`, :mod:`.verify`, :mod:`.pool`,
:mod:`.network`): it declares, typed, the attributes ``LocalBackend.__init__`` sets and the
methods one part calls of another, and implements the few every part uses (paths, locks,
reading a record). This module must not import the other parts, the store, the Manager or
front ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from sandlot.backends.local import layers, rootless
from sandlot.backends.local.execgate import ExecCall
from sandlot.backends.local.rootfs import Layer, RootfsCache, Storage
from sandlot.backends.local.runtime import become_subreaper
from sandlot.config import cache_dir
from sandlot.errors import BackendError, NotFound
from sandlot.models import JsonValue, SandboxSpec

if TYPE_CHECKING:
    from sandlot.backends.base import Capabilities, SnapshotRef
    from sandlot.backends.local.execgate import ExecGate
    from sandlot.backends.local.ids import UidRanges
    from sandlot.backends.local.mounts import UsernsHolder
    from sandlot.backends.local.rootless import IdMap
    from sandlot.backends.local.runtime import Runtime
    from sandlot.channel.base import Channel
    from sandlot.network.service import SandboxNetwork, SandboxNetworks

ExecDecider = Callable[[str, ExecCall], Coroutine[Any, Any, bool]]
"""Decides a program started inside a strict sandbox: ``(sandbox_id, call) -> allowed``. Awaited
on the event loop the sandbox was booted from, while the calling thread waits in the kernel."""


def is_strict(spec: SandboxSpec) -> bool:
    """Whether ``spec`` asks for strict enforcement (every program decided, :mod:`.strict`)."""
    return spec.options_for("local").get("enforcement") == "strict"


ISOLATIONS: Mapping[str, str] = {"namespaces": "crun", "gvisor": "runsc"}
"""``backend_options.local.isolation`` values and the runtime each one runs on."""


VALID_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""Sandbox and snapshot ids: each names a directory and a container."""
POOL_PREFIX = "slp-"
"""The name of a pooled sandbox, its container and, once claimed and lost, its ref."""


@dataclass
class Meta:
    """What the backend records about one sandbox (``meta.json``)."""

    sandbox_id: str
    container: str
    runtime: str
    uid_base: int | None
    layers: list[dict[str, JsonValue]]
    spec: dict[str, JsonValue]
    default_root: bool = True
    image_env: list[str] = field(default_factory=list)
    disk_mb: int | None = None
    net_key: str | None = None
    init: list[int] | None = None
    host_pids: list[list[int]] = field(default_factory=list)
    stop_reason: str | None = None
    stop_detail: str = ""
    booted: bool = False
    created_at: float = field(default_factory=time.time)
    baseline: dict[str, JsonValue] | None = None
    """The state right after create: its lower layers and the digest of its upper layer."""
    pristine: dict[str, JsonValue] | None = None
    """What the last verified reset left: its target and the digest of the upper layer."""
    idmap: dict[str, JsonValue] | None = None
    """Rootless: the caller's id mapping the sandbox's files were made under."""
    slirp: list[int] | None = None
    """Rootless ``allow-all``: the slirp4netns process (pid, start time)."""

    @property
    def isolation(self) -> str:
        return "gvisor" if self.runtime == "runsc" else "namespaces"

    def spec_model(self) -> SandboxSpec:
        return SandboxSpec.model_validate(self.spec)

    @classmethod
    def load(cls, path: Path) -> Meta:
        doc = json.loads(path.read_text())
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in known})

    def save(self, path: Path) -> None:
        # Every field is JSON data already; asdict's deep copy was most of a save's cost.
        raw = json.dumps({k: getattr(self, k) for k in _META_FIELDS}, sort_keys=True).encode()
        tmp = f"{path.parent}/.meta.{os.getpid()}.{secrets.token_hex(3)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, raw)
        finally:
            os.close(fd)
        Path(tmp).replace(path)


_META_FIELDS = tuple(Meta.__dataclass_fields__)


class LocalState:
    """The base of :class:`~.backend.LocalBackend`'s parts: what they share and call of one
    another.

    The attributes are set by ``LocalBackend.__init__``; the methods declared under
    ``TYPE_CHECKING`` are implemented by one part and called by others, declared here so
    that each part is checked against the same signature.
    """

    state_dir: Path
    exec_decider: ExecDecider | None
    _idmap: IdMap | None
    _idmap_note: str
    _run_problem: str
    _networks: SandboxNetworks | None
    _pool_sizes: dict[str, int]
    _cache_path: Path | None
    _rootfs: RootfsCache | None
    _uids: UidRanges
    _agent_path: Path
    _ready_timeout: float
    _stop_timeout: float
    _tag: str
    _run_root: Path
    _agent_copy: Path
    _agent_pyc: Path | None
    _agent_pyc_failed: bool
    _runtimes: dict[str, Runtime]
    _userns: UsernsHolder
    _ready: dict[str, Channel]
    """Agent connections made by a boot, handed to the first :meth:`channel` call."""
    _execgates: dict[str, ExecGate]
    _refill: anyio.abc.TaskGroup | None
    _refilling: set[str]
    _fill_lock: anyio.Lock
    _subreaper: bool
    _usable: set[str]
    _retiring: set[str]

    if TYPE_CHECKING:
        # backend.py
        def capabilities(self) -> Capabilities: ...
        def unavailable(self) -> str | None: ...

        # boot.py
        async def _boot(
            self,
            d: Path,
            meta: Meta,
            spec: SandboxSpec,
            *,
            baseline: bool = False,
            keep_network: bool = False,
        ) -> None: ...
        async def _connect(self, d: Path, meta: Meta, timeout: float) -> Channel: ...
        async def _wait_ready(self, d: Path, meta: Meta) -> None: ...

        # bundle.py
        def _bundle(
            self, d: Path, meta: Meta, spec: SandboxSpec, net: SandboxNetwork | None
        ) -> object: ...

        # filesystem.py
        def _describe_upper(self, d: Path, meta: Meta) -> layers.UpperManifest: ...
        def _ensure_workdir(self, rootfs: Path, meta: Meta) -> None: ...
        def _lowers(self, spec: SandboxSpec, certificates: tuple[str, ...]) -> list[Layer]: ...
        def _make_layer(self, d: Path, meta: Meta) -> None: ...
        def _mount(self, d: Path, meta: Meta) -> None: ...
        def _provision(
            self,
            d: Path,
            sandbox_id: str,
            container: str,
            runtime: str,
            spec: SandboxSpec,
            lowers: list[Layer],
        ) -> Meta: ...
        def _rootless_wrapper(self, d: Path, meta: Meta) -> list[str]: ...

        # lifecycle.py
        async def _adopt(self, d: Path, spec: SandboxSpec) -> None: ...
        def _validate(self, sandbox_id: str, spec: SandboxSpec) -> str: ...
        async def destroy(self, ref: str) -> None: ...

        # network.py
        async def _start_slirp(self, d: Path, meta: Meta) -> None: ...

        # pool.py
        def _apply_resources(self, meta: Meta, spec: SandboxSpec) -> None: ...
        async def _claim(
            self, sandbox_id: str, spec: SandboxSpec, runtime: str, lowers: list[Layer]
        ) -> bool: ...
        def _pool_entry(self, container: str) -> bool: ...
        def _poolable(self, spec: SandboxSpec) -> str | None: ...
        def pooled(self, isolation: str = "namespaces") -> list[str]: ...

        # reset.py
        async def _empty_trash(self) -> None: ...

        # snapshots.py
        def _gc_snapshots(self) -> None: ...
        def _reset_layer(self, d: Path, meta: Meta) -> None: ...
        def _snapshot_dir(self, snapshot_id: str) -> Path: ...
        def _snapshot_layers(
            self, snapshot: SnapshotRef
        ) -> tuple[list[Layer], layers.Manifest]: ...
        def _verify_snapshot(self, sdir: Path, digest: str | None = None) -> layers.Manifest: ...

        # strict.py
        def _close_execgate(self, sandbox_id: str) -> None: ...
        def _exec_listener(self, meta: Meta) -> Path: ...
        def _open_execgate(self, meta: Meta, d: Path) -> None: ...

        # teardown.py
        async def _destroy_dir(self, d: Path) -> None: ...
        async def _halt(self, d: Path, meta: Meta, *, grace: float = 0.0) -> None: ...
        def _note_death(self, meta: Meta) -> None: ...
        def _reap_all(self, meta: Meta, timeout: float) -> None: ...
        def _wipe_dir(self, d: Path) -> None: ...

        # verify.py
        def _check_lowers(self, lowers: list[dict[str, JsonValue]]) -> dict[str, JsonValue]: ...
        async def _check_running(
            self, d: Path, meta: Meta, expected_upper: str | None
        ) -> tuple[list[JsonValue], str]: ...

    def _dir(self, sandbox_id: str) -> Path:
        return self.state_dir / sandbox_id

    def _mnt(self, container: str) -> Path:
        """Where a sandbox's root is mounted (and gVisor's socket directory lives)."""
        return self._run_root / "mnt" / container

    def _cgroup_rel(self, container: str) -> str:
        return f"/sandlot/{self._tag}/{container}"

    def _oom_files(self, container: str) -> list[Path]:
        rel = self._cgroup_rel(container).lstrip("/")
        return [
            Path("/sys/fs/cgroup/memory") / rel / "memory.oom_control",
            Path("/sys/fs/cgroup") / rel / "memory.events",
        ]

    def _cache(self) -> RootfsCache:
        if self._rootfs is None:
            storage = None
            if self._idmap is not None:
                wrap = (*rootless.helper_argv(self._idmap), "--")
                storage = Storage(self._idmap.key, wrap, self._idmap.full)
            self._rootfs = RootfsCache(self._cache_path or cache_dir(), storage=storage)
        return self._rootfs

    @contextlib.contextmanager
    def _locked(self, sandbox_id: str) -> Iterator[None]:
        fd = os.open(
            self.state_dir / ".locks" / sandbox_id, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.asynccontextmanager
    async def _alock(self, sandbox_id: str) -> AsyncIterator[None]:
        path = self.state_dir / ".locks" / sandbox_id
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # Non-blocking attempts so a waiting task never parks a worker thread.
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await anyio.sleep(0.005)
            yield
        finally:
            os.close(fd)

    def _ensure_subreaper(self) -> None:
        if not self._subreaper:
            become_subreaper()
            self._subreaper = True

    def _meta(self, ref: str) -> tuple[Path, Meta]:
        if not VALID_ID.match(ref):
            msg = f"no local sandbox {ref!r}"
            raise NotFound(msg)
        d = self._dir(ref)
        try:
            return d, Meta.load(d / "meta.json")
        except FileNotFoundError:
            msg = f"no local sandbox {ref!r}"
            raise NotFound(msg) from None
        except (OSError, ValueError, TypeError) as e:
            msg = f"local sandbox {ref!r} has unreadable state: {e}"
            raise BackendError(msg) from e
