"""Kernel plumbing for sandbox networks: namespaces, veth pairs, routes, nftables tables.

This module owns the names derived from a sandbox id (namespace ``sandlot-<id>``, host veth
``slh<tag>``, nftables table ``inet sandlot_<tag>``), the address pool carved into /30s, and
the rule sets for each policy kind. It drives ``ip`` and ``nft`` as subprocesses (root only)
and keeps no state of its own: :mod:`sandlot.network.service` decides and records. Imports
nothing from sandlot but :mod:`sandlot.errors` and :mod:`sandlot.network.policy`.

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

import hashlib
import ipaddress
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import BackendError, BackendUnavailable

__all__ = [
    "DEFAULT_POOL",
    "NETNS_DIR",
    "NetNames",
    "Slot",
    "allow_all_rules",
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


def tools_missing() -> list[str]:
    """Which of ``ip`` and ``nft`` are not installed."""
    return [t for t in ("ip", "nft") if shutil.which(t) is None]


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


def create_netns(name: str) -> None:
    """Create a named namespace with ``lo`` up (an existing one is kept)."""
    if not netns_exists(name):
        _run(["ip", "netns", "add", name], ok_errors=("File exists",))
    _run(["ip", "-n", name, "link", "set", "lo", "up"])


def delete_netns(name: str) -> None:
    """Delete a named namespace (missing is fine)."""
    if netns_exists(name):
        _run(["ip", "netns", "delete", name], ok_errors=("No such file",))


def link_exists(name: str) -> bool:
    """Whether an interface of that name exists in the host namespace."""
    return Path("/sys/class/net", name).exists()


def create_veth(names: NetNames, s: Slot) -> None:
    """A veth pair: host side ``names.host_if`` with ``s.host``, sandbox side ``eth0`` inside
    the namespace with ``s.sandbox``; both up."""
    _run(
        [
            "ip",
            "link",
            "add",
            names.host_if,
            "type",
            "veth",
            "peer",
            "name",
            names.sandbox_if,
            "netns",
            names.netns,
        ]
    )
    _run(
        ["ip", "-batch", "-"],
        f"addr add {s.host}/{s.prefixlen} dev {names.host_if}\nlink set {names.host_if} up\n",
    )
    _run(
        ["ip", "-n", names.netns, "-batch", "-"],
        f"addr add {s.sandbox}/{s.prefixlen} dev {names.sandbox_if}\n"
        f"link set {names.sandbox_if} up\n",
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
    out: set[str] = set()
    for link in json.loads(_run(["ip", "-j", "-4", "addr", "show"]) or "[]"):
        for a in link.get("addr_info", []):
            local = a.get("local")
            if local and ipaddress.IPv4Address(local) in net:
                out.add(local)
    return out


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
