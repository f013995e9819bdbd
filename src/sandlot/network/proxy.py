"""The host-side egress proxy: the data path of a sandbox's outbound network.

:class:`EgressProxy` serves HTTP absolute-form requests and ``CONNECT`` tunnels, checked by host
name and by resolved address, TLS end to end (a tunnel's ClientHello must name the host that
was allowed); it listens on the host side of a sandbox's veth, or on a unix socket for a sandbox
that has no veth, such as a microVM whose user-mode network forwards the proxy address to that
socket. The network daemon (:mod:`sandlot.network.netd`) hosts one per sandbox, next to its port
forwarders (:mod:`sandlot.network.portforward`).

The daemon must stay cheap in memory, so this module imports only the stdlib and
:mod:`sandlot.network.policy` / :mod:`sandlot.network.dns` (no pydantic, no models).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, final
from urllib.parse import urlsplit

from sandlot.network.dns import ResolveError, Resolver, SystemResolver
from sandlot.network.policy import (
    CompiledPolicy,
    EgressEvent,
    HostFacts,
    IPAddress,
    IPNetwork,
    Verdict,
    normalize_host,
    parse_ip,
)

__all__ = [
    "EgressProxy",
    "LocalAddresses",
    "client_hello_sni",
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
