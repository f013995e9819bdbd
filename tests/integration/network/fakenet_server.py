"""A small fake internet, run inside its own network namespace by the test fixtures.

HTTP on :80 and HTTPS on :443 on every address of the namespace (each response names the Host
asked for and the address that answered), and a DNS server on :53/udp answering A queries from
a zone file and logging every query name (so a test can prove a name was never looked up).

Usage: python fakenet_server.py CONFIG.json   (prints "ready" once every socket is bound)
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import sys
from pathlib import Path


def read_name(msg: bytes, off: int) -> tuple[str, int]:
    labels = []
    while msg[off]:
        n = msg[off]
        labels.append(msg[off + 1 : off + 1 + n].decode("ascii"))
        off += 1 + n
    return ".".join(labels), off + 1


def answer(query: bytes, zone: dict[str, list[str]]) -> bytes:
    qid, _flags = struct.unpack("!HH", query[:4])
    name, end = read_name(query, 12)
    qtype, _qclass = struct.unpack("!HH", query[end : end + 4])
    question = query[12 : end + 4]
    key = name.lower().rstrip(".")
    if key not in zone:
        return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
    records = b""
    count = 0
    for addr in zone[key]:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in addr else socket.AF_INET, addr)
        rtype = 28 if len(packed) == 16 else 1
        if rtype == qtype:
            records += struct.pack("!HHHIH", 0xC00C, rtype, 1, 5, len(packed)) + packed
            count += 1
    return struct.pack("!HHHHHH", qid, 0x8180, 1, count, 0, 0) + question + records


class Dns(asyncio.DatagramProtocol):
    def __init__(self, zone: dict[str, list[str]], log: Path) -> None:
        self.zone = zone
        self.log = log
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            name, _ = read_name(data, 12)
            with open(self.log, "a") as f:
                f.write(name.lower() + "\n")
            assert self.transport is not None
            self.transport.sendto(answer(data, self.zone), addr)
        except Exception as e:
            print(f"dns: {e!r}", file=sys.stderr)


async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        host = next(
            (ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("host:")), ""
        )
        length = next(
            (int(ln.split(":", 1)[1]) for ln in lines if ln.lower().startswith("content-length:")),
            0,
        )
        body_in = await reader.readexactly(length) if length else b""
        local = writer.get_extra_info("sockname")[0]
        tls = "https" if writer.get_extra_info("sslcontext") is not None else "http"
        body = f"{tls} {host} at {local} got {len(body_in)} {lines[0]}\n".encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def main(config: dict) -> None:
    loop = asyncio.get_running_loop()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config["cert"], config["key"])
    await asyncio.start_server(http, "0.0.0.0", 80)
    await asyncio.start_server(http, "0.0.0.0", 443, ssl=ctx)
    # Bound to its own address: a reply from 0.0.0.0 would leave with the veth's source address
    # and a connected resolver socket would drop it.
    await loop.create_datagram_endpoint(
        lambda: Dns(config["zone"], Path(config["dns_log"])), local_addr=(config["dns"], 53)
    )
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
