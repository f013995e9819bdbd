"""Sandbox networks for a backend: prepare, update, expose ports, tear down, supervise the daemon.

This module owns the per-sandbox network state (``<state_dir>/sandboxes/<id>.json``), the
address allocation (under a host-wide lock, checked against the kernel so two sandlot homes on
one host never collide), and the supervision of the egress daemon
(:class:`~sandlot.network.netd.NetDaemon`, one small detached process per state directory that
outlives the CLI). A backend calls :class:`SandboxNetworks`; it never touches ``ip``, ``nft`` or
the daemon itself. Must not import backends, the store or front ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, final

import anyio.to_thread

from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    InvalidRequest,
    NotFound,
    NotSupported,
)
from sandlot.models import JsonValue, NetworkAllowlist, NetworkPolicy, PortMapping
from sandlot.network import netns
from sandlot.network.policy import EgressEvent, policy_to_json, suggest

__all__ = ["SandboxNetwork", "SandboxNetworks", "proxy_env"]

_GLOBAL_LOCK = Path("/run/lock/sandlot-network.lock")

# The daemon is ``python -m sandlot.network.netd`` minus the package ``__init__`` files: they
# import the SDK, the models and SQLAlchemy (a second and ~20 MiB the daemon never uses). The
# packages are registered as bare namespaces, so only the stdlib-only proxy, dns and policy
# modules load.
_LEAN_BOOT = f"""
import sys, types
for name, path in (("sandlot", {str(Path(__file__).parent.parent)!r}),
                   ("sandlot.network", {str(Path(__file__).parent)!r})):
    pkg = types.ModuleType(name)
    pkg.__path__ = [path]
    sys.modules[name] = pkg
from sandlot.network.netd import main
sys.exit(main(sys.argv[1:]))
"""


def proxy_env(proxy_url: str) -> dict[str, str]:
    """``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/``NO_PROXY`` in both cases, for inside."""
    no_proxy = "localhost,127.0.0.1,::1"
    env: dict[str, str] = {}
    for name, value in (
        ("HTTP_PROXY", proxy_url),
        ("HTTPS_PROXY", proxy_url),
        ("ALL_PROXY", proxy_url),
        ("NO_PROXY", no_proxy),
    ):
        env[name] = value
        env[name.lower()] = value
    return env


@dataclass(frozen=True)
class SandboxNetwork:
    """What a backend needs to know about one sandbox's network."""

    sandbox_id: str
    """The sandbox."""
    kind: Literal["allow-all", "deny-all", "allowlist"]
    """The policy kind in force."""
    netns: str
    """The namespace name (``ip netns``)."""
    netns_path: str
    """The namespace file the OCI config joins (``linux.namespaces[type=network].path``)."""
    host_address: str | None
    """Host side of the veth (None for deny-all)."""
    sandbox_address: str | None
    """Sandbox side of the veth, on ``eth0`` (None for deny-all)."""
    proxy_url: str | None
    """``http://HOST:PORT`` of the egress proxy (allowlist only)."""
    proxy_socket: str | None = None
    """The unix socket the egress proxy serves (a sandbox prepared with
    :meth:`SandboxNetworks.prepare_unix`; it has no namespace, veth or ``proxy_url``: the
    backend knows the address its sandbox reaches that socket by)."""

    def env(self) -> dict[str, str]:
        """Environment to merge into every command started inside (empty unless allowlist)."""
        return proxy_env(self.proxy_url) if self.proxy_url else {}


