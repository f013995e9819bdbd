"""The ``local`` backend: sandboxes on this host, isolated by an OCI runtime, with no daemon.

Each sandbox is one directory ``<state_dir>/<sandbox_id>/`` holding what it keeps on the host
(``meta.json``, the bundle's ``config.json``, the writable layer, the agent socket, logs), plus,
named after its container, a container in the runtime's state root, its root mount point and
gVisor socket directory (under ``/run/sandlot/<tag>/``: paths the runtime opens from inside the
sandbox's user namespace must be traversable by its unprivileged uid, which a home under
``/root`` is not) and its cgroups (``sandlot/<tag>/<container>``). The
in-sandbox agent (:mod:`sandlot.channel.agent`) is the container's init; for ``crun`` it serves
a listening socket the backend made and passed as fd 3, so the socket never appears inside.

What is enforced, and where (each has a test under ``tests/security`` or
``tests/integration/local``): new pid, mount, net, ipc, uts, cgroup and user namespaces, with
container root mapped to a private unprivileged host uid range (:mod:`.ids`); a root filesystem
of read-only lower layers seen through id-mapped mounts plus a persistent overlay upper
directory (:mod:`.mounts`, :mod:`.rootfs`); cgroup limits for memory (with swap), pids (a
default when the spec sets none) and CPU; an optional size-limited writable layer (a
loop-mounted ext4 image) for ``disk_mb``; no new privileges, a reduced capability set, a seccomp
deny list, masked and read-only ``/proc`` and ``/sys`` paths (:mod:`.oci`, :mod:`.seccomp`); and
an empty network namespace (loopback only) unless a network service is plugged in.

Run by a normal user, the backend is *rootless* (:mod:`.rootless`): root inside a sandbox is
the caller (ids 1..65535 its subordinate range when it has one), the root overlay is mounted by
:mod:`.userns_helper` in a user and mount namespace from which crun runs (so nothing is mounted
on the host), files the sandbox made are read, copied and removed from inside such a namespace,
processes are found from the init (no cgroup), a snapshot stops them with ``SIGSTOP`` instead of
the freezer, and ``allow-all`` is slirp4netns behind a fence in the sandbox's own network
namespace. It cannot enforce resource limits here (no delegated cgroups), so
``capabilities().limits`` is empty and such specs are refused; nor gVisor, allowlists or ports.

``reset`` is verified from the host, never from inside: every process ends, the writable layer
is swapped for an empty one over the target's lower layers (for the baseline, the layers the
sandbox was created on; for a snapshot, its layer re-hashed against its manifest first), the
sandbox boots, and then the checks run: the upper layer's digest against the one recorded right
after create (for a snapshot: nothing but the runtime's own mount points), the processes in the
sandbox's cgroup (the agent alone) and crun's record (running, with that agent as init).
:meth:`LocalBackend.verify` runs the same checks later, without changing anything.

A warm pool (``pool={"namespaces": N}``) keeps booted default-root sandboxes under
``<state_dir>/.pool/<isolation>/``; ``create`` claims one by an atomic ``renameat2(NOREPLACE)``
of its directory, so two processes never claim the same one.

This module composes :class:`LocalBackend` from its parts, one module per concern (the package
docstring lists them: :mod:`.lifecycle`, :mod:`.boot`, :mod:`.reset`, :mod:`.pool`, …) over the
shared base :class:`.state.LocalState`, and keeps what is the backend's own: its construction,
``capabilities``, availability and ``aclose``. It must not import the store, the Manager or
front ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, final

import anyio
import anyio.to_thread

from sandlot.backends.base import Capabilities
from sandlot.backends.local import rootless
from sandlot.backends.local.boot import Boot
from sandlot.backends.local.bundle import Bundle
from sandlot.backends.local.execgate import ExecGate
from sandlot.backends.local.filesystem import Filesystem
from sandlot.backends.local.ids import UidRanges
from sandlot.backends.local.lifecycle import Lifecycle
from sandlot.backends.local.mounts import UsernsHolder
from sandlot.backends.local.network import Network
from sandlot.backends.local.pool import Pool
from sandlot.backends.local.reset import Reset
from sandlot.backends.local.rootfs import RootfsCache
from sandlot.backends.local.rootless import IdMap
from sandlot.backends.local.runtime import Crun, Runsc, Runtime
from sandlot.backends.local.snapshots import Snapshots
from sandlot.backends.local.state import ISOLATIONS, ExecDecider, LocalState
from sandlot.backends.local.strict import StrictEnforcement
from sandlot.backends.local.teardown import Teardown
from sandlot.backends.local.verify import Verification
from sandlot.errors import BackendUnavailable, InvalidRequest

if TYPE_CHECKING:
    from sandlot.channel.base import Channel
    from sandlot.network.service import SandboxNetworks

__all__ = ["ISOLATIONS", "ExecDecider", "LocalBackend"]


@final
class LocalBackend(
    Lifecycle,
    Boot,
    Bundle,
    Filesystem,
    StrictEnforcement,
    Network,
    Pool,
    Reset,
    Verification,
    Snapshots,
    Teardown,
    LocalState,
):
    """Sandboxes on this host under crun (namespaces) or runsc (gVisor).

    Args:
        state_dir: this backend's directory (``sandlot.config.backend_dir(home, "local")``).
        runtime: the runtime for ``isolation="namespaces"``; only ``"crun"`` is supported.
        networks: the network service that prepares per-sandbox network namespaces (egress
            policies, ports); without it every sandbox gets an empty network namespace
            (loopback only) and only ``network="deny-all"`` is accepted.
        pool: warm-pool sizes per isolation (``{"namespaces": 4}``); pooled sandboxes have
            the default root and no image, and are claimed by ``create``.
        cache: the root filesystem cache (default ``sandlot.config.cache_dir()``).
        uid_registry: the host-wide directory recording uid ranges.
        agent_path: the agent file bound into every sandbox.
        ready_timeout: seconds to wait for a booted sandbox's agent to answer.
        stop_timeout: seconds between SIGTERM and SIGKILL on ``stop``.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        runtime: str = "crun",
        networks: SandboxNetworks | None = None,
        pool: Mapping[str, int] | None = None,
        cache: Path | None = None,
        uid_registry: Path | None = None,
        agent_path: Path | None = None,
        ready_timeout: float = 30.0,
        stop_timeout: float = 2.0,
    ) -> None:
        if runtime != "crun":
            msg = f"runtime {runtime!r} is not supported by the local backend (use 'crun')"
            raise InvalidRequest(msg)
        for key in pool or {}:
            if key not in ISOLATIONS:
                msg = f"pool isolation {key!r} is not one of {', '.join(ISOLATIONS)}"
                raise InvalidRequest(msg)
        self.state_dir = Path(state_dir).absolute()
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        root = os.geteuid() == 0
        self._idmap: IdMap | None = None
        self._idmap_note = ""
        self._run_problem = ""
        if not root:
            self._idmap, self._idmap_note = rootless.detect()
            # The network service needs root (named namespaces, veths, nftables); a rootless
            # sandbox gets its outbound network from slirp4netns instead.
            networks = None
        self._networks = networks
        self._pool_sizes = {k: max(0, int(v)) for k, v in (pool or {}).items()}
        self._cache_path = cache
        self._rootfs: RootfsCache | None = None
        if uid_registry is None:
            uid_registry = (
                Path("/var/lib/sandlot/uid-ranges") if root else self.state_dir / ".uid-ranges"
            )
        self._uids = UidRanges(uid_registry)
        if agent_path is None:
            from sandlot.channel.protocol import AGENT_PATH

            agent_path = Path(AGENT_PATH)
        self._agent_path = agent_path.resolve()
        self._ready_timeout = ready_timeout
        self._stop_timeout = stop_timeout
        self._tag = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
        # Paths the runtime opens from inside the sandbox's user namespace (the root mount
        # point, gVisor's socket directory, the agent file) must be traversable by an
        # unprivileged uid; a home under /root is not, so they live under /run/sandlot.
        if root:
            run_base = Path("/run/sandlot")
        else:
            try:
                run_base = rootless.runtime_base()
            except BackendUnavailable as e:
                # Kept constructible for ``sandlot doctor``; unavailable() says why.
                self._run_problem = e.message
                run_base = self.state_dir / ".run"
        run_root = run_base / self._tag
        self._run_root = run_root
        for path in (run_root.parent, run_root, run_root / "mnt"):
            path.mkdir(parents=True, exist_ok=True, mode=0o711)
            path.chmod(0o711)
        self._agent_copy = run_root / f"agent-{_file_digest(agent_path)[:16]}.py"
        self._agent_pyc: Path | None = None
        self._agent_pyc_failed = False
        for old in run_root.glob("agent-*.py*"):
            # Running sandboxes keep their bind-mounted copy (the inode), not the name.
            if old.stem != self._agent_copy.stem:
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()
        if not self._agent_copy.exists():
            tmp = run_root / f".agent.{os.getpid()}.{secrets.token_hex(3)}"
            shutil.copyfile(agent_path, tmp)
            tmp.chmod(0o644)
            tmp.replace(self._agent_copy)
        if self._idmap is not None:
            rootless.compile_helper(run_root)
        self._runtimes: dict[str, Runtime] = {
            "crun": Crun(run_root / "crun", rootless=not root),
            "runsc": Runsc(run_root / "runsc"),
        }
        self._userns = UsernsHolder()
        self._ready: dict[str, Channel] = {}
        self._execgates: dict[str, ExecGate] = {}
        self.exec_decider: ExecDecider | None = None
        """Strict sandboxes: who decides each program (the Manager sets its gate here); with
        none, every program but the sandbox's own agent is denied."""
        self._refill: anyio.abc.TaskGroup | None = None
        self._refilling: set[str] = set()
        self._fill_lock = anyio.Lock()
        self._subreaper = False
        self._usable: set[str] = set()
        self._retiring: set[str] = set()
        for sub in (".locks", ".pool", ".snapshots", ".trash"):
            (self.state_dir / sub).mkdir(exist_ok=True, mode=0o700)

    @property
    def name(self) -> str:
        """``local``."""
        return "local"

    @property
    def rootless(self) -> bool:
        """True when sandboxes run without root (as this user, see :mod:`.rootless`)."""
        return self._idmap is not None

    @property
    def id_map(self) -> IdMap | None:
        """Rootless: how sandbox ids map to this user's ids (None when running as root)."""
        return self._idmap

    def capabilities(self) -> Capabilities:
        """What this backend enforces (network kinds depend on the network service).

        The network kinds are also those :meth:`update_network` switches a running crun
        sandbox between, either way. gVisor sandboxes are ``deny-all`` only, at ``create`` and
        at run time alike (``Capabilities`` has no per-isolation field; the refusal says why).

        Without root: no resource limit (no delegated cgroups), ``deny-all`` always and
        ``allow-all`` when slirp4netns can run (no allowlist: see ``docs/network.md``), no
        ports; snapshots, forks and resets work.
        """
        if self._idmap is not None:
            kinds = {"deny-all"}
            slirp = rootless.slirp_problem()
            if slirp is None:
                kinds.add("allow-all")
            no_limits = (
                "rootless sandboxes have no cgroups of their own; run sandlot as root for limits"
            )
            missing = dict.fromkeys(("vcpus", "memory_mb", "pids", "disk_mb"), no_limits)
            missing["allowlist"] = "rootless sandboxes have no egress proxy; run sandlot as root"
            if slirp is not None:
                missing["allow-all"] = f"{slirp}; or ask for network 'deny-all'"
            return Capabilities(
                network=frozenset(kinds),
                limits=frozenset(),
                missing=missing,
                pause_memory=False,
                snapshot=True,
                fork=True,
                ports=False,
                images=True,
                reset=True,
                isolation="namespaces",
                host_local=True,
            )
        network = {"deny-all"}
        if self._networks is not None:
            network |= set(self._networks.capabilities())
        return Capabilities(
            network=frozenset(network),
            limits=frozenset({"vcpus", "memory_mb", "pids", "disk_mb"}),
            pause_memory=False,
            snapshot=True,
            fork=True,
            ports=self._networks is not None and bool(self._networks.capabilities()),
            images=True,
            reset=True,
            isolation="namespaces",
            host_local=True,
        )

    @property
    def run_dir(self) -> Path:
        """Host directory of runtime state, root mount points and the agent copy
        (``/run/sandlot/<tag>``, the tag derived from the state directory)."""
        return self._run_root

    @property
    def rootfs_cache_dir(self) -> Path:
        """Where image layers and the default skeleton are kept (``<cache>/local``)."""
        return self._cache().root

    def uid_ranges(self) -> dict[int, str]:
        """Host uid ranges recorded for this backend's sandboxes: ``{first uid: container}``."""
        return self._uids.owned_by(self.state_dir)

    def unavailable(self) -> str | None:
        """None when sandboxes can run here, else what is missing (for ``sandlot doctor``)."""
        if self._idmap is not None:
            return self._rootless_unavailable()
        missing = self._runtimes["crun"].available()
        if missing:
            return missing
        if shutil.which("unshare") is None:
            return "unshare is missing (Debian package util-linux)"
        return None

    def _rootless_unavailable(self) -> str | None:
        if self._run_problem:
            return self._run_problem
        missing = self._runtimes["crun"].available()
        if missing:
            return missing
        try:
            limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
        except (OSError, ValueError):
            limit = 0
        if limit <= 0:
            return (
                "rootless sandboxes need user namespaces (as root: "
                "sysctl -w user.max_user_namespaces=65536)"
            )
        with contextlib.suppress(OSError, ValueError):
            if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0":
                return (
                    "unprivileged user namespaces are disabled (as root: "
                    "sysctl -w kernel.unprivileged_userns_clone=1)"
                )
        return None

    async def aclose(self) -> None:
        """Close cached connections and namespace fds (sandboxes keep running).

        When no sandbox, pooled one or runtime state is left, the host directory under
        ``/run/sandlot`` goes too.
        """
        ready, self._ready = list(self._ready.values()), {}
        for ch in ready:
            with contextlib.suppress(Exception):
                await ch.close()
        # Strict sandboxes keep running, but with nobody to decide, their programs fail to
        # start (ENOSYS) until they are started again: closed, never open.
        for sandbox_id in list(self._execgates):
            await anyio.to_thread.run_sync(self._close_execgate, sandbox_id)
        await self._empty_trash()
        self._userns.close()
        for rt in self._runtimes.values():
            rt.close()
        await anyio.to_thread.run_sync(self._remove_run_dir_if_unused)

    def _remove_run_dir_if_unused(self) -> None:
        run = self._run_root
        busy = any(
            d.is_dir() and any(d.iterdir()) for d in (run / "crun", run / "runsc", run / "mnt")
        )
        if busy or any(p.is_dir() for p in (self.state_dir / ".pool").glob("*/*")):
            return
        if any((p / "meta.json").is_file() for p in self.state_dir.iterdir()):
            return
        shutil.rmtree(run, ignore_errors=True)
        self._remove_tag_cgroups()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
