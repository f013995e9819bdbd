"""A host port into a port on a sandbox's own loopback, through its network namespace.

:class:`PortForwarder` accepts on the host and connects from inside the sandbox's namespace
(:func:`socket_in_netns`). Hosted by the network daemon (:mod:`sandlot.network.netd`); like it,
this imports only the stdlib and :mod:`sandlot.network.proxy`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from typing import final

from sandlot.network.proxy import (
    _CONNECT_TIMEOUT,
    _relay,
)

__all__ = ["PortForwarder", "socket_in_netns"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def socket_in_netns(netns_path: str, family: socket.AddressFamily) -> socket.socket:
    """A new non-blocking TCP socket that lives in another network namespace.

    Only the calling thread switches namespace, and only while the socket is created; the
    socket stays in the namespace it was created in. The namespace file is opened per call and
    closed at once, so the daemon never pins a namespace that teardown deletes.
    """
    target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        finally:
            try:
                _setns(own)
            except OSError:
                # Staying in the sandbox's namespace would put every later socket there.
                os._exit(70)
        s.setblocking(False)
        return s
    finally:
        os.close(target)
        os.close(own)


@final
class PortForwarder:
    """A host listener whose connections go to a port on a sandbox's own loopback.

    The upstream socket is made inside the sandbox's network namespace, so it works whatever
    the policy (deny-all sandboxes have only loopback) and needs no firewall hole.
    """

    def __init__(
        self, netns_path: str, port: int, host: str = "127.0.0.1", host_port: int = 0
    ) -> None:
        """Args:
        netns_path: the sandbox's namespace file (``/run/netns/NAME``).
        port: the port inside the sandbox.
        host: the host address to listen on.
        host_port: the host port wanted (0, or taken: any free port).
        """
        self.netns_path = netns_path
        self.port = port
        self.host = host
        self._want = host_port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def host_port(self) -> int:
        """The host port actually bound."""
        if self._server is None or not self._server.sockets:
            return 0
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind (the wanted port if free, else any) and serve."""
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self._want, reuse_address=True
            )
        except OSError:
            if self._want == 0:
                raise
            self._server = await asyncio.start_server(self._serve, self.host, 0)

    async def aclose(self) -> None:
        """Stop listening and cut open connections."""
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            upstream = await self._connect()
            if upstream is None:
                return
            await _relay(reader, writer, *upstream, [0, 0])
            upstream[1].close()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                s = socket_in_netns(self.netns_path, family)
            except OSError:
                return None
            try:
                async with asyncio.timeout(_CONNECT_TIMEOUT):
                    await loop.sock_connect(s, (addr, self.port))
            except (OSError, TimeoutError):
                s.close()
                continue
            return await asyncio.open_connection(sock=s)
        return None
