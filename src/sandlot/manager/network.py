"""A sandbox's network: changing its egress policy, its egress log and suggested allowlist,
turning logged egress decisions into receipts, and publishing ports on the host.

Needs a backend that implements :class:`~sandlot.backends.base.NetworkControl` (egress) or
reports ``ports`` among its capabilities. Must not import a front end.
"""

from __future__ import annotations

import builtins
import contextlib

import anyio

from sandlot.backends.base import NetworkControl
from sandlot.errors import Conflict, InvalidRequest, InvalidState, NotSupported, SandboxError
from sandlot.manager.core import ManagerCore
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    PortMapping,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    parse_model,
)
from sandlot.store.base import SandboxQuery

S = SandboxStatus


class Network(ManagerCore):
    """Egress policy and its log, and published ports."""

    def _network_control(self, sb: SandboxInfo) -> NetworkControl:
        impl = self._backend_of(sb)
        if not isinstance(impl, NetworkControl):
            msg = f"backend {sb.backend!r} has no egress control"
            raise NotSupported(msg)
        return impl

    async def update_network(
        self, sandbox_id: str, policy: NetworkPolicy | str, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Change a running sandbox's egress policy; new connections follow it within a second."""
        raw = policy.model_dump() if isinstance(policy, NetworkAllowlist) else policy
        network = parse_model(SandboxSpec, {"network": raw}).network
        sb = await self.get(sandbox_id, actor=actor)
        impl = self._backend_of(sb)
        kind = network if isinstance(network, str) else "allowlist"
        caps = impl.capabilities()
        if kind not in caps.network:
            msg = f"backend {sb.backend!r} cannot enforce network policy {kind!r}"
            if kind in caps.missing:
                msg += f": {caps.missing[kind]}"
            raise NotSupported(msg)
        control = self._network_control(sb)
        policy_json = network if isinstance(network, str) else network.model_dump(mode="json")
        async with self._gated(actor, "network.update", sb, network=policy_json):
            sb = await self._ready(sandbox_id, actor, True, sb)
            assert sb.backend_ref is not None
            await control.update_network(sb.backend_ref, network)
            for _ in range(50):
                try:
                    return await self._cas(sb, spec=sb.spec.model_copy(update={"network": network}))
                except Conflict:
                    sb = await self.store.get(sb.id)
            msg = f"sandbox {sb.id} keeps changing; update_network gave up"
            raise Conflict(msg)

    async def network_log(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision logged for the sandbox (and new ones become receipts)."""
        sb = await self.get(sandbox_id, actor=actor)
        control = self._network_control(sb)
        _require_live(sb, "its egress log went with it; the decisions are in the receipts")
        await self._drain_egress(sb)
        assert sb.backend_ref is not None
        events, _ = await anyio.to_thread.run_sync(control.network_events, sb.backend_ref, 0)
        return events

    async def suggest_network(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to (record mode)."""
        sb = await self.get(sandbox_id, actor=actor)
        control = self._network_control(sb)
        _require_live(sb, "its egress log went with it")
        assert sb.backend_ref is not None
        return await anyio.to_thread.run_sync(control.suggest_network, sb.backend_ref)

    async def _drain_egress(self, sb: SandboxInfo) -> SandboxInfo:
        """Turn egress events logged since the last drain into ``network.egress`` receipts;
        the record as it is afterwards."""
        impl = self._backend_of(sb)
        if self.gate is None or not isinstance(impl, NetworkControl) or sb.backend_ref is None:
            return sb
        offset = sb.metadata.get("egress_offset", 0)
        start = offset if isinstance(offset, int) else 0
        try:
            events, nxt = await anyio.to_thread.run_sync(impl.network_events, sb.backend_ref, start)
        except SandboxError:
            return sb
        if not events:
            return sb
        await self.gate.record_egress(sb.tenant, sb.id, events)
        for _ in range(50):
            try:
                return await self._cas(sb, metadata={**sb.metadata, "egress_offset": nxt})
            except Conflict:
                sb = await self.store.get(sb.id)
        return sb

    async def expose_port(
        self, sandbox_id: str, port: int, *, actor: Actor = LOCAL_ACTOR
    ) -> PortMapping:
        """Publish a sandbox port on the host."""
        if not 1 <= port <= 65535:
            msg = f"port {port} is outside 1..65535"
            raise InvalidRequest(msg)
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "port.expose", sb, port=port):
            sb = await self._ready(sandbox_id, actor, True, sb)
            sb = await self._expose(sb, port)
            return next(p for p in sb.ports if p.port == port)

    async def _expose(self, sb: SandboxInfo, port: int) -> SandboxInfo:
        impl = self._backend_of(sb)
        if not impl.capabilities().ports:
            msg = f"backend {sb.backend!r} cannot expose ports"
            raise NotSupported(msg)
        assert sb.backend_ref is not None
        mapping = await impl.expose_port(sb.backend_ref, port)
        for _ in range(50):
            ports = [p for p in sb.ports if p.port != port] + [mapping]
            try:
                return await self._cas(sb, ports=sorted(ports, key=lambda p: p.port))
            except Conflict:
                sb = await self.store.get(sb.id)
        msg = f"sandbox {sb.id} keeps changing; expose_port gave up"
        raise Conflict(msg)

    async def list_ports(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[PortMapping]:
        """Published ports."""
        return list((await self.get(sandbox_id, actor=actor)).ports)

    async def record_egress(self) -> int:
        """Turn the egress decisions of every running sandbox, logged since the last time, into
        ``network.egress`` receipts (the server does this periodically; stop and destroy do it
        for their sandbox). The number of sandboxes looked at."""
        running = [
            sb
            for sb in await self.store.list(SandboxQuery(statuses=frozenset({S.RUNNING})))
            if self._mine(sb)
        ]
        for sb in running:
            with contextlib.suppress(SandboxError):
                await self._drain_egress(sb)
        return len(running)


def _require_live(sb: SandboxInfo, why: str) -> None:
    if sb.status is S.DESTROYED or sb.backend_ref is None:
        msg = f"sandbox {sb.id} is {sb.status}: {why}"
        raise InvalidState(msg, id=sb.id)
