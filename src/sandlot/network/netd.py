"""The network daemon: one small detached process per state directory hosting every sandbox's
egress proxy and port forwarders (``python -m sandlot.network.netd --config FILE``).

The supervisor in :mod:`sandlot.network.service` starts, checks and stops it. It reads the
per-sandbox state files the supervisor writes and never writes them; it answers on a unix
control socket. It must stay cheap in memory: it imports only the stdlib and the stdlib-only
network modules (proxy, port forwarding, policy, dns) — no pydantic, no models.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import final

from sandlot.network.dns import NameserverResolver, Resolver, SystemResolver
from sandlot.network.policy import (
    IPNetwork,
    compile_policy,
)
from sandlot.network.portforward import (
    PortForwarder,
)
from sandlot.network.proxy import (
    EgressProxy,
    LocalAddresses,
    _ino,
    _split_authority,
)

__all__ = ["NetDaemon", "main"]


@dataclass
class _Services:
    state: dict[str, object]
    proxy: EgressProxy | None = None
    forwards: dict[int, PortForwarder] | None = None


@final
class NetDaemon:
    """Runs the egress proxies and port forwarders of every sandbox in one state directory.

    State files (``<state_dir>/sandboxes/<id>.json``, written by the supervisor) say what each
    sandbox needs; ``sync`` on the control socket (``<state_dir>/netd.sock``) makes the daemon
    match one file, and every file is synced at start (after a crash or a reboot).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        nameserver: str | None = None,
        internal_networks: tuple[IPNetwork, ...] = (),
    ) -> None:
        """Args:
        state_dir: the supervisor's network state directory.
        nameserver: ``IP`` or ``IP:PORT`` of the resolver the proxies use (None: the host's).
        internal_networks: address ranges of sandboxes (never connected to).
        """
        self.state_dir = state_dir
        self._resolver: Resolver = _resolver_for(nameserver)
        self._internal = internal_networks
        self._local = LocalAddresses()
        self._sandboxes: dict[str, _Services] = {}
        self._stop = asyncio.Event()
        self._control: asyncio.Server | None = None

    @property
    def socket_path(self) -> Path:
        """The control socket."""
        return self.state_dir / "netd.sock"

    async def start(self) -> None:
        """Open the control socket and bring up every sandbox that has a state file."""
        self.socket_path.unlink(missing_ok=True)
        self._control = await asyncio.start_unix_server(self._control_client, str(self.socket_path))
        self.socket_path.chmod(0o600)
        for f in sorted((self.state_dir / "sandboxes").glob("*.json")):
            with contextlib.suppress(Exception):
                await self.sync(f.stem)

    async def run(self) -> None:
        """Serve until asked to shut down."""
        await self._stop.wait()
        await self.aclose()

    def request_stop(self) -> None:
        """Make :meth:`run` return."""
        self._stop.set()

    async def aclose(self) -> None:
        """Close everything."""
        if self._control is not None:
            self._control.close()
            self._control = None
        for sid in list(self._sandboxes):
            await self._drop(sid)
        self.socket_path.unlink(missing_ok=True)

    async def _drop(self, sid: str) -> None:
        svc = self._sandboxes.pop(sid, None)
        if svc is None:
            return
        if svc.proxy is not None:
            await svc.proxy.aclose()
        for fwd in (svc.forwards or {}).values():
            await fwd.aclose()

    def status(self, sid: str) -> dict[str, object]:
        """What one sandbox has running: the proxy's port (or unix socket) and the bound
        forwards."""
        svc = self._sandboxes.get(sid)
        if svc is None:
            return {"proxy_port": None, "proxy_unix": None, "ports": []}
        unix = svc.proxy.unix_path if svc.proxy is not None else None
        return {
            "proxy_port": svc.proxy.address[1] if svc.proxy is not None and unix is None else None,
            "proxy_unix": str(unix) if unix is not None else None,
            "ports": [
                {"port": f.port, "host": f.host, "host_port": f.host_port}
                for f in (svc.forwards or {}).values()
            ],
        }

    async def sync(self, sid: str) -> dict[str, object]:
        """Make one sandbox's services match its state file (a missing file removes them)."""
        path = self.state_dir / "sandboxes" / f"{sid}.json"
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            await self._drop(sid)
            return self.status(sid)
        svc = self._sandboxes.setdefault(sid, _Services(state={}, forwards={}))
        await self._sync_proxy(sid, svc, state)
        await self._sync_forwards(svc, state)
        svc.state = state
        if svc.proxy is None and not svc.forwards:
            self._sandboxes.pop(sid, None)
        return self.status(sid)

    async def _sync_proxy(self, sid: str, svc: _Services, state: dict[str, object]) -> None:
        want = state.get("proxy")
        if not isinstance(want, dict):
            if svc.proxy is not None:
                await svc.proxy.aclose()
                svc.proxy = None
            return
        policy = compile_policy(state.get("policy", "deny-all"))  # type: ignore[arg-type]
        old = svc.state.get("proxy")
        if (
            svc.proxy is not None
            and isinstance(old, dict)
            and _where(old) == _where(want)
            and (want.get("unix") is None or _ino(Path(str(want["unix"]))) is not None)
        ):
            svc.proxy.update_policy(policy)
            return
        if svc.proxy is not None:
            await svc.proxy.aclose()
            svc.proxy = None
        log = state.get("log")
        unix = want.get("unix")
        proxy = EgressProxy(
            sid,
            policy,
            listen=str(want.get("listen", "127.0.0.1")),
            port=int(str(want.get("port", 0))),
            allowed_peer=None if want.get("peer") is None else str(want["peer"]),
            resolver=self._resolver,
            internal_networks=self._internal,
            local_addresses=self._local,
            log_path=Path(str(log)) if log else None,
            unix_path=Path(str(unix)) if unix else None,
        )
        await proxy.start()
        svc.proxy = proxy

    async def _sync_forwards(self, svc: _Services, state: dict[str, object]) -> None:
        forwards = svc.forwards if svc.forwards is not None else {}
        svc.forwards = forwards
        netns = str(state.get("netns_path", ""))
        wanted: dict[int, dict[str, object]] = {}
        raw = state.get("ports", [])
        for p in raw if isinstance(raw, list) else []:
            if isinstance(p, dict):
                wanted[int(p["port"])] = p
        for port in list(forwards):
            f = forwards[port]
            w = wanted.get(port)
            if w is None or str(w.get("host")) != f.host or f.netns_path != netns:
                await f.aclose()
                del forwards[port]
        for port, w in wanted.items():
            if port not in forwards:
                fwd = PortForwarder(
                    netns, port, str(w.get("host", "127.0.0.1")), int(str(w.get("host_port", 0)))
                )
                await fwd.start()
                forwards[port] = fwd

    async def _control_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while line := await reader.readline():
                try:
                    req = json.loads(line)
                    reply = await self._command(req)
                except Exception as e:  # reported to the supervisor, which raises it as ours
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _command(self, req: dict[str, object]) -> dict[str, object]:
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "sandboxes": sorted(self._sandboxes)}
        if op == "sync":
            return {"ok": True, **(await self.sync(str(req["sandbox_id"])))}
        if op == "status":
            return {"ok": True, **self.status(str(req["sandbox_id"]))}
        if op == "shutdown":
            self.request_stop()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}