@final
class SandboxNetworks:
    """Network namespaces, egress proxies and published ports of one backend's sandboxes.

    All methods are safe to call from several processes at once (a host-wide lock serializes
    them) and idempotent: ``prepare`` after a crash or a host reboot rebuilds what is missing.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        pool: str | None = None,
        nameserver: str | None = None,
        proxy_port: int = 3128,
        python: str | None = None,
    ) -> None:
        """Args:
        state_dir: where this backend keeps network state (e.g. ``backends/local/network``).
        pool: the IPv4 range carved into /30s (``$SANDLOT_NETWORK_POOL``, default
            ``10.213.0.0/16``); pick one that no host route uses.
        nameserver: ``IP[:PORT]`` the proxy resolves with (``$SANDLOT_NETWORK_NAMESERVER``;
            default: the host's resolver).
        proxy_port: the port each proxy listens on, on its sandbox's own host-side address.
        python: interpreter that runs the daemon (default: this one).
        """
        self.state_dir = Path(state_dir)
        self.pool = netns.configured_pool(pool)
        self.nameserver = netns.configured_nameserver(nameserver)
        self.proxy_port = proxy_port
        self.python = python or sys.executable
        (self.state_dir / "sandboxes").mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)
        # sandbox id -> (state file, its identity when read, the proxy environment it gave)
        self._env_cache: dict[str, tuple[str, tuple[int, int, int, int], dict[str, str]]] = {}

    # ----------------------------------------------------------------- capabilities

    def capabilities(self) -> frozenset[str]:
        """Policy kinds this host can enforce: all three as root with ``ip`` and ``nft``."""
        if os.geteuid() != 0 or netns.tools_missing():
            return frozenset()
        return frozenset({"allow-all", "deny-all", "allowlist"})

    def _require(self) -> None:
        if os.geteuid() != 0:
            msg = "sandbox networks need root (rootless: see docs/network.md)"
            raise BackendUnavailable(msg)
        missing = netns.tools_missing()
        if missing:
            msg = f"missing {', '.join(missing)} (Debian packages iproute2, nftables)"
            raise BackendUnavailable(msg)

    # ----------------------------------------------------------------- public API

    async def prepare(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxNetwork:
        """Create (or repair) the sandbox's namespace for ``policy``; call before the runtime
        starts the sandbox, and again on every resume."""
        return await anyio.to_thread.run_sync(self.prepare_sync, sandbox_id, policy)

    async def prepare_unix(
        self, sandbox_id: str, policy: NetworkPolicy, socket_path: Path
    ) -> SandboxNetwork:
        """Serve the sandbox's egress proxy on a unix socket instead of a veth.

        For a sandbox with no network namespace of its own, such as a microVM whose user-mode
        network forwards one guest address to ``socket_path`` and drops everything else. The
        proxy decides, logs and follows :meth:`update_policy` exactly as on a veth; ``policy``
        may be any kind (``deny-all`` refuses every connection, ``allow-all`` lets through
        everything that is not protected). Needs neither root nor ``ip``/``nft``; the socket
        is mode 0600 and served to this user only. Idempotent (call again after a restart).
        """
        return await anyio.to_thread.run_sync(
            self.prepare_unix_sync, sandbox_id, policy, socket_path
        )

    async def update_policy(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxNetwork:
        """Change the policy of a prepared sandbox; new connections follow it at once.

        Raises:
            NotFound: the sandbox was never prepared.
        """
        st = self._load(sandbox_id)
        if st is None:
            msg = f"no network for sandbox {sandbox_id}"
            raise NotFound(msg)
        unix = _unix_socket(st)
        if unix is not None:
            return await anyio.to_thread.run_sync(
                self.prepare_unix_sync, sandbox_id, policy, Path(unix)
            )
        return await anyio.to_thread.run_sync(self.prepare_sync, sandbox_id, policy)

    async def teardown(self, sandbox_id: str, *, keep_log: bool = False) -> None:
        """Remove the namespace, veth, nftables table, proxy and port forwards (missing parts
        are fine); stop the daemon when no sandbox needs it."""
        await anyio.to_thread.run_sync(self.teardown_sync, sandbox_id, keep_log)

    async def expose_port(self, sandbox_id: str, port: int, host: str = "127.0.0.1") -> PortMapping:
        """Publish ``port`` of the sandbox's loopback on ``host`` (the same host port again if it
        is free after a restart, else a new one)."""
        return await anyio.to_thread.run_sync(self.expose_port_sync, sandbox_id, port, host)

    async def unexpose_port(self, sandbox_id: str, port: int) -> None:
        """Stop publishing a port."""
        await anyio.to_thread.run_sync(self.unexpose_port_sync, sandbox_id, port)

    async def list_ports(self, sandbox_id: str) -> list[PortMapping]:
        """Published ports as they are served now (restarting the daemon if it died)."""
        return await anyio.to_thread.run_sync(self.list_ports_sync, sandbox_id)

    def get(self, sandbox_id: str) -> SandboxNetwork:
        """The recorded network of a sandbox.

        Raises:
            NotFound: the sandbox was never prepared.
        """
        st = self._load(sandbox_id)
        if st is None:
            msg = f"no network for sandbox {sandbox_id}"
            raise NotFound(msg)
        return self._view(sandbox_id, st)

    def env(self, sandbox_id: str) -> dict[str, str]:
        """Proxy environment for commands inside (empty for allow-all and deny-all).

        Backends ask on every command they start, so that a policy changed at run time (by
        any process) reaches the next command: the state is read again only when its file
        changed.

        Raises:
            NotFound: the sandbox was never prepared.
        """
        cached = self._env_cache.get(sandbox_id)
        # This runs on every exec: the path is a string made once, and os.stat is half the
        # cost of Path.stat.
        path = cached[0] if cached is not None else str(self._state_path(sandbox_id))
        try:
            st = os.stat(path)  # noqa: PTH116
        except FileNotFoundError:
            msg = f"no network for sandbox {sandbox_id}"
            raise NotFound(msg) from None
        # Every save is a rename onto the path, so a change is a new inode (and ctime).
        key = (st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size)
        if cached is not None and cached[1] == key:
            return dict(cached[2])
        env = self.get(sandbox_id).env()
        self._env_cache[sandbox_id] = (path, key, env)
        return dict(env)

    def log_path(self, sandbox_id: str) -> Path:
        """The sandbox's JSONL egress log."""
        return self.state_dir / "logs" / f"{sandbox_id}.egress.jsonl"

    def read_events(self, sandbox_id: str, offset: int = 0) -> tuple[list[EgressEvent], int]:
        """Events logged since byte ``offset``, and the offset to continue from.

        Only complete lines are returned, so a reader polling while the daemon writes never
        sees half an event.
        """
        try:
            with open(self.log_path(sandbox_id), "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        events = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                events.append(EgressEvent.from_json(json.loads(line)))
        return events, offset + end

    def suggest(self, sandbox_id: str, *, collapse_at: int | None = None) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox's log shows it used."""
        events, _ = self.read_events(sandbox_id)
        st = self._load(sandbox_id)
        base = None
        if st is not None and isinstance(st.get("policy"), dict):
            base = NetworkAllowlist.model_validate(st["policy"])
        return suggest(events, base=base, collapse_at=collapse_at)

    async def list_owned(self) -> list[str]:
        """Sandbox ids that have network state here."""
        return sorted(p.stem for p in (self.state_dir / "sandboxes").glob("*.json"))

    async def daemon_health(self) -> dict[str, JsonValue] | None:
        """The daemon's ping answer (pid, sandboxes served), or None when it is not running."""
        return await anyio.to_thread.run_sync(self._ping)

    async def stop_daemon(self) -> None:
        """Stop the daemon (proxies and forwards stop serving until the next ``prepare``)."""
        await anyio.to_thread.run_sync(self._stop_daemon)

    # ----------------------------------------------------------------- sync core

    def prepare_sync(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxNetwork:
        """Blocking :meth:`prepare` (tens of milliseconds: a few ``ip`` and ``nft`` runs)."""
        self._require()
        names = netns.names_for(sandbox_id)
        kind = _kind(policy)
        with self._locked():
            prior = self._load(sandbox_id)
            if prior is not None and _unix_socket(prior) is not None:
                msg = f"sandbox {sandbox_id} is served on a socket; it has no namespace to prepare"
                raise InvalidRequest(msg)
            # Read before ``st`` (the same dict) takes the new policy.
            prior_policy = prior.get("policy") if prior is not None else None
            st = prior or {"sandbox_id": sandbox_id, "ports": []}
            st.update(
                netns=names.netns,
                netns_path=names.netns_path,
                policy=policy_to_json(policy),
                log=str(self.log_path(sandbox_id)),
            )
            netns.create_netns(names.netns)
            if kind == "deny-all":
                # A fresh deny-all sandbox has nothing to remove; skip the nft run (~10 ms).
                if prior is not None and prior_policy != "deny-all":
                    netns.delete_table(names.table)
                netns.delete_link(names.host_if)
                st["proxy"] = None
            else:
                s = self._slot(st, names)
                port = self._proxy_port(st)
                # Rules first: they match the interface by name, so the veth is never up
                # without them.
                if kind == "allowlist":
                    netns.replace_table(names.table, netns.restricted_rules(names, s, port))
                else:
                    netns.replace_table(names.table, netns.allow_all_rules(names, s, self.pool))
                    netns.enable_ip_forward()
                via = s.host if kind == "allow-all" else None
                if not netns.link_exists(names.host_if):
                    # A new veth's namespace had no route; it gets its own in the same run.
                    netns.create_veth(names, s, via)
                else:
                    netns.set_default_route(names, via)
                st["proxy"] = (
                    {"listen": s.host, "port": port, "peer": s.sandbox}
                    if kind == "allowlist"
                    else None
                )
            self._save(sandbox_id, st)
            self._sync_daemon(sandbox_id, st, names)
            return self._view(sandbox_id, st)

    def prepare_unix_sync(
        self, sandbox_id: str, policy: NetworkPolicy, socket_path: Path
    ) -> SandboxNetwork:
        """Blocking :meth:`prepare_unix` (a few milliseconds once the daemon runs)."""
        socket_path = Path(socket_path).absolute()
        with self._locked():
            prior = self._load(sandbox_id)
            if prior is not None and _unix_socket(prior) is None:
                msg = f"sandbox {sandbox_id} has a namespace network; it cannot move to a socket"
                raise InvalidRequest(msg)
            st = prior or {"sandbox_id": sandbox_id, "ports": []}
            st.update(
                transport="unix",
                policy=policy_to_json(policy),
                log=str(self.log_path(sandbox_id)),
                proxy={"unix": str(socket_path)},
            )
            self._save(sandbox_id, st)
            try:
                self._sync_daemon(sandbox_id, st, netns.names_for(sandbox_id))
            except BaseException:
                if prior is None:
                    # Nothing serves it: leave no state that would make the daemon retry.
                    self._state_path(sandbox_id).unlink(missing_ok=True)
                raise
            return self._view(sandbox_id, st)

    def teardown_sync(self, sandbox_id: str, keep_log: bool = False) -> None:
        """Blocking :meth:`teardown`."""
        self._env_cache.pop(sandbox_id, None)
        prior = self._load(sandbox_id)
        if prior is not None and _unix_socket(prior) is not None:
            self._teardown_unix(sandbox_id, keep_log)
            return
        self._require()
        names = netns.names_for(sandbox_id)
        with self._locked():
            prior = self._load(sandbox_id)
            (self.state_dir / "sandboxes" / f"{sandbox_id}.json").unlink(missing_ok=True)
            alive = self._ping() is not None
            if alive:
                self._control({"op": "sync", "sandbox_id": sandbox_id})
            # A deny-all namespace never has a table (preparing deny-all removes any earlier
            # one before recording the policy), so the nft run (~5 ms) is skipped for it.
            if prior is None or prior.get("policy") != "deny-all":
                netns.delete_table(names.table)
            netns.delete_link(names.host_if)
            netns.delete_netns(names.netns)
            if not keep_log:
                self.log_path(sandbox_id).unlink(missing_ok=True)
            # Reading every sandbox's state is only worth it while there is a daemon to stop.
            daemon = alive or self._daemon_pid() is not None
            if daemon and not self._anyone_needs_daemon():
                self._stop_daemon()

    def _teardown_unix(self, sandbox_id: str, keep_log: bool) -> None:
        with self._locked():
            prior = self._load(sandbox_id)
            self._state_path(sandbox_id).unlink(missing_ok=True)
            alive = self._ping() is not None
            if alive:
                # The daemon closes the listener and removes the socket file.
                self._control({"op": "sync", "sandbox_id": sandbox_id})
            unix = _unix_socket(prior) if prior is not None else None
            if unix is not None and not alive:
                Path(unix).unlink(missing_ok=True)
            if not keep_log:
                self.log_path(sandbox_id).unlink(missing_ok=True)
            daemon = alive or self._daemon_pid() is not None
            if daemon and not self._anyone_needs_daemon():
                self._stop_daemon()

    def expose_port_sync(self, sandbox_id: str, port: int, host: str = "127.0.0.1") -> PortMapping:
        """Blocking :meth:`expose_port`."""
        if not 1 <= port <= 65535:
            msg = f"port {port} is outside 1..65535"
            raise InvalidRequest(msg)
        with self._locked():
            st = self._require_state(sandbox_id)
            if _unix_socket(st) is not None:
                msg = f"sandbox {sandbox_id} has no network namespace to publish a port from"
                raise NotSupported(msg)
            ports: list[JsonValue] = [p for p in _ports(st) if p["port"] != port]
            ports.append({"port": port, "host": host, "host_port": 0})
            st["ports"] = ports
            self._save(sandbox_id, st)
            self._sync_daemon(sandbox_id, st, netns.names_for(sandbox_id))
        for m in self.list_ports_sync(sandbox_id, ensure=False):
            if m.port == port:
                return m
        msg = f"port {port} of {sandbox_id} could not be published"
        raise BackendError(msg)

    def unexpose_port_sync(self, sandbox_id: str, port: int) -> None:
        """Blocking :meth:`unexpose_port`."""
        with self._locked():
            st = self._require_state(sandbox_id)
            st["ports"] = [p for p in _ports(st) if p["port"] != port]
            self._save(sandbox_id, st)
            self._sync_daemon(sandbox_id, st, netns.names_for(sandbox_id))

    def list_ports_sync(self, sandbox_id: str, *, ensure: bool = True) -> list[PortMapping]:
        """Blocking :meth:`list_ports`."""
        st = self._require_state(sandbox_id)
        if ensure and _ports(st) and self._ping() is None:
            with self._locked():
                st = self._require_state(sandbox_id)
                self._sync_daemon(sandbox_id, st, netns.names_for(sandbox_id))
        out = []
        for p in _ports(st):
            h, hp = str(p["host"]), int(str(p["host_port"]))
            url_host = f"[{h}]" if ":" in h else h
            out.append(
                PortMapping(
                    port=int(str(p["port"])), host=h, host_port=hp, url=f"http://{url_host}:{hp}"
                )
            )
        return out

    # ----------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Host-wide, not per home: kernel names and pool addresses are shared by every home.
        path = _GLOBAL_LOCK if os.geteuid() == 0 else self.state_dir / "lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _state_path(self, sandbox_id: str) -> Path:
        if "/" in sandbox_id or sandbox_id.startswith("."):
            msg = f"bad sandbox id {sandbox_id!r}"
            raise InvalidRequest(msg)
        return self.state_dir / "sandboxes" / f"{sandbox_id}.json"

    def _load(self, sandbox_id: str) -> dict[str, JsonValue] | None:
        try:
            data = json.loads(self._state_path(sandbox_id).read_text())
        except FileNotFoundError:
            return None
        return data if isinstance(data, dict) else None

    def _require_state(self, sandbox_id: str) -> dict[str, JsonValue]:
        st = self._load(sandbox_id)
        if st is None:
            msg = f"no network for sandbox {sandbox_id}"
            raise NotFound(msg)
        return st

    def _save(self, sandbox_id: str, st: dict[str, JsonValue]) -> None:
        path = self._state_path(sandbox_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=1))
        tmp.replace(path)

    def _slot(self, st: dict[str, JsonValue], names: netns.NetNames) -> netns.Slot:
        idx = st.get("slot")
        if isinstance(idx, int):
            s = netns.slot(self.pool, idx)
            # After a reboot another home may have taken our old /30; keep ours only if free.
            if netns.link_exists(names.host_if) or s.host not in netns.pool_addresses_in_use(
                self.pool
            ):
                return s
        used_idx = set()
        for f in (self.state_dir / "sandboxes").glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                other = json.loads(f.read_text())
                if other.get("sandbox_id") != st["sandbox_id"] and isinstance(
                    other.get("slot"), int
                ):
                    used_idx.add(other["slot"])
        in_kernel = netns.pool_addresses_in_use(self.pool)
        i = 1
        while True:
            s = netns.slot(self.pool, i)
            if i not in used_idx and s.host not in in_kernel:
                st["slot"] = i
                st["host_address"] = s.host
                st["sandbox_address"] = s.sandbox
                return s
            i += 1

    def _proxy_port(self, st: dict[str, JsonValue]) -> int:
        p = st.get("proxy")
        if isinstance(p, dict) and isinstance(p.get("port"), int):
            return int(str(p["port"]))
        return self.proxy_port

    def _view(self, sandbox_id: str, st: dict[str, JsonValue]) -> SandboxNetwork:
        names = netns.names_for(sandbox_id)
        raw = st.get("policy", "allow-all")
        kind = _kind(
            raw if raw in ("allow-all", "deny-all") else NetworkAllowlist.model_validate(raw)  # type: ignore[arg-type]
        )
        unix = _unix_socket(st)
        if unix is not None:
            return SandboxNetwork(
                sandbox_id=sandbox_id,
                kind=kind,
                netns="",
                netns_path="",
                host_address=None,
                sandbox_address=None,
                proxy_url=None,
                proxy_socket=unix,
            )
        proxy = st.get("proxy")
        url = f"http://{proxy['listen']}:{proxy['port']}" if isinstance(proxy, dict) else None
        has_veth = kind != "deny-all"
        return SandboxNetwork(
            sandbox_id=sandbox_id,
            kind=kind,
            netns=names.netns,
            netns_path=names.netns_path,
            host_address=str(st.get("host_address")) if has_veth else None,
            sandbox_address=str(st.get("sandbox_address")) if has_veth else None,
            proxy_url=url,
        )

    def _anyone_needs_daemon(self) -> bool:
        for f in (self.state_dir / "sandboxes").glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                st = json.loads(f.read_text())
                if st.get("proxy") or st.get("ports"):
                    return True
        return False

    def _sync_daemon(
        self, sandbox_id: str, st: dict[str, JsonValue], names: netns.NetNames
    ) -> None:
        needs = bool(st.get("proxy") or st.get("ports"))
        if not needs:
            if self._ping() is not None:
                self._control({"op": "sync", "sandbox_id": sandbox_id})
                if not self._anyone_needs_daemon():
                    self._stop_daemon()
            return
        self._ensure_daemon()
        reply = self._control({"op": "sync", "sandbox_id": sandbox_id})
        changed = False
        proxy = st.get("proxy")
        unix = _unix_socket(st)
        if unix is not None and reply.get("proxy_unix") != unix:
            msg = f"the egress daemon does not serve {unix} (see {self.state_dir / 'netd.log'})"
            raise BackendError(msg)
        got = reply.get("proxy_port")
        if isinstance(proxy, dict) and isinstance(got, int) and got != proxy.get("port"):
            # The wanted port was taken on that address: follow what the daemon bound.
            proxy["port"] = got
            s = netns.slot(self.pool, int(str(st["slot"])))
            netns.replace_table(names.table, netns.restricted_rules(names, s, got))
            changed = True
        bound = reply.get("ports")
        if isinstance(bound, list):
            by_port = {int(str(b["port"])): b for b in bound if isinstance(b, dict)}
            for p in _ports(st):
                b = by_port.get(int(str(p["port"])))
                if b is not None and b.get("host_port") != p.get("host_port"):
                    p["host_port"] = b["host_port"]
                    changed = True
        if changed:
            self._save(sandbox_id, st)

    # ----------------------------------------------------------------- daemon supervision

    @property
    def _sock(self) -> Path:
        return self.state_dir / "netd.sock"

    @property
    def _config(self) -> Path:
        return self.state_dir / "netd.json"

    def _control(self, req: dict[str, JsonValue], timeout: float = 10.0) -> dict[str, JsonValue]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(str(self._sock))
                s.sendall(json.dumps(req).encode() + b"\n")
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        except OSError as e:
            msg = f"egress daemon unreachable: {e}"
            raise BackendUnavailable(msg) from e
        reply = json.loads(buf or b"{}")
        if not isinstance(reply, dict) or not reply.get("ok"):
            err = reply.get("error") if isinstance(reply, dict) else reply
            msg = f"egress daemon: {err}"
            raise BackendError(msg)
        return reply

    def _ping(self) -> dict[str, JsonValue] | None:
        try:
            return self._control({"op": "ping"}, timeout=2.0)
        except (BackendUnavailable, BackendError, ValueError):
            return None

    def _daemon_pid(self) -> int | None:
        try:
            pid = int((self.state_dir / "netd.pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        # A recycled pid belongs to someone else: only a process running our config is ours.
        return pid if str(self._config).encode() in cmdline else None

    def _ensure_daemon(self) -> int:
        ping = self._ping()
        if ping is not None:
            return int(str(ping["pid"]))
        self._kill_stale()
        self._config.write_text(
            json.dumps(
                {
                    "state_dir": str(self.state_dir),
                    "nameserver": self.nameserver,
                    "internal_networks": [self.pool],
                }
            )
        )
        try:
            p = subprocess.run(
                [
                    self.python,
                    "-c",
                    _LEAN_BOOT,
                    "--config",
                    str(self._config),
                    "--daemonize",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                cwd="/",
            )
        except subprocess.TimeoutExpired as e:
            msg = "egress daemon did not start in 30 s"
            raise BackendError(msg) from e
        if p.returncode != 0:
            tail = _tail(self.state_dir / "netd.log")
            msg = f"egress daemon failed to start: {p.stderr.strip() or tail}"
            raise BackendError(msg)
        return int(p.stdout.strip().splitlines()[-1])

    def _kill_stale(self) -> None:
        pid = self._daemon_pid()
        if pid is not None:
            _terminate(pid)
        self._sock.unlink(missing_ok=True)

    def _stop_daemon(self) -> None:
        pid = self._daemon_pid()
        with contextlib.suppress(BackendUnavailable, BackendError):
            self._control({"op": "shutdown"}, timeout=2.0)
        if pid is not None:
            _terminate(pid)


def _terminate(pid: int) -> None:
    deadline = time.monotonic() + 3.0
    sent_term = False
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        if not sent_term and time.monotonic() > deadline - 2.0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            sent_term = True
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text().splitlines()[-n:])
    except OSError:
        return ""


def _ports(st: dict[str, JsonValue]) -> list[dict[str, JsonValue]]:
    raw = st.get("ports")
    return [p for p in raw if isinstance(p, dict)] if isinstance(raw, list) else []


def _unix_socket(st: dict[str, JsonValue]) -> str | None:
    proxy = st.get("proxy")
    if st.get("transport") == "unix" and isinstance(proxy, dict) and proxy.get("unix"):
        return str(proxy["unix"])
    return None


def _kind(policy: NetworkPolicy) -> Literal["allow-all", "deny-all", "allowlist"]:
    if policy == "allow-all":
        return "allow-all"
    if policy == "deny-all":
        return "deny-all"
    return "allowlist"
