"""Talking to a microVM's guest agent: connecting (with the retries a virtio-serial port
needs), guest commands, the descriptor count a baseline records, setting the clock after a
restore, and leaving the agent idle before the VM's memory is saved.

Agent connections: QEMU's socket for the virtio-serial port serves one host connection at a
time, and the guest only learns that the host hung up when its read returns end-of-file. The
agent therefore starts a new session when a new host's preamble arrives where a frame of the old
session should (docs/agent-protocol.md), and ends its session on ``session.detach``, which the
host sends before a VM's memory is saved. The connection an operation ends with is handed to
the next
:meth:`~sandlot.backends.microvm.backend.MicrovmBackend.channel` call of the same object (no reconnection at all), and
:meth:`_open_channel` retries the handshake for agents without these.

Builds on :class:`~sandlot.backends.microvm.state.MicrovmState` (with :mod:`.qmp` for the
QEMU side of a detach); must not import the network, boot or later modules, the store or the
Manager.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

import anyio
import anyio.abc

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.image import GUEST_BUSYBOX, GUEST_GATEWAY, GUEST_NAMESERVER
from sandlot.backends.microvm.qmp import QmpClient, connect_unix
from sandlot.backends.microvm.state import FdSource, MicrovmState, NetMode, serial_tail
from sandlot.channel.base import Channel
from sandlot.channel.client import AgentChannel, connect_stream
from sandlot.errors import BackendError, SandboxError, SandboxTimeout

__all__ = ["GuestAgent", "fd_source_of", "leave_agent_idle", "serves"]

# Run in the guest after every restore of a ``nat`` VM (the template has neither): the default
# route through user-mode networking's gateway, and its DNS forwarder as the resolver, bound over
# /etc/resolv.conf from RAM so that the disk (whose hash reset verifies) is not written.
_NAT_GUEST_SETUP: Final = (
    f"B={GUEST_BUSYBOX}; $B ip route replace default via {GUEST_GATEWAY} dev eth0 && "
    "{ $B grep -q ' /etc/resolv.conf ' /proc/mounts || "
    f"{{ echo 'nameserver {GUEST_NAMESERVER}' > /run/sandlot/resolv.conf && "
    "$B mount --bind /run/sandlot/resolv.conf /etc/resolv.conf; }; }"
)


# The reverse, for a ``proxy`` VM restored from a snapshot of a ``nat`` one.
_NAT_GUEST_UNDO: Final = (
    f"B={GUEST_BUSYBOX}; $B ip route del default 2>/dev/null; "
    "$B umount /etc/resolv.conf 2>/dev/null; true"
)


# Counts every open descriptor of every process except the counting shell itself, with shell
# builtins only (no pipeline whose other half may or may not have started: that raced).
_FD_COUNT_SCRIPT: Final = (
    'cd /proc; n=0; for p in [0-9]*; do [ "$p" = "$$" ] && continue; '
    'for f in "$p"/fd/*; do { [ -e "$f" ] || [ -L "$f" ]; } && n=$((n+1)); done; done; echo "$n"'
)


class GuestAgent(MicrovmState):
    """The connection to a VM's agent and what the backend asks the guest through it."""

    async def _agent(self, ref: str, vm_dir: Path) -> Channel:
        """This process's connection to the VM's agent, opened if needed.

        QEMU's agent socket serves one client at a time, so every user in this process (the
        channels handed out, snapshots, resets) shares one multiplexed connection instead of
        queueing behind each other. Closing a handed-out channel closes it for all; the next
        call here reconnects.
        """
        channel = self._handover.get(ref)
        if channel is not None and not getattr(channel, "closed", False):
            return channel
        channel = await self._open_channel(vm_dir, self._restore_timeout)
        self._handover[ref] = channel
        return channel

    async def _open_channel(
        self, vm_dir: Path, timeout: float, stream: anyio.abc.ByteStream | None = None
    ) -> Channel:
        """Connect to the guest agent (the first attempt on ``stream`` when given, a connection
        made already); returns once its HELLO arrived.

        The handshake is retried on a fresh connection. Our agent takes a HELLO that lands in
        the session of an earlier connection (over virtio-serial the guest cannot tell two host
        connections apart unless it read end-of-file in between) as a new host's, but an older
        agent in a user's image answers it with a protocol error or drops it, and a guest still
        booting has no agent yet. Each retry closes, lets the agent see the hang-up, and says
        HELLO again.
        """
        deadline = anyio.current_time() + timeout
        attempt_timeout = 1.0
        last: Exception | None = None
        while True:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            try:
                if stream is None:
                    stream = await connect_unix(vm_dir / qemu.AGENT_SOCKET)
            except OSError as e:
                if not qemu.is_running(vm_dir):
                    msg = f"microvm {vm_dir.name} exited; console: {serial_tail(vm_dir)}"
                    raise BackendError(msg) from e
                last = e
                await anyio.sleep(0.02)
                continue
            try:
                return await connect_stream(stream, timeout=min(attempt_timeout, remaining))
            except SandboxError as e:
                last = e
            stream = None
            if not qemu.is_running(vm_dir):
                msg = f"microvm {vm_dir.name} exited; console: {serial_tail(vm_dir)}"
                raise BackendError(msg) from last
            attempt_timeout = min(attempt_timeout * 2, 8.0)
            await anyio.sleep(0.05)
        msg = f"the guest agent in {vm_dir.name} did not answer within {timeout:.0f} s: {last}"
        raise SandboxTimeout(msg) from last

    async def _guest_sh(self, channel: Channel, script: str, timeout: float = 30.0) -> str:
        result = await channel.exec(["/bin/sh", "-c", script], timeout=timeout)
        if result.exit_code != 0:
            msg = f"guest command failed (exit {result.exit_code}): {result.stderr.strip()[-300:]}"
            raise BackendError(msg)
        return result.stdout

    async def _fd_count(self, channel: Channel, source: FdSource) -> int:
        """The guest's open descriptors, counted the way ``source`` says."""
        if source == "agent":
            if not serves(channel, "fd.count"):
                msg = "the guest agent does not serve fd.count, which this baseline was made with"
                raise BackendError(msg)
            assert isinstance(channel, AgentChannel)
            return await channel.count_fds()
        out = await self._guest_sh(channel, _FD_COUNT_SCRIPT)
        try:
            return int(out.strip())
        except ValueError:
            msg = f"the guest fd count is not a number: {out!r}"
            raise BackendError(msg) from None

    def _settle_script(self, net_mode: NetMode, *, guest_nat: bool = False) -> str:
        """What a guest needs after a restore: the clock (it resumes from the instant its
        memory was saved) and the ``nat`` guest setup (or its removal from a ``nat`` image)."""
        script = f"date -s @{time.time():.6f} >/dev/null"
        if net_mode == "nat":
            script += f"; {_NAT_GUEST_SETUP}"
        elif guest_nat:
            script += f"; {_NAT_GUEST_UNDO}"
        return f"{{ {script}; }}"

    async def _sync_clock(
        self, channel: Channel, net_mode: NetMode = "none", *, guest_nat: bool = False
    ) -> None:
        if net_mode != "nat" and not guest_nat and serves(channel, "clock.set"):
            # One request the agent answers itself: under TCG, the first programs a restored
            # guest starts cost a few hundred ms of code translation, which a ``date -s`` exec
            # would put on the create path (the caller's first exec pays it only once).
            assert isinstance(channel, AgentChannel)
            await channel.set_clock(time.time())
            return
        await self._guest_sh(channel, self._settle_script(net_mode, guest_nat=guest_nat))