def _where(proxy: dict[str, object]) -> tuple[object, ...]:
    """What identifies a proxy's listener in a state file (changing it means a new listener)."""
    if proxy.get("unix"):
        return ("unix", proxy["unix"])
    return ("tcp", proxy.get("listen"), proxy.get("port"), proxy.get("peer"))


def _resolver_for(nameserver: str | None) -> Resolver:
    if not nameserver:
        return SystemResolver()
    host, port = _split_authority(nameserver, 53)
    return NameserverResolver(host, port)


def _daemon_main(config: dict[str, object], ready_fd: int | None) -> int:
    state_dir = Path(str(config["state_dir"]))
    pools = config.get("internal_networks", [])
    internal = tuple(
        ipaddress.ip_network(str(n)) for n in (pools if isinstance(pools, list) else [])
    )
    ns = config.get("nameserver")

    async def run() -> None:
        daemon = NetDaemon(
            state_dir, nameserver=str(ns) if ns else None, internal_networks=internal
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, daemon.request_stop)
        loop.add_signal_handler(signal.SIGINT, daemon.request_stop)
        await daemon.start()
        (state_dir / "netd.pid").write_text(f"{os.getpid()}\n")
        if ready_fd is not None:
            os.write(ready_fd, f"{os.getpid()}\n".encode())
            os.close(ready_fd)
        try:
            await daemon.run()
        finally:
            with contextlib.suppress(OSError):
                if (state_dir / "netd.pid").read_text().strip() == str(os.getpid()):
                    (state_dir / "netd.pid").unlink()

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sandlot.network.netd --config FILE [--daemonize]``.

    The config is JSON: ``{"state_dir": …, "nameserver": "IP[:PORT]" | null,
    "internal_networks": ["10.213.0.0/16"]}``. With ``--daemonize`` the process forks, the child
    leaves the session, and the parent exits 0 printing the daemon's pid once it serves (1 if
    it failed to start); the caller thus never has a child left to reap.
    """
    parser = argparse.ArgumentParser(prog="python -m sandlot.network.netd")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--daemonize", action="store_true")
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text())
    if not args.daemonize:
        return _daemon_main(config, None)
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        got = b""
        with os.fdopen(r, "rb") as f:
            got = f.read()
        if got.strip():
            print(got.decode().strip())
            return 0
        return 1
    os.close(r)
    os.setsid()
    log = Path(str(config["state_dir"])) / "netd.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    try:
        code = _daemon_main(config, w)
    except BaseException as e:
        print(f"sandlot-netd: {e!r}", file=sys.stderr)
        code = 1
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
