"""A ``local`` sandbox's network at run time: its policy, resolver, ports and egress log.

Under crun as root a sandbox's network namespace is prepared by the network service
(:mod:`sandlot.network`), which switches its policy while it runs; rootless, ``allow-all`` is
slirp4netns attached behind a fence (:func:`.rootless.fence_slirp`) and detached for
``deny-all``. The ``/etc/resolv.conf`` a sandbox sees is a host file of ours, rewritten in place
when the policy changes. This module must not import the store, the Manager or front ends.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from sandlot.backends.local import rootless
from sandlot.backends.local.runtime import process_alive, process_start_time
from sandlot.backends.local.state import LocalState, Meta
from sandlot.errors import NotSupported
from sandlot.models import JsonValue, NetworkAllowlist, NetworkPolicy, PortMapping

if TYPE_CHECKING:
    from sandlot.network.service import SandboxNetwork


def _host_resolv_conf() -> str:
    """The host's nameservers a NATed sandbox can reach: not loopback ones."""
    for source in ("/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"):
        try:
            lines = Path(source).read_text().splitlines()
        except OSError:
            continue
        servers = [
            line.split()[1]
            for line in lines
            if line.startswith("nameserver") and len(line.split()) > 1
        ]
        usable = [a for a in servers if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
        if usable:
            return "".join(f"nameserver {a}\n" for a in usable[:3])
    return "# sandlot: the host's resolver listens on its loopback, which sandboxes cannot reach\n"


_RESOLV_NO_NETWORK = "# sandlot: this sandbox has no outbound network\n"
_RESOLV_PROXIED = (
    "# sandlot: no resolver here; HTTP and HTTPS go out through the egress proxy\n"
    "# ($HTTPS_PROXY), which resolves the names the network policy allows\n"
)


def policy_kind(policy: NetworkPolicy) -> str:
    return policy if isinstance(policy, str) else "allowlist"


def resolv_conf(kind: str, *, slirp: bool) -> str:
    """What ``/etc/resolv.conf`` says inside a sandbox under policy ``kind``."""
    if kind == "allow-all":
        # Outbound traffic is NATed, so the sandbox can use the host's own nameservers
        # (unless they sit on the host's loopback, which the sandbox cannot reach);
        # slirp4netns offers a resolver of its own that forwards to them.
        return f"nameserver {rootless.SLIRP_DNS}\n" if slirp else _host_resolv_conf()
    # An allowlist's names are resolved by its proxy; inside, a query could only leak data.
    return _RESOLV_PROXIED if kind == "allowlist" else _RESOLV_NO_NETWORK


def set_resolv_conf(path: Path, text: str) -> None:
    """Write the host file a sandbox sees as its ``/etc/resolv.conf``.

    In place, never by rename: the sandbox's ``/etc/resolv.conf`` is a bind mount of this very
    inode, and a rename would leave it the old text. A reader inside sees the old text, an
    empty file (no nameserver: the resolver asks the sandbox's own loopback and fails) or the
    new text. Readable by every uid: the sandbox's are not the host's.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def binds_resolv_conf(meta: Meta, net: SandboxNetwork | None) -> bool:
    """Whether a sandbox's ``/etc/resolv.conf`` is a host file of ours (``resolv.conf`` in its
    directory), rewritten when its policy changes: for every sandbox whose policy can change
    while it runs, under crun with the network service or rootless (slirp4netns comes and
    goes). gVisor sandboxes, and those made without the network service, are deny-all for
    life and keep their root's own file."""
    return meta.runtime == "crun" and (net is not None or meta.idmap is not None)