def serves(channel: Channel, op: str) -> bool:
    """Whether ``channel`` is a direct agent connection whose agent serves ``op``."""
    return isinstance(channel, AgentChannel) and op in channel.agent_info.ops


def fd_source_of(channel: Channel) -> FdSource:
    """How a new baseline counts the guest's descriptors: by the agent where it can (no
    program start, so a verified reset stays cheap under TCG)."""
    return "agent" if serves(channel, "fd.count") else "shell"


async def leave_agent_idle(channel: Channel, q: QmpClient, timeout: float = 5.0) -> None:
    """Leave the guest agent waiting for a new host; ``channel`` is of no more use after.

    A memory snapshot must hold such an agent: one still inside our session would take the next
    host's HELLO for a frame of that old session. An agent that serves ``session.detach`` is
    there once it answers, and the connection stays up while the memory is saved: a VM restored
    with its host connected before it runs then sees no hang-up and reconnection (see
    :meth:`~sandlot.backends.microvm.boot.QemuBoot._resume`). An agent without it closes its port when it reads our
    hang-up, which QEMU reports as ``VSERPORT_CHANGE`` (rate-limited to one a second per port,
    so waiting for it can take that long).
    """
    if serves(channel, "session.detach"):
        assert isinstance(channel, AgentChannel)
        await channel.detach()
        return
    await channel.close()
    with anyio.move_on_after(timeout):
        while True:
            event = await q.wait_event("VSERPORT_CHANGE")
            data = event.get("data")
            if (
                isinstance(data, dict)
                and data.get("id") == qemu.AGENT_PORT_ID
                and not data.get("open")
            ):
                return
