"""The host-side egress proxy, the port forwarder, and the daemon that runs them detached.

This module owns the data path of a sandbox's network: :class:`EgressProxy` (HTTP absolute-form
requests and ``CONNECT`` tunnels, checked by host name and by resolved address, TLS end to end;
listening on the host side of a sandbox's veth, or on a unix socket for a sandbox that has no
veth, such as a microVM whose user-mode network forwards the proxy address to that socket),
:class:`PortForwarder` (a host port into a port on the sandbox's own loopback, through its
network namespace) and :class:`NetDaemon`, which hosts both for every sandbox of one state
directory in a single small process that outlives the CLI (``python -m sandlot.network.proxy
--config FILE``). The supervisor in :mod:`sandlot.network.service` starts, checks and stops it.

The daemon reads per-sandbox state files written by the supervisor and never writes them; it
answers on a unix control socket. It must stay cheap in memory, so this module imports only the
stdlib and :mod:`sandlot.network.policy` / :mod:`sandlot.network.dns` (no pydantic, no models).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, final
from urllib.parse import urlsplit

from sandlot.network.dns import NameserverResolver, ResolveError, Resolver, SystemResolver
from sandlot.network.policy import (
    CompiledPolicy,
    EgressEvent,
    HostFacts,
    IPAddress,
    IPNetwork,
    Verdict,
    compile_policy,
    normalize_host,
    parse_ip,
)

__all__ = [
    "EgressProxy",
    "LocalAddresses",
    "NetDaemon",
    "PortForwarder",
    "client_hello_sni",
    "main",
]

EventCallback = Callable[[EgressEvent], None]

_HEAD_LIMIT = 64 * 1024
_HEAD_TIMEOUT = 30.0
_CONNECT_TIMEOUT = 10.0
_CHUNK = 64 * 1024
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
    }
)


@final
class LocalAddresses:
    """The host's own addresses, read from ``/proc`` and cached for a moment.

    A sandbox must never reach the host through the proxy, whichever of its addresses a name
    resolves to; interfaces come and go (other sandboxes' veths), so the set is re-read at most
    every ``ttl`` seconds.
    """

    def __init__(self, ttl: float = 2.0) -> None:
        """Args:
        ttl: seconds a reading stays valid.
        """
        self._ttl = ttl
        self._at = -1e9
        self._cached: frozenset[IPAddress] = frozenset()

    def get(self) -> frozenset[IPAddress]:
        """The current set."""
        now = time.monotonic()
        if now - self._at > self._ttl:
            self._cached = frozenset(_read_local_addresses())
            self._at = now
        return self._cached


def _read_local_addresses() -> set[IPAddress]:
    out: set[IPAddress] = set()
    with contextlib.suppress(OSError):
        last: str | None = None
        with open("/proc/net/fib_trie") as f:
            for line in f:
                s = line.strip()
                if s.startswith("|--"):
                    last = s[3:].strip()
                elif last is not None and s.startswith("/32 host LOCAL"):
                    a = parse_ip(last)
                    if a is not None:
                        out.add(a)
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            raw = line.split()[0] if line.strip() else ""
            if len(raw) == 32:
                out.add(ipaddress.IPv6Address(bytes.fromhex(raw)))
    return out


class _Refused(Exception):
    def __init__(self, status: int, verdict: Verdict, addresses: list[str] | None = None) -> None:
        super().__init__(verdict.reason)
        self.status = status
        self.verdict = verdict
        self.addresses = addresses or []


class _BadRequest(Exception):
    pass


@final
class EgressProxy:
    """One sandbox's egress proxy: a listener on the host side of the sandbox's veth, or on a
    unix socket that only the sandbox's own plumbing connects to (``unix_path``).

    Every connection is decided by the current policy when it is opened; :meth:`update_policy`
    swaps the policy for connections opened afterwards. Events go to the JSONL log (if any)
    and to ``on_event``.
    """

    def __init__(
        self,
        sandbox_id: str,
        policy: CompiledPolicy,
        *,
        listen: str = "127.0.0.1",
        port: int = 0,
        allowed_peer: str | None = None,
        resolver: Resolver | None = None,
        internal_networks: tuple[IPNetwork, ...] = (),
        local_addresses: LocalAddresses | None = None,
        log_path: Path | None = None,
        on_event: EventCallback | None = None,
        connect_timeout: float = _CONNECT_TIMEOUT,
        unix_path: Path | None = None,
    ) -> None:
        """Args:
        sandbox_id: whose proxy this is (stamped on every event).
        policy: the policy in force.
        listen: the address to bind (the host side of the sandbox's veth).
        port: the port to bind (0: any free port).
        allowed_peer: the only client address served (the sandbox side of the veth); None
            serves any client (tests and embedded use only).
        unix_path: listen on this unix socket instead of ``listen``/``port`` (mode 0600; only
            clients running as this process's user are served). Any stale file there is
            replaced, and the file is removed on :meth:`aclose`.
        resolver: how names are resolved (default: the host's resolver).
        internal_networks: other sandboxes' address ranges, never connected to.
        local_addresses: the host's own addresses (shared between proxies in one daemon).
        log_path: the per-sandbox JSONL log, appended to.
        on_event: called with every event, in the event loop; must not block.
        connect_timeout: seconds to wait for an upstream connection.
        """
        self.sandbox_id = sandbox_id
        self._policy = policy
        self._listen = listen
        self._port = port
        self.allowed_peer = allowed_peer
        self._resolver: Resolver = resolver or SystemResolver()
        self._internal = internal_networks
        self._local = local_addresses or LocalAddresses()
        self._log_path = log_path
        self._log: IO[str] | None = None
        self._on_event = on_event
        self._connect_timeout = connect_timeout
        self._unix_path = unix_path
        self._unix_ino: int | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def policy(self) -> CompiledPolicy:
        """The policy new connections are decided by."""
        return self._policy

    @property
    def address(self) -> tuple[str, int]:
        """The bound address and port (after :meth:`start`); a unix listener's is its path and
        port 0."""
        if self._server is None or not self._server.sockets:
            msg = "proxy not started"
            raise RuntimeError(msg)
        if self._unix_path is not None:
            return str(self._unix_path), 0
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    @property
    def unix_path(self) -> Path | None:
        """The unix socket served, or None for a TCP listener."""
        return self._unix_path

    def update_policy(self, policy: CompiledPolicy) -> None:
        """Decide connections opened from now on by ``policy`` (open tunnels are kept)."""
        self._policy = policy

    async def start(self) -> None:
        """Bind and start serving."""
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            # One short append per connection to a local file: not worth a thread hop.
            self._log = open(self._log_path, "a", buffering=1, encoding="utf-8")  # noqa: ASYNC230, SIM115
        if self._unix_path is not None:
            sock = bind_unix(self._unix_path)
            self._unix_ino = _ino(self._unix_path)
            self._server = await asyncio.start_unix_server(
                self._serve, sock=sock, limit=_HEAD_LIMIT
            )
            return
        try:
            self._server = await asyncio.start_server(
                self._serve, self._listen, self._port, limit=_HEAD_LIMIT, reuse_address=True
            )
        except OSError:
            if self._port == 0:
                raise
            # Someone holds the port on a wildcard address; any port on ours will do.
            self._server = await asyncio.start_server(
                self._serve, self._listen, 0, limit=_HEAD_LIMIT, reuse_address=True
            )

    async def aclose(self) -> None:
        """Stop listening and cut every open connection (a unix socket file is removed)."""
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        if self._unix_path is not None and self._unix_ino is not None:
            # Only our own file: a listener started since on the same path keeps its socket.
            if _ino(self._unix_path) == self._unix_ino:
                with contextlib.suppress(OSError):
                    self._unix_path.unlink()
            self._unix_ino = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _emit(self, event: EgressEvent) -> None:
        if self._log is not None:
            try:
                self._log.write(json.dumps(event.to_json(), separators=(",", ":")) + "\n")
            except OSError as e:
                print(f"sandlot-netd: cannot write egress log: {e}", file=sys.stderr)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception as e:  # a broken observer must not take the data path down
                print(f"sandlot-netd: on_event failed: {e!r}", file=sys.stderr)

    def _event(
        self, host: str, port: int, method: str, verdict: Verdict, **kw: object
    ) -> EgressEvent:
        return EgressEvent(
            sandbox_id=self.sandbox_id,
            host=host,
            port=port,
            method=method,
            decision="allow" if verdict.allowed else "deny",
            reason=verdict.reason,
            record=self._policy.record,
            **kw,  # type: ignore[arg-type]
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self._unix_path is not None:
            uid = _peer_uid(writer)
            if uid != os.getuid():
                # The file mode already keeps other users out; this holds even if it was changed.
                self._emit(
                    self._event(
                        "", 0, "", Verdict(False, "foreign_client"), addresses=[f"uid {uid}"]
                    )
                )
                return
        elif self.allowed_peer is not None and (not peer or peer[0] != self.allowed_peer):
            # Anyone else on the host who finds the port gets nothing, not even an error page.
            self._emit(
                self._event("", 0, "", Verdict(False, "foreign_client"), addresses=[str(peer)])
            )
            return
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            method, target, headers = _parse_head(head)
            if method == "CONNECT":
                host, port = _split_authority(target, None)
                path = ""
            else:
                host, port, path = _split_url(target)
        except (_BadRequest, ValueError, asyncio.LimitOverrunError) as e:
            await _reply(writer, 400, f"sandlot egress proxy: bad request ({e})")
            return
        policy = self._policy
        try:
            upstream, address, usable = await self._open(policy, host, port)
        except _Refused as r:
            self._emit(self._event(host, port, method, r.verdict, addresses=r.addresses))
            await _reply(
                writer,
                r.status,
                f"sandlot: egress to {host}:{port} refused ({r.verdict.reason})",
                reason=r.verdict.reason,
            )
            return
        up_reader, up_writer = upstream
        verdict = Verdict(True, self._allow_reason(policy, host, address))
        counts = [0, 0]
        try:
            if method == "CONNECT":
                self._emit(
                    self._event(host, port, method, verdict, addresses=usable, address=str(address))
                )
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                try:
                    await _relay(reader, writer, up_reader, up_writer, counts, gate=_sni_gate(host))
                except _SniMismatch as e:
                    self._emit(
                        self._event(
                            host,
                            port,
                            method,
                            Verdict(False, "sni_mismatch"),
                            addresses=[e.sni],
                            address=str(address),
                        )
                    )
            else:
                self._emit(
                    self._event(host, port, method, verdict, addresses=usable, address=str(address))
                )
                await self._forward_http(
                    reader, writer, up_reader, up_writer, method, path, host, port, headers, counts
                )
        finally:
            up_writer.close()
            closing = self._event(host, port, method, verdict, address=str(address))
            closing.phase = "close"
            closing.bytes_up, closing.bytes_down = counts
            self._emit(closing)

    def _allow_reason(self, policy: CompiledPolicy, host: str, address: IPAddress) -> str:
        facts = HostFacts(self._local.get(), self._internal)
        name = normalize_host(host)
        listed = name is not None and parse_ip(host) is None and policy.domain_listed(name)
        return policy.check_address(address, facts, via_listed_name=listed).reason

    async def _open(
        self, policy: CompiledPolicy, host: str, port: int
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], IPAddress, list[str]]:
        facts = HostFacts(self._local.get(), self._internal)
        literal = parse_ip(host)
        if literal is not None:
            v = policy.check_address(literal, facts)
            if not v.allowed:
                raise _Refused(403, v, [str(literal)])
            usable = [literal]
        else:
            pre = policy.check_name(host)
            if not pre.allowed:
                raise _Refused(403, pre)
            try:
                resolved = await self._resolver.resolve(normalize_host(host) or host)
            except ResolveError:
                raise _Refused(502, Verdict(False, "resolve_failed")) from None
            usable, v = policy.check_resolved(host, resolved, facts)
            if not v.allowed:
                raise _Refused(403, v, [str(a) for a in resolved])
        # Connect to exactly the addresses just checked: never resolve again (DNS rebinding).
        for addr in usable:
            try:
                async with asyncio.timeout(self._connect_timeout):
                    conn = await asyncio.open_connection(str(addr), port, limit=_HEAD_LIMIT)
            except (OSError, TimeoutError):
                continue
            return conn, addr, [str(a) for a in usable]
        raise _Refused(502, Verdict(False, "connect_failed"), [str(a) for a in usable])

    async def _forward_http(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        method: str,
        path: str,
        host: str,
        port: int,
        headers: list[tuple[str, str]],
        counts: list[int],
    ) -> None:
        dropped = set(_HOP_BY_HOP)
        for name, value in headers:
            if name.lower() == "connection":
                dropped.update(t.strip().lower() for t in value.split(","))
        kept = [(n, v) for n, v in headers if n.lower() not in dropped and n.lower() != "host"]
        te = [v for n, v in headers if n.lower() == "transfer-encoding"]
        cl = [v for n, v in headers if n.lower() == "content-length"]
        if (te and cl) or len(cl) > 1:
            await _reply(writer, 400, "sandlot egress proxy: ambiguous request body framing")
            return
        authority = f"[{host}]" if ":" in host else host
        if port != 80:
            authority = f"{authority}:{port}"
        # The URL's authority is what the policy checked, so it is also the Host the origin
        # sees: a client cannot name one server to the proxy and another to the origin.
        lines = [f"{method} {path} HTTP/1.1", f"Host: {authority}"]
        lines += [f"{n}: {v}" for n, v in kept]
        lines.append("Connection: close")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        up_writer.write(data)
        counts[0] += len(data)
        body = asyncio.ensure_future(_copy_body(reader, up_writer, te, cl, counts))
        try:
            while chunk := await up_reader.read(_CHUNK):
                counts[1] += len(chunk)
                writer.write(chunk)
                await writer.drain()
        finally:
            body.cancel()
            with contextlib.suppress(BaseException):
                await body


_SUN_PATH_MAX = 107


def bind_unix(path: Path) -> socket.socket:
    """A unix stream socket bound to ``path`` (mode 0600, any stale file replaced), listening.

    ``sun_path`` holds 107 bytes; a longer path is bound through ``/proc/self/fd`` and a
    descriptor of its directory, which names the same file.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd: int | None = None
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        target = str(path)
        if len(target.encode()) > _SUN_PATH_MAX:
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            target = f"/proc/self/fd/{dir_fd}/{path.name}"
        # The mode is set at creation: a chmod after bind leaves a moment in which another
        # user could connect. The daemon is one thread when this runs.
        old = os.umask(0o177)
        try:
            s.bind(target)
        finally:
            os.umask(old)
        s.listen(128)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return s


def _ino(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None


def _peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


def _parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]]]:
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        msg = "malformed request line"
        raise _BadRequest(msg)
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            msg = "malformed header"
            raise _BadRequest(msg)
        headers.append((name, value.strip()))
    return parts[0].upper(), parts[1], headers


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif authority.count(":") == 1:
        host, _, port_text = authority.partition(":")
    else:
        host, port_text = authority, ""
    if not port_text:
        if default_port is None:
            msg = "CONNECT needs host:port"
            raise _BadRequest(msg)
        return host, default_port
    port = int(port_text)
    if not 0 < port < 65536 or not host:
        msg = "bad authority"
        raise _BadRequest(msg)
    return host, port


def _split_url(target: str) -> tuple[str, int, str]:
    if not target.lower().startswith("http://"):
        msg = "only absolute http:// URLs (use CONNECT for https)"
        raise _BadRequest(msg)
    u = urlsplit(target)
    if u.hostname is None:
        msg = "URL without a host"
        raise _BadRequest(msg)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return u.hostname, u.port or 80, path


async def _reply(
    writer: asyncio.StreamWriter, status: int, text: str, *, reason: str | None = None
) -> None:
    phrase = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}.get(status, "Error")
    body = (text + "\n").encode()
    extra = f"X-Sandlot-Egress: {reason}\r\n" if reason else ""
    writer.write(
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        f"{extra}Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(OSError):
        await writer.drain()


async def _copy_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    te: list[str],
    cl: list[str],
    counts: list[int],
) -> None:
    async def put(data: bytes) -> None:
        counts[0] += len(data)
        writer.write(data)
        await writer.drain()

    if cl:
        left = int(cl[0])
        while left > 0:
            chunk = await reader.read(min(left, _CHUNK))
            if not chunk:
                return
            left -= len(chunk)
            await put(chunk)
    elif te:
        if te[-1].split(",")[-1].strip().lower() != "chunked":
            return
        while True:
            line = await reader.readuntil(b"\r\n")
            await put(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    await put(trailer)
                await put(b"\r\n")
                return
            await put(await reader.readexactly(size + 2))
    # Anything the client sends after its one request is not forwarded: the upstream
    # connection carries exactly the request the policy checked.


class _SniMismatch(Exception):
    def __init__(self, sni: str) -> None:
        super().__init__(sni)
        self.sni = sni


Gate = Callable[[asyncio.StreamReader], Awaitable[bytes]]


def _sni_gate(host: str) -> Gate:
    """Read the client's first TLS record and refuse a ClientHello naming another server.

    Runs only on the client-to-server direction, so protocols where the server speaks first
    still work: their client simply sends nothing until it has read the greeting.
    """

    async def gate(reader: asyncio.StreamReader) -> bytes:
        try:
            first = await reader.readexactly(5)
            if first[0] == 0x16:
                length = int.from_bytes(first[3:5], "big")
                first += await reader.readexactly(min(length, 16 * 1024 + 256))
        except asyncio.IncompleteReadError as e:
            return e.partial
        sni = client_hello_sni(first)
        if sni is not None and parse_ip(host) is None and sni != normalize_host(host):
            raise _SniMismatch(sni)
        return first

    return gate


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    counts: list[int],
    i: int,
    gate: Gate | None = None,
) -> None:
    if gate is not None:
        first = await gate(reader)
        if first:
            counts[i] += len(first)
            writer.write(first)
            await writer.drain()
    while chunk := await reader.read(_CHUNK):
        counts[i] += len(chunk)
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()


async def _relay(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
    counts: list[int],
    *,
    gate: Gate | None = None,
) -> None:
    """Copy both ways until both sides finished (half-closes pass through).

    An error on either side ends both; a :class:`_SniMismatch` from ``gate`` is re-raised.
    """
    up = asyncio.ensure_future(_pipe(a_reader, b_writer, counts, 0, gate))
    down = asyncio.ensure_future(_pipe(b_reader, a_writer, counts, 1))
    try:
        done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
        if any(t.exception() is not None for t in done):
            for t in pending:
                t.cancel()
        elif pending:
            await asyncio.wait(pending)
    finally:
        for t in (up, down):
            t.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
    if up.done() and not up.cancelled() and isinstance(up.exception(), _SniMismatch):
        raise up.exception()  # type: ignore[misc]


def client_hello_sni(record: bytes) -> str | None:
    """The server name a TLS ClientHello asks for, lowercased; None when there is none.

    Reads only the first record: a hello split across records, or anything that is not a
    ClientHello, yields None (and the tunnel is then checked by its CONNECT host alone).
    """
    try:
        if len(record) < 9 or record[0] != 0x16 or record[5] != 0x01:
            return None
        p = 9 + 2 + 32  # record header, handshake header, client_version, random
        p += 1 + record[p]
        p += 2 + int.from_bytes(record[p : p + 2], "big")
        p += 1 + record[p]
        end = p + 2 + int.from_bytes(record[p : p + 2], "big")
        p += 2
        while p + 4 <= min(end, len(record)):
            etype = int.from_bytes(record[p : p + 2], "big")
            elen = int.from_bytes(record[p + 2 : p + 4], "big")
            p += 4
            if etype == 0:
                q = p + 2
                while q + 3 <= p + elen:
                    ntype = record[q]
                    nlen = int.from_bytes(record[q + 1 : q + 3], "big")
                    if ntype == 0:
                        return record[q + 3 : q + 3 + nlen].decode("ascii").rstrip(".").lower()
                    q += 3 + nlen
                return None
            p += elen
    except (IndexError, UnicodeDecodeError):
        return None
    return None


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
    """``python -m sandlot.network.proxy --config FILE [--daemonize]``.

    The config is JSON: ``{"state_dir": …, "nameserver": "IP[:PORT]" | null,
    "internal_networks": ["10.213.0.0/16"]}``. With ``--daemonize`` the process forks, the child
    leaves the session, and the parent exits 0 printing the daemon's pid once it serves (1 if
    it failed to start); the caller thus never has a child left to reap.
    """
    parser = argparse.ArgumentParser(prog="python -m sandlot.network.proxy")
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