class Network(LocalState):
    """Switching, inspecting and publishing a sandbox's network (see the module docstring)."""

    async def _start_slirp(self, d: Path, meta: Meta) -> None:
        """Rootless ``allow-all``: fence the sandbox's network namespace (what rootful
        ``allow-all`` refuses, :func:`.rootless.fence_slirp`) and attach slirp4netns to it."""
        assert meta.init is not None
        init = meta.init[0]
        # The fence first: there is no way out of the namespace before it holds.
        await anyio.to_thread.run_sync(rootless.fence_slirp, init)
        pid = await anyio.to_thread.run_sync(
            lambda: rootless.start_slirp(init, d / "logs" / "slirp.log")
        )
        start = process_start_time(pid)
        meta.slirp = [pid, start] if start is not None else None
        meta.save(d / "meta.json")

    async def expose_port(self, ref: str, port: int) -> PortMapping:
        """Publish a sandbox port on the host's loopback (needs the network service)."""
        if self._networks is None:
            msg = "publishing ports needs the network service; this sandbox has loopback only"
            raise NotSupported(msg)
        _, meta = self._meta(ref)
        if meta.net_key is None:
            msg = f"sandbox {ref} was made without the network service"
            raise NotSupported(msg)
        return await self._networks.expose_port(meta.net_key, port)

    def _net_key(self, ref: str) -> str:
        _, meta = self._meta(ref)
        if self._networks is None or meta.net_key is None:
            msg = f"sandbox {ref} was made without the network service (loopback only)"
            raise NotSupported(msg)
        return meta.net_key

    async def update_network(self, ref: str, policy: NetworkPolicy) -> None:
        """Change a sandbox's network policy while it runs (or for its next start).

        Every transition between ``allow-all``, ``deny-all`` and allowlists works both ways
        under crun as root; rootless, between ``deny-all`` and ``allow-all``. New connections
        follow the policy once this returns, and so do commands started afterwards (exec,
        background processes, terminals): the proxy variables are added per command (present
        exactly under an allowlist), ``/etc/resolv.conf`` is rewritten, and the interfaces and
        routes are those of the policy. Processes already running keep the environment they
        started with. The policy is recorded for the sandbox; a caller's later ``start`` gets
        the policy its spec names.

        Raises:
            NotSupported: the change cannot be made here (gVisor sandboxes and sandboxes made
                without the network service are ``deny-all`` for life; rootless sandboxes have
                no allowlists, and ``allow-all`` needs slirp4netns). Nothing is changed.
        """
        kind = policy_kind(policy)
        async with self._alock(ref):
            d, meta = self._meta(ref)
            if self._network_can_switch(ref, meta, kind):
                if meta.idmap is not None:
                    await self._switch_slirp(d, meta, kind)
                else:
                    assert self._networks is not None
                    assert meta.net_key is not None
                    await self._networks.update_policy(meta.net_key, policy)
                text = resolv_conf(kind, slirp=meta.idmap is not None)
                await anyio.to_thread.run_sync(set_resolv_conf, d / "resolv.conf", text)
            meta.spec = (
                meta.spec_model().model_copy(update={"network": policy}).model_dump(mode="json")
            )
            meta.save(d / "meta.json")

    def _network_can_switch(self, ref: str, meta: Meta, kind: str) -> bool:
        """Whether the sandbox's network can switch to ``kind``; False when it has ``kind`` for
        life (nothing to do). Refuses, before anything changes, what it cannot switch to."""
        if meta.idmap is not None:
            if kind == "allowlist":
                msg = (
                    f"sandbox {ref} is rootless: network allowlists need root (the egress "
                    "proxy's namespaces and nftables); without root a sandbox switches only "
                    "between deny-all and allow-all"
                )
                raise NotSupported(msg, field="network")
            problem = rootless.slirp_problem() if kind == "allow-all" else None
            if problem is not None:
                msg = f"network='allow-all' without root needs slirp4netns, and {problem}"
                raise NotSupported(msg, field="network")
            return True
        if meta.runtime == "runsc" or self._networks is None or meta.net_key is None:
            if kind == "deny-all":
                return False
            if meta.runtime == "runsc":
                msg = (
                    f"sandbox {ref} runs under gVisor, whose sandboxes are deny-all for life on "
                    "this runsc (it cannot join a prepared network namespace); make an "
                    "isolation='namespaces' sandbox to change its network"
                )
            else:
                msg = (
                    f"sandbox {ref} was made without the network service: it has loopback "
                    "only (deny-all) for life"
                )
            raise NotSupported(msg, field="network")
        if kind not in self._networks.capabilities():
            msg = (
                f"network policy {kind!r} is not enforced here (sandbox networks need root, "
                "ip and nft)"
            )
            raise NotSupported(msg, field="network")
        return True

    async def _switch_slirp(self, d: Path, meta: Meta, kind: str) -> None:
        """Rootless: attach slirp4netns for ``allow-all``, detach it for ``deny-all`` (its tap
        device goes with it, leaving loopback only). A stopped sandbox changes at its start."""
        running = meta.init is not None and process_alive(meta.init[0], meta.init[1])
        attached = meta.slirp is not None and process_alive(meta.slirp[0], meta.slirp[1])
        if kind == "allow-all" and running and not attached:
            await self._start_slirp(d, meta)
        elif kind == "deny-all" and meta.slirp is not None:
            slirp_pid, slirp_start = meta.slirp
            await anyio.to_thread.run_sync(rootless.stop_slirp, slirp_pid, slirp_start)
            meta.slirp = None

    def network_events(self, ref: str, offset: int = 0) -> tuple[list[dict[str, JsonValue]], int]:
        """The egress proxy's decisions for this sandbox since byte ``offset``."""
        key = self._net_key(ref)
        assert self._networks is not None
        events, nxt = self._networks.read_events(key, offset)
        return [e.to_json() for e in events], nxt

    def suggest_network(self, ref: str) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to."""
        key = self._net_key(ref)
        assert self._networks is not None
        return self._networks.suggest(key)
