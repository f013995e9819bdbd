"""Name resolution for the egress proxy: the host's resolver, or one configured nameserver.

This module owns the :class:`Resolver` protocol and its two implementations, plus the few
DNS wire-format routines a stub resolver needs (RFC 1035: one question, A and AAAA answers,
compression pointers, TCP retry when truncated). The proxy calls a resolver only for names the
policy could allow, so nothing here decides anything. Stdlib only; imports nothing from sandlot
but :mod:`sandlot.network.policy`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import struct
from typing import Protocol, final

from sandlot.network.policy import IPAddress, parse_ip

__all__ = [
    "NameserverResolver",
    "ResolveError",
    "Resolver",
    "SystemResolver",
    "encode_name",
    "parse_response",
]

TYPE_A = 1
TYPE_AAAA = 28


class ResolveError(Exception):
    """A name did not resolve (no such name, no answer, or the server failed)."""


class Resolver(Protocol):
    """Turns a host name into addresses."""

    async def resolve(self, host: str) -> list[IPAddress]:
        """Every A and AAAA address of ``host`` (raises :class:`ResolveError`)."""
        ...


@final
class SystemResolver:
    """The host's own resolver (``getaddrinfo``: ``/etc/hosts``, then ``resolv.conf``)."""

    async def resolve(self, host: str) -> list[IPAddress]:
        """Resolve with ``getaddrinfo`` in the loop's executor."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            msg = f"{host}: {e}"
            raise ResolveError(msg) from e
        out: list[IPAddress] = []
        for _family, _type, _proto, _canon, sockaddr in infos:
            a = parse_ip(str(sockaddr[0]).split("%", 1)[0])
            if a is not None and a not in out:
                out.append(a)
        if not out:
            msg = f"{host}: no address"
            raise ResolveError(msg)
        return out


def encode_name(name: str) -> bytes:
    """A domain name in DNS wire format (length-prefixed labels, no compression)."""
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            msg = f"bad DNS label in {name!r}"
            raise ValueError(msg)
        out += bytes([len(raw)]) + raw
    return bytes(out + b"\x00")


def _query(qid: int, name: str, qtype: int) -> bytes:
    return (
        struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
        + encode_name(name)
        + struct.pack("!HH", qtype, 1)
    )


def _skip_name(msg: bytes, off: int) -> int:
    while True:
        if off >= len(msg):
            msg_0 = "truncated name"
            raise ResolveError(msg_0)
        n = msg[off]
        if n == 0:
            return off + 1
        if n & 0xC0 == 0xC0:
            return off + 2
        off += 1 + n


def parse_response(msg: bytes, qid: int) -> tuple[list[IPAddress], bool]:
    """The A/AAAA addresses of a response and whether it was truncated (TC bit).

    Raises:
        ResolveError: wrong id, not a response, or an error rcode (NXDOMAIN, SERVFAIL, …).
    """
    if len(msg) < 12:
        msg_0 = "short DNS message"
        raise ResolveError(msg_0)
    rid, flags, qd, an, _ns, _ar = struct.unpack("!HHHHHH", msg[:12])
    if rid != qid or not flags & 0x8000:
        msg_0 = "unexpected DNS message"
        raise ResolveError(msg_0)
    truncated = bool(flags & 0x0200)
    rcode = flags & 0x000F
    if rcode == 3:
        msg_0 = "no such name"
        raise ResolveError(msg_0)
    if rcode != 0:
        msg_0 = f"DNS error rcode {rcode}"
        raise ResolveError(msg_0)
    off = 12
    for _ in range(qd):
        off = _skip_name(msg, off) + 4
    out: list[IPAddress] = []
    for _ in range(an):
        off = _skip_name(msg, off)
        if off + 10 > len(msg):
            msg_0 = "truncated answer"
            raise ResolveError(msg_0)
        rtype, _cls, _ttl, rdlen = struct.unpack("!HHIH", msg[off : off + 10])
        off += 10
        rdata = msg[off : off + rdlen]
        off += rdlen
        if rtype == TYPE_A and rdlen == 4:
            out.append(ipaddress.IPv4Address(rdata))
        elif rtype == TYPE_AAAA and rdlen == 16:
            out.append(ipaddress.IPv6Address(rdata))
    return out, truncated


class _Datagram(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.replies: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        self.replies.put_nowait(data)


@final
class NameserverResolver:
    """Asks one nameserver directly over UDP (TCP when the answer is truncated).

    Used when the proxy must not depend on the host's resolver configuration, and by the tests,
    which point it at a fake internet's DNS server.
    """

    def __init__(
        self, server: str, port: int = 53, *, timeout: float = 2.0, tries: int = 2
    ) -> None:
        """Args:
        server: the nameserver's IP address.
        port: its port.
        timeout: seconds to wait for one answer.
        tries: attempts per query over UDP.
        """
        self._addr = (server, port)
        self._family = socket.AF_INET6 if ":" in server else socket.AF_INET
        self._timeout = timeout
        self._tries = tries

    async def resolve(self, host: str) -> list[IPAddress]:
        """A and AAAA queries in parallel; their answers merged (A first)."""
        results = await asyncio.gather(
            self._one(host, TYPE_A), self._one(host, TYPE_AAAA), return_exceptions=True
        )
        out: list[IPAddress] = []
        errors: list[BaseException] = []
        for r in results:
            if isinstance(r, BaseException):
                errors.append(r)
            else:
                out.extend(a for a in r if a not in out)
        if out:
            return out
        if errors:
            msg = f"{host}: {errors[0]}"
            raise ResolveError(msg)
        msg = f"{host}: no address"
        raise ResolveError(msg)

    async def _one(self, host: str, qtype: int) -> list[IPAddress]:
        qid = secrets.randbits(16)
        try:
            query = _query(qid, host, qtype)
        except (ValueError, UnicodeError) as e:
            raise ResolveError(str(e)) from e
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_datagram_endpoint(
            _Datagram, remote_addr=self._addr, family=self._family
        )
        try:
            for _ in range(self._tries):
                transport.sendto(query)
                try:
                    async with asyncio.timeout(self._timeout):
                        while True:
                            reply = await proto.replies.get()
                            # A stray or spoofed datagram is skipped; an error rcode is an answer.
                            if len(reply) < 12 or struct.unpack("!H", reply[:2])[0] != qid:
                                continue
                            addrs, truncated = parse_response(reply, qid)
                            if truncated:
                                return await self._tcp(query, qid)
                            return addrs
                except TimeoutError:
                    continue
        finally:
            transport.close()
        msg = "nameserver did not answer"
        raise ResolveError(msg)

    async def _tcp(self, query: bytes, qid: int) -> list[IPAddress]:
        async with asyncio.timeout(self._timeout):
            reader, writer = await asyncio.open_connection(*self._addr)
            try:
                writer.write(struct.pack("!H", len(query)) + query)
                await writer.drain()
                (n,) = struct.unpack("!H", await reader.readexactly(2))
                addrs, _ = parse_response(await reader.readexactly(n), qid)
                return addrs
            finally:
                writer.close()
