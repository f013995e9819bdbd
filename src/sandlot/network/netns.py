"""Kernel plumbing for sandbox networks: namespaces, veth pairs, routes, nftables tables.

This module owns the names derived from a sandbox id (namespace ``sandlot-<id>``, host veth
``slh<tag>``, nftables table ``inet sandlot_<tag>``), the address pool carved into /30s, and
the rule sets for each policy kind. It drives ``ip`` and ``nft`` as subprocesses (root only)
and keeps no state of its own: :mod:`sandlot.network.service` decides and records. Imports
nothing from sandlot but :mod:`sandlot.errors` and :mod:`sandlot.network.policy`.

Named namespaces are made and removed in-process, the way ``ip netns add``/``delete`` does it
(a namespace file under ``/run/netns`` bind-mounted from ``/proc/thread-self/ns/net``, that
directory a shared mount so other mount namespaces see it): every sandbox boot needs one, and
two ``ip`` runs cost about 6 ms of CPU on our machines against 0.3 ms here. The work happens on a
short-lived thread of its own, because a thread that unshared its network namespace must never
go back to a pool where other code would open sockets in the sandbox's namespace. ``ip`` is the
fallback where that fails. The pool's addresses in use are read over rtnetlink in-process
for the same reason (``ip -j addr show`` is the fallback).

Rules in force per kind (the sandbox side is ``eth0`` inside the namespace):

- ``deny-all``: no veth at all; the namespace has only ``lo``. No route to anything.
- allowlist: veth with a /30 and no default route, so every address but the host side is
  "network unreachable"; the table accepts from the veth only TCP to the proxy's address and
  port (plus replies) and drops everything else, IPv4 and IPv6, ICMP included. Nothing is
  forwarded from or to the veth.
- ``allow-all``: veth with a default route via the host side, masquerade to the outside,
  forwarding accepted except to protected ranges (link-local metadata, loopback, multicast, the
  sandbox pool); the host itself is not reachable (input dropped), and nothing from outside
  reaches in except replies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import BackendError, BackendUnavailable, InvalidRequest

__all__ = [
    "DEFAULT_POOL",
    "NETNS_DIR",
    "NetNames",
    "Slot",
    "allow_all_rules",
    "configured_nameserver",
    "configured_pool",
    "create_netns",
    "create_veth",
    "delete_link",
    "delete_netns",
    "delete_table",
    "enable_ip_forward",
    "link_exists",
    "list_kernel_objects",
    "names_for",
    "netns_exists",
    "pool_addresses_in_use",
    "replace_table",
    "restricted_rules",
    "set_default_route",
    "slot",
    "tools_missing",
]

DEFAULT_POOL = "10.213.0.0/16"
NETNS_DIR = Path("/run/netns")


def configured_pool(explicit: str | None = None) -> str:
    """The IPv4 range sandboxes' /30s are carved from (and that rootless sandboxes are fenced
    off from): ``explicit``, else ``$SANDLOT_NETWORK_POOL``, else :data:`DEFAULT_POOL`;
    refused unless it is an IPv4 network."""
    value = explicit or os.environ.get("SANDLOT_NETWORK_POOL") or DEFAULT_POOL
    try:
        net = ipaddress.IPv4Network(value, strict=True)
    except ValueError as e:
        msg = f"SANDLOT_NETWORK_POOL must be an IPv4 network such as {DEFAULT_POOL}, got {value!r} ({e})"
        raise InvalidRequest(msg) from None
    return str(net)


def configured_nameserver(explicit: str | None = None) -> str | None:
    """The ``IP[:PORT]`` egress proxies resolve with: ``explicit``, else
    ``$SANDLOT_NETWORK_NAMESERVER``, else None (the host's resolver); refused unless it is
    one."""
    value = explicit or os.environ.get("SANDLOT_NETWORK_NAMESERVER") or None
    if value is None:
        return None
    host, port = value, ""
    if value.startswith("[") and "]:" in value:  # [IPv6]:PORT
        host, port = value[1:].split("]:", 1)
    elif value.count(":") == 1:  # IPv4:PORT
        host, port = value.split(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        if port and not 0 < int(port) < 65536:
            raise ValueError(port)
    except ValueError:
        msg = f"SANDLOT_NETWORK_NAMESERVER must be IP or IP:PORT (such as 127.0.0.53:53), got {value!r}"
        raise InvalidRequest(msg) from None
    return value


NETNS_PREFIX = "sandlot-"
LINK_PREFIX = "slh"
TABLE_PREFIX = "sandlot_"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")


@dataclass(frozen=True)
class NetNames:
    """Kernel object names of one sandbox, derived from its id alone (so a retry finds them)."""

    netns: str
    host_if: str
    sandbox_if: str
    table: str

    @property
    def netns_path(self) -> str:
        """The namespace file an OCI config joins."""
        return str(NETNS_DIR / self.netns)


def names_for(sandbox_id: str) -> NetNames:
    """The names for a sandbox id."""
    tag = hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]
    ns = sandbox_id if _SAFE_ID.match(sandbox_id) else tag
    return NetNames(
        netns=f"{NETNS_PREFIX}{ns}",
        host_if=f"{LINK_PREFIX}{tag}",  # IFNAMSIZ: 15 characters at most
        sandbox_if="eth0",
        table=f"{TABLE_PREFIX}{tag}",
    )


@dataclass(frozen=True)
class Slot:
    """One /30 of the pool: network, host side (.1), sandbox side (.2)."""

    index: int
    host: str
    sandbox: str
    prefixlen: int = 30


def slot(pool: str, index: int) -> Slot:
    """The ``index``-th /30 of ``pool`` (index 0 is skipped by callers: it holds the pool's
    network address, which some tools treat specially)."""
    net = ipaddress.IPv4Network(pool)
    base = int(net.network_address) + 4 * index
    if base + 3 > int(net.broadcast_address):
        msg = f"address pool {pool} exhausted"
        raise BackendError(msg)
    return Slot(index, str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2)))


_TOOLS_FOUND = False


def tools_missing() -> list[str]:
    """Which of ``ip`` and ``nft`` are not installed."""
    # A found tool stays found; this is asked on every boot.
    global _TOOLS_FOUND
    if _TOOLS_FOUND:
        return []
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    _TOOLS_FOUND = not missing
    return missing


def _run(argv: list[str], stdin: str | None = None, *, ok_errors: tuple[str, ...] = ()) -> str:
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        msg = f"{argv[0]} is not installed (Debian: iproute2, nftables)"
        raise BackendUnavailable(msg) from e
    except subprocess.TimeoutExpired as e:
        msg = f"{' '.join(argv)} timed out"
        raise BackendError(msg) from e
    if p.returncode != 0:
        err = p.stderr.strip()
        if any(s in err for s in ok_errors):
            return ""
        msg = f"{' '.join(argv[:4])} failed: {err}"
        raise BackendError(msg, command=argv, stderr=err)
    return p.stdout


def netns_exists(name: str) -> bool:
    """Whether ``/run/netns/NAME`` exists."""
    return (NETNS_DIR / name).exists()


_CLONE_NEWNET = 0x40000000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _ok(ret: int, what: str) -> None:
    """Raise the C library's errno as an OSError when ``ret`` says a call failed."""
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _on_own_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a new thread that ends with it (see the module docstring) and re-raise."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the caller
            failure.append(e)

    t = threading.Thread(target=target, name="sandlot-netns", daemon=True)
    t.start()
    t.join()
    if failure:
        raise failure[0]


def _lo_up() -> None:
    """Bring ``lo`` up in the calling thread's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _make_run_dir_shared() -> None:
    # As ip(8) does: /run/netns is a shared mount of itself, so a namespace file mounted in it
    # later appears in every mount namespace that has a copy of it.
    NETNS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    path = os.fsencode(NETNS_DIR)
    ret = _libc.mount(b"", path, b"none", _MS_SHARED | _MS_REC, None)
    if ret == 0:
        return
    if ctypes.get_errno() != errno.EINVAL:
        _ok(ret, f"mount --make-rshared {NETNS_DIR}")
    _ok(_libc.mount(path, path, b"none", _MS_BIND | _MS_REC, None), f"mount --rbind {NETNS_DIR}")
    _ok(
        _libc.mount(b"", path, b"none", _MS_SHARED | _MS_REC, None),
        f"mount --make-rshared {NETNS_DIR}",
    )


def _add_netns_inproc(name: str) -> None:
    _make_run_dir_shared()
    target = NETNS_DIR / name
    fd = os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
    os.close(fd)

    def work() -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _ok(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            _lo_up()
            src = os.fsencode(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net")
            _ok(_libc.mount(src, os.fsencode(target), b"none", _MS_BIND, None), f"bind {target}")
        finally:
            # Best effort: the thread ends right after, taking its namespace reference along.
            _libc.setns(home, _CLONE_NEWNET)
            os.close(home)

    try:
        _on_own_thread(work)
    except BaseException:
        with contextlib.suppress(OSError):
            target.unlink()
        raise


def _lo_up_in(name: str) -> None:
    def work() -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        ns = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _ok(_libc.setns(ns, _CLONE_NEWNET), f"setns({name})")
            _lo_up()
        finally:
            _libc.setns(home, _CLONE_NEWNET)
            os.close(ns)
            os.close(home)

    _on_own_thread(work)


def create_netns(name: str) -> None:
    """Create a named namespace with ``lo`` up (an existing one is kept)."""
    if not netns_exists(name):
        try:
            _add_netns_inproc(name)
            return
        except FileExistsError:
            pass  # made meanwhile by someone else: bring its lo up below
        except OSError:
            _run(["ip", "netns", "add", name], ok_errors=("File exists",))
    try:
        _lo_up_in(name)
    except OSError:
        _run(["ip", "-n", name, "link", "set", "lo", "up"])


def delete_netns(name: str) -> None:
    """Delete a named namespace (missing is fine)."""
    if not netns_exists(name):
        return
    target = NETNS_DIR / name
    # Lazily, as ip(8) does: a sandbox still starting may hold it; it goes with the last user.
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0 and ctypes.get_errno() not in (
        errno.EINVAL,
        errno.ENOENT,
    ):
        _run(["ip", "netns", "delete", name], ok_errors=("No such file",))
        return
    with contextlib.suppress(FileNotFoundError):
        target.unlink()


def link_exists(name: str) -> bool:
    """Whether an interface of that name exists in the host namespace."""
    return Path("/sys/class/net", name).exists()


def create_veth(names: NetNames, s: Slot, via: str | None = None) -> None:
    """A veth pair: host side ``names.host_if`` with ``s.host``, sandbox side ``eth0`` inside
    the namespace with ``s.sandbox``; both up, and a default route via ``via`` when given.

    Two ``ip`` runs, one per side, each a batch: every sandbox boot with a veth pays for
    them (about 3 ms of CPU each here) under the host-wide network lock, which serializes
    boots, so four runs were twice the wait of a fork into many sandboxes.
    """
    _run(
        ["ip", "-batch", "-"],
        f"link add {names.host_if} type veth peer name {names.sandbox_if} netns {names.netns}\n"
        f"addr add {s.host}/{s.prefixlen} dev {names.host_if}\n"
        f"link set {names.host_if} up\n",
    )
    route = f"route replace default via {via}\n" if via is not None else ""
    _run(
        ["ip", "-n", names.netns, "-batch", "-"],
        f"addr add {s.sandbox}/{s.prefixlen} dev {names.sandbox_if}\n"
        f"link set {names.sandbox_if} up\n{route}",
    )


def delete_link(name: str) -> None:
    """Delete a host interface (its veth peer goes with it); missing is fine."""
    if link_exists(name):
        _run(["ip", "link", "delete", name], ok_errors=("Cannot find device",))


def set_default_route(names: NetNames, via: str | None) -> None:
    """Point the namespace's default route at ``via``, or remove it (None)."""
    if via is None:
        _run(["ip", "-n", names.netns, "route", "flush", "default"], ok_errors=("Cannot find",))
    else:
        _run(["ip", "-n", names.netns, "route", "replace", "default", "via", via])


def restricted_rules(names: NetNames, s: Slot, proxy_port: int) -> str:
    """The allowlist table: from the veth, only the proxy's port on the host side."""
    i = names.host_if
    return f"""table inet {names.table} {{
    chain input {{
        type filter hook input priority filter - 10; policy accept;
        iifname "{i}" ip saddr {s.sandbox} ip daddr {s.host} tcp dport {proxy_port} accept
        iifname "{i}" ct state established,related accept
        iifname "{i}" drop
    }}
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        iifname "{i}" drop
        oifname "{i}" drop
    }}
}}
"""


def allow_all_rules(names: NetNames, s: Slot, pool: str) -> str:
    """The allow-all table: NAT out, but not to the host, metadata, loopback or sandboxes."""
    i = names.host_if
    protected = f"0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/4, {pool}"
    return f"""table inet {names.table} {{
    chain input {{
        type filter hook input priority filter - 10; policy accept;
        iifname "{i}" ct state established,related accept
        iifname "{i}" drop
    }}
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        oifname "{i}" ct state established,related accept
        oifname "{i}" drop
        iifname "{i}" meta nfproto ipv6 drop
        iifname "{i}" ip daddr {{ {protected} }} drop
        iifname "{i}" accept
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {s.sandbox} oifname != "{i}" masquerade
    }}
}}
"""


def replace_table(table: str, rules: str) -> None:
    """Install ``rules`` as table ``inet TABLE`` in one transaction (replacing any old one)."""
    _run(["nft", "-f", "-"], f"table inet {table} {{}}\ndelete table inet {table}\n{rules}")


def delete_table(table: str) -> None:
    """Delete table ``inet TABLE`` (missing is fine)."""
    _run(["nft", "-f", "-"], f"table inet {table} {{}}\ndelete table inet {table}\n")


def pool_addresses_in_use(pool: str) -> set[str]:
    """IPv4 addresses of the pool assigned to host interfaces (by any sandlot home)."""
    net = ipaddress.IPv4Network(pool)
    try:
        found = _ipv4_addresses()
    except OSError:
        found = [
            str(a.get("local"))
            for link in json.loads(_run(["ip", "-j", "-4", "addr", "show"]) or "[]")
            for a in link.get("addr_info", [])
            if a.get("local")
        ]
    return {a for a in found if ipaddress.IPv4Address(a) in net}


_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_RTM_NEWADDR = 20
_RTM_GETADDR = 22
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLM_F_DUMP_INTR = 0x10
_IFA_ADDRESS = 1
_IFA_LOCAL = 2


def _ipv4_addresses() -> list[str]:
    """The host namespace's IPv4 interface addresses, read over rtnetlink.

    What ``ip -j -4 addr show`` reports as ``local``, without a program start per sandbox
    boot (its output also grows with every sandbox that has a veth).
    """
    out: list[str] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(10.0)
        # struct nlmsghdr, then struct ifaddrmsg asking for AF_INET.
        req = struct.pack("=IHHII", 24, _RTM_GETADDR, _NLM_F_REQUEST_DUMP, 1, 0)
        sock.sendto(req + struct.pack("=BBBBI", socket.AF_INET, 0, 0, 0, 0), (0, 0))
        while True:
            data = sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, kind, flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
                if length < 16:
                    raise OSError(errno.EPROTO, "short netlink message")
                if flags & _NLM_F_DUMP_INTR:
                    # Addresses changed during the dump, which may then miss some: the
                    # caller falls back to ``ip``, which reads a consistent list.
                    raise OSError(errno.EAGAIN, "address dump interrupted")
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    code = struct.unpack_from("=i", data, off + 16)[0]
                    raise OSError(-code, f"RTM_GETADDR: {os.strerror(-code)}")
                if kind == _RTM_NEWADDR:
                    local = address = None
                    pos, end = off + 24, off + length
                    while pos + 4 <= end:
                        alen, atype = struct.unpack_from("=HH", data, pos)
                        if alen < 4:
                            break
                        if atype in (_IFA_LOCAL, _IFA_ADDRESS) and alen == 8:
                            value = socket.inet_ntoa(data[pos + 4 : pos + 8])
                            if atype == _IFA_LOCAL:
                                local = value
                            else:
                                address = value
                        pos += (alen + 3) & ~3
                    if local or address:
                        out.append(local or address or "")
                off += (length + 3) & ~3


def enable_ip_forward() -> bool:
    """Turn on IPv4 forwarding (host-wide!); True if it was off."""
    p = Path("/proc/sys/net/ipv4/ip_forward")
    if p.read_text().strip() == "1":
        return False
    p.write_text("1\n")
    return True


def list_kernel_objects() -> tuple[set[str], set[str], set[str]]:
    """sandlot's namespaces, host veths and nftables tables that exist now."""
    nss = {p.name for p in NETNS_DIR.glob(f"{NETNS_PREFIX}*")} if NETNS_DIR.exists() else set()
    links = {p.name for p in Path("/sys/class/net").glob(f"{LINK_PREFIX}*")}
    tables: set[str] = set()
    out = _run(["nft", "-j", "list", "tables"])
    for item in json.loads(out or "{}").get("nftables", []):
        t = item.get("table")
        if t and str(t.get("name", "")).startswith(TABLE_PREFIX):
            tables.add(str(t["name"]))
    return nss, links, tables
