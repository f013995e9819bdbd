"""A microVM's network: the host side of it and the policy changes a running VM takes.

Network. A ``deny-all`` VM has no NIC at all. Any other policy gives the VM one virtio-net NIC
on QEMU's user-mode network, in one of two modes fixed at create:

- ``proxy`` (allowlists): the user-mode network is restricted (``restrict=on``), so the guest
  reaches nothing but :data:`~sandlot.backends.microvm.qemu.PROXY_ADDRESS`, which QEMU forwards
  (one ``socat`` per connection) to a unix socket where the network daemon's egress proxy for
  this sandbox listens (:meth:`SandboxNetworks.prepare_unix`). Raw TCP is reset, UDP and DNS are
  dropped, and the guest has no default route. Needs ``socat``, not root.
- ``nat`` (``allow-all``): unrestricted user-mode NAT, with QEMU started inside the sandbox's
  own network namespace from :meth:`SandboxNetworks.prepare`, so the namespace's firewall
  (no host, loopback, link-local, other sandboxes) decides what the NAT reaches; the gateway
  address that user-mode networking maps to "the host's loopback" is the namespace's empty one.
  Needs root, ``ip`` and ``nft``. Any policy kind can follow at run time: the namespace is
  re-prepared (an allowlist then reaches the proxy on the namespace's veth through the NAT).

The guest's side (address, no default route, no IPv6) is set by the image's ``/init``, so one
template with a NIC serves both modes; ``nat`` adds the default route and a resolver after every
restore. A template or snapshot with a NIC only restores into a VM with one (QEMU loads device
state only into the same devices): the template fingerprint includes the NIC, and restoring or
forking across the two fails with :class:`NotSupported`. Commands started through
:meth:`~sandlot.backends.microvm.backend.MicrovmBackend.channel` get ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` (both cases).

Builds on :class:`~sandlot.backends.microvm.state.MicrovmState` only; must not import the
guest, boot or later modules, the store or the Manager.
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.state import MicrovmState, NetMode, VmRecord
from sandlot.errors import NotFound, NotSupported
from sandlot.models import JsonValue, NetworkAllowlist, NetworkPolicy
from sandlot.network.service import SandboxNetworks, proxy_env

__all__ = ["Launch", "NetworkPlumbing", "mode_for", "policy_kind"]

_PROXY_URL: Final = f"http://{qemu.PROXY_ADDRESS}:{qemu.PROXY_PORT}"


def policy_kind(policy: NetworkPolicy) -> Literal["allow-all", "deny-all", "allowlist"]:
    if isinstance(policy, NetworkAllowlist):
        return "allowlist"
    return policy


def mode_for(policy: NetworkPolicy) -> NetMode:
    kind = policy_kind(policy)
    if kind == "deny-all":
        return "none"
    return "proxy" if kind == "allowlist" else "nat"


@dataclass(frozen=True)
class Launch:
    """How one QEMU process is networked: its NIC's arguments and the command prefix that puts
    it into a network namespace."""

    netdev: list[str] | None = None
    prefix: tuple[str, ...] = ()


class NetworkPlumbing(MicrovmState):
    """The host side of a VM's network (proxy socket or namespace), its QEMU's NIC, and
    policy changes at run time."""

    @property
    def networks(self) -> SandboxNetworks:
        """The network service this backend's VMs use."""
        return self._networks

    def _kinds(self) -> frozenset[str]:
        if self._network_kinds is None:
            kinds = {"deny-all"}
            if shutil.which("socat"):
                kinds.add("allowlist")
            if "allow-all" in self._networks.capabilities() and shutil.which("nsenter"):
                kinds.add("allow-all")
            self._network_kinds = frozenset(kinds)
        return self._network_kinds

    def _require_kind(self, policy: NetworkPolicy) -> None:
        kind = policy_kind(policy)
        if kind in self._kinds():
            return
        why = {
            "allowlist": "network allowlists need socat on the host (apt-get install socat)",
            "allow-all": (
                "network='allow-all' needs root with ip and nft (QEMU's NAT runs inside a "
                "network namespace whose firewall keeps the host and link-local addresses out)"
            ),
        }.get(kind, f"network policy {kind!r} is not enforced")
        msg = f"the microvm backend cannot enforce this here: {why}"
        raise NotSupported(msg, field="network")

    def _new_egress_socket(self) -> str:
        # Not in the VM directory: a pooled VM's directory is renamed when it is claimed, and
        # QEMU keeps the path it was started with. Short, so socat can use it as it is.
        return str(self._root / "egress" / f"{secrets.token_hex(6)}.sock")

    def _launch(self, ref: str, net_mode: NetMode, egress_socket: str | None) -> Launch:
        if net_mode == "none":
            return Launch()
        if net_mode == "proxy":
            sock = Path(egress_socket) if egress_socket else None
            return Launch(qemu.user_netdev(restrict=True, proxy_socket=sock))
        netns_path = self._networks.get(ref).netns_path
        return Launch(
            qemu.user_netdev(restrict=False, proxy_socket=None),
            ("nsenter", f"--net={netns_path}", "--"),
        )

    def _launch_of(self, rec: VmRecord) -> Launch:
        return self._launch(rec.sandbox_id, rec.net_mode, rec.egress_socket)

    async def _prepare_network(
        self, ref: str, net_mode: NetMode, policy: NetworkPolicy, egress_socket: str | None
    ) -> None:
        """Make the host side of the VM's network serve ``policy`` (idempotent: also after a
        host reboot or a crashed daemon)."""
        if net_mode == "proxy":
            assert egress_socket is not None
            await self._networks.prepare_unix(ref, policy, Path(egress_socket))
        elif net_mode == "nat":
            await self._networks.prepare(ref, policy)

    def _has_network(self, ref: str) -> bool:
        try:
            self._networks.get(ref)
        except NotFound:
            return False
        return True

    async def _teardown_network(self, ref: str) -> None:
        if self._has_network(ref):
            await self._networks.teardown(ref)

    def _guest_env(self, rec: VmRecord) -> dict[str, str]:
        if rec.net_mode == "proxy":
            return proxy_env(_PROXY_URL)
        try:
            # Read per command: a nat VM's policy (and so its proxy) can change at run time.
            return self._networks.env(rec.sandbox_id)
        except NotFound:
            return {}

    async def update_network(self, ref: str, policy: NetworkPolicy) -> None:
        """Change a VM's egress policy; new connections follow it at once.

        A ``proxy`` VM (made with an allowlist) takes any allowlist or ``deny-all`` (the proxy
        then refuses everything); a ``nat`` VM (made with ``allow-all``) takes any policy.

        Raises:
            NotSupported: The VM has no NIC (made with ``deny-all``) and the policy is not
                ``deny-all``, or a ``proxy`` VM is asked for ``allow-all``.
        """
        rec = self._record(ref)
        kind = policy_kind(policy)
        if rec.net_mode == "none":
            if kind == "deny-all":
                return
            msg = (
                f"microvm {ref} was created with network='deny-all' and has no NIC, which cannot "
                "be added to a running VM; create it with an allowlist (even an empty one) to "
                "change its policy later"
            )
            raise NotSupported(msg, field="network")
        if rec.net_mode == "proxy" and kind == "allow-all":
            msg = (
                f"microvm {ref} was created with an allowlist: its NIC reaches only the egress "
                "proxy; allow-all needs a VM created with allow-all"
            )
            raise NotSupported(msg, field="network")
        self._require_kind(policy)
        await self._networks.update_policy(ref, policy)

    def network_events(self, ref: str, offset: int = 0) -> tuple[list[dict[str, JsonValue]], int]:
        """The egress proxy's decisions for this VM since byte ``offset`` (none for a VM
        without a NIC)."""
        self._record(ref)
        events, nxt = self._networks.read_events(ref, offset)
        return [e.to_json() for e in events], nxt

    def suggest_network(self, ref: str) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the VM connected to."""
        self._record(ref)
        return self._networks.suggest(ref)
