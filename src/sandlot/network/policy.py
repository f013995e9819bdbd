"""Egress policy matching: pure functions from a network policy and a destination to a verdict.

This module owns what an egress policy *means*: which host names match which patterns, which
addresses are always protected (the host itself, link-local metadata, other sandboxes), the
order in which rules win, what an egress log event looks like, and how record mode turns a log
into a least-privilege allowlist (:func:`suggest`). It does no I/O and imports nothing from
sandlot at run time except, lazily, :mod:`sandlot.models` inside :func:`suggest` and
:func:`policy_to_json`: the egress daemon imports this module and must stay small in memory.

The order of the rules, for one destination address ``a`` (a name's resolved addresses are
checked one by one; only those that pass are connected to):

1. ``deny-all`` refuses everything, before any name is resolved.
2. ``a`` inside ``deny_cidrs``: refused (``deny_cidr``). Nothing overrides this.
3. ``a`` protected (loopback, unspecified, link-local incl. cloud metadata, multicast,
   broadcast, the host's own addresses, the sandbox address pool): refused unless an
   ``allow_cidrs`` entry lies entirely *inside* the protected range (``169.254.169.254/32``
   unlocks the metadata address; ``0.0.0.0/0`` unlocks nothing protected).
4. ``a`` inside ``allow_cidrs``: allowed (``allow_cidr``).
5. ``a`` reached through a host name that ``allow_domains`` lists: allowed (``allow_domain``).
6. ``allow-all``, or record mode with both allow lists empty: allowed.
7. Anything else: refused (``not_allowed``).
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeAlias

if TYPE_CHECKING:
    from sandlot.models import JsonValue, NetworkAllowlist, NetworkPolicy

__all__ = [
    "ALWAYS_PROTECTED",
    "CompiledPolicy",
    "EgressEvent",
    "HostFacts",
    "IPAddress",
    "IPNetwork",
    "Verdict",
    "compile_policy",
    "match_domain",
    "normalize_host",
    "parse_ip",
    "policy_to_json",
    "suggest",
]

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
PolicyKind: TypeAlias = Literal["allow-all", "deny-all", "allowlist"]

ALWAYS_PROTECTED: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), kind)
    for net, kind in (
        ("0.0.0.0/8", "unspecified"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link_local"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("fe80::/10", "link_local"),
        ("fd00:ec2::254/128", "link_local"),
        ("ff00::/8", "multicast"),
    )
)
"""Ranges no sandbox reaches unless ``allow_cidrs`` names them (or a part of them) explicitly."""

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


def parse_ip(text: str) -> IPAddress | None:
    """An IP literal (``1.2.3.4``, ``::1``, ``[::1]``), IPv4-mapped IPv6 unwrapped; else None.

    Zone ids (``fe80::1%eth0``) are not literals we accept, so they come back as None and then
    fail as host names.
    """
    t = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        addr = ipaddress.ip_address(t)
    except ValueError:
        return None
    return _unmap(addr)


def _unmap(addr: IPAddress) -> IPAddress:
    # ::ffff:127.0.0.1 reaches 127.0.0.1; every check must see the IPv4 address it really is.
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def normalize_host(host: str) -> str | None:
    """A host name lowercased, without a trailing dot, IDNA-encoded; None if it is not one."""
    h = host.strip().rstrip(".").lower()
    if not h or len(h) > 253:
        return None
    if not h.isascii():
        try:
            h = h.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    labels = h.split(".")
    if not all(_LABEL.match(label) for label in labels):
        return None
    return h


def match_domain(host: str, pattern: str) -> bool:
    """Whether a normalized host name matches one ``allow_domains`` entry.

    ``example.com`` matches exactly itself. ``*.example.com`` matches every name below it at
    any depth (``a.example.com``, ``a.b.example.com``) but not ``example.com`` itself.
    """
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


@dataclass(frozen=True)
class HostFacts:
    """What the matcher must know about the host it runs on."""

    local_addresses: frozenset[IPAddress] = frozenset()
    """Every address assigned to one of the host's interfaces."""
    internal_networks: tuple[IPNetwork, ...] = ()
    """Ranges of other sandboxes (the veth address pool): never reached from a sandbox."""


@dataclass(frozen=True)
class Verdict:
    """The answer for one destination."""

    allowed: bool
    """Whether the connection may be made."""
    reason: str
    """A stable code: ``allow_domain``, ``allow_cidr``, ``allow_all``, ``record``,
    ``deny_all``, ``deny_cidr``, ``protected:<kind>``, ``not_allowed``, ``not_listed``,
    ``bad_host``, …"""


@dataclass(frozen=True)
class CompiledPolicy:
    """A network policy prepared for fast matching (build it with :func:`compile_policy`)."""

    kind: PolicyKind
    allow_domains: tuple[str, ...] = ()
    allow_cidrs: tuple[IPNetwork, ...] = ()
    deny_cidrs: tuple[IPNetwork, ...] = ()
    record: bool = False

    @property
    def open_record(self) -> bool:
        """Record mode with empty allow lists: everything not denied is allowed and logged."""
        return self.record and not self.allow_domains and not self.allow_cidrs

    def domain_listed(self, host: str) -> bool:
        """Whether a normalized name matches ``allow_domains``."""
        return any(match_domain(host, p) for p in self.allow_domains)

    def check_name(self, host: str) -> Verdict:
        """Before resolving: may this name be allowed at all?

        A refusal here means the name must not be resolved, so a name nobody allowed never
        reaches a DNS server (no exfiltration through lookups). A name is worth resolving when it
        is listed, when ``allow_cidrs`` could admit its addresses, or in allow-all and open
        record mode.
        """
        if self.kind == "deny-all":
            return Verdict(False, "deny_all")
        name = normalize_host(host)
        if name is None:
            return Verdict(False, "bad_host")
        if self.kind == "allow-all":
            return Verdict(True, "allow_all")
        if self.domain_listed(name):
            return Verdict(True, "allow_domain")
        if self.allow_cidrs:
            return Verdict(True, "may_resolve")
        if self.open_record:
            return Verdict(True, "record")
        return Verdict(False, "not_listed")

    def check_address(
        self, addr: IPAddress, facts: HostFacts, *, via_listed_name: bool = False
    ) -> Verdict:
        """Whether ``addr`` may be connected to (rules 1-7 of the module docstring)."""
        if self.kind == "deny-all":
            return Verdict(False, "deny_all")
        addr = _unmap(addr)
        if any(addr in n for n in self.deny_cidrs):
            return Verdict(False, "deny_cidr")
        protected = self._protection(addr, facts)
        if protected is not None:
            net, kind = protected
            if self._explicitly_allowed(addr, net):
                return Verdict(True, "allow_cidr")
            return Verdict(False, f"protected:{kind}")
        if any(addr in n for n in self.allow_cidrs):
            return Verdict(True, "allow_cidr")
        if via_listed_name:
            return Verdict(True, "allow_domain")
        if self.kind == "allow-all":
            return Verdict(True, "allow_all")
        if self.open_record:
            return Verdict(True, "record")
        return Verdict(False, "not_allowed")

    def check_resolved(
        self, host: str, addresses: Iterable[IPAddress], facts: HostFacts
    ) -> tuple[list[IPAddress], Verdict]:
        """Filter a name's resolved addresses down to those that may be connected to.

        Returns the usable addresses (in resolver order, deduplicated) and the verdict: allowed
        with the reason of the first usable address, or refused with the reason of the first
        refused one (``no_address`` when the name resolved to nothing).
        """
        pre = self.check_name(host)
        if not pre.allowed:
            return [], pre
        name = normalize_host(host) or host
        listed = self.domain_listed(name)
        usable: list[IPAddress] = []
        first_ok: Verdict | None = None
        first_refusal: Verdict | None = None
        for a in dict.fromkeys(_unmap(x) for x in addresses):
            v = self.check_address(a, facts, via_listed_name=listed)
            if v.allowed:
                usable.append(a)
                first_ok = first_ok or v
            else:
                first_refusal = first_refusal or v
        if first_ok is not None:
            return usable, first_ok
        return [], first_refusal or Verdict(False, "no_address")

    @staticmethod
    def _protection(addr: IPAddress, facts: HostFacts) -> tuple[IPNetwork, str] | None:
        for net, kind in ALWAYS_PROTECTED:
            if addr in net:
                return net, kind
        if addr in facts.local_addresses:
            return ipaddress.ip_network(addr), "host_address"
        for net in facts.internal_networks:
            if addr in net:
                return net, "sandbox_pool"
        return None

    def _explicitly_allowed(self, addr: IPAddress, protected: IPNetwork) -> bool:
        # A broad entry (0.0.0.0/0, 10.0.0.0/8) was written for the internet or a LAN, not to
        # open the metadata service or the host itself: only an entry inside the protected range
        # counts as explicit.
        return any(
            addr in n and n.version == protected.version and n.subnet_of(protected)  # type: ignore[arg-type]
            for n in self.allow_cidrs
        )


def _networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    out: list[IPNetwork] = []
    for v in values:
        net = ipaddress.ip_network(v, strict=False)
        if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96:
            mapped = net.network_address.ipv4_mapped
            if mapped is not None:
                # ::ffff:a.b.c.d/1xx is the IPv4 range a.b.c.d/(xx-96); addresses are unmapped
                # before matching, so the rule must be too.
                net = ipaddress.ip_network(f"{mapped}/{net.prefixlen - 96}")
        out.append(net)
    return tuple(out)


def compile_policy(policy: NetworkPolicy | Mapping[str, object] | str) -> CompiledPolicy:
    """Prepare a policy for matching.

    Args:
        policy: a :data:`~sandlot.models.NetworkPolicy`, or its JSON form (``"allow-all"``,
            ``"deny-all"`` or a mapping with the allowlist's fields), which is what the egress
            daemon reads from its state files.

    Raises:
        ValueError: the JSON form is malformed (models validate user input before this).
    """
    if isinstance(policy, str):
        if policy == "allow-all":
            return CompiledPolicy("allow-all")
        if policy == "deny-all":
            return CompiledPolicy("deny-all")
        msg = f"unknown network policy {policy!r}"
        raise ValueError(msg)
    if isinstance(policy, Mapping):
        domains = policy.get("allow_domains", [])
        allow = policy.get("allow_cidrs", [])
        deny = policy.get("deny_cidrs", [])
        record = policy.get("record", False)
        if not (
            isinstance(domains, list)
            and isinstance(allow, list)
            and isinstance(deny, list)
            and isinstance(record, bool)
        ):
            msg = "malformed network allowlist"
            raise ValueError(msg)
        doms = [normalize_host(str(d).removeprefix("*.")) for d in domains]
        if any(d is None for d in doms):
            msg = f"malformed domain in {domains!r}"
            raise ValueError(msg)
        return CompiledPolicy(
            "allowlist",
            allow_domains=tuple(str(d).strip().lower().rstrip(".") for d in domains),
            allow_cidrs=_networks(str(x) for x in allow),
            deny_cidrs=_networks(str(x) for x in deny),
            record=record,
        )
    return CompiledPolicy(
        "allowlist",
        allow_domains=tuple(policy.allow_domains),
        allow_cidrs=_networks(policy.allow_cidrs),
        deny_cidrs=_networks(policy.deny_cidrs),
        record=policy.record,
    )


def policy_to_json(policy: NetworkPolicy) -> JsonValue:
    """The JSON form :func:`compile_policy` reads back."""
    if isinstance(policy, str):
        return policy
    return policy.model_dump(mode="json")


@dataclass
class EgressEvent:
    """One line of a sandbox's egress log: a decision, or the end of an allowed connection."""

    sandbox_id: str
    """The sandbox that asked."""
    host: str
    """The host as the client named it (a name or an IP literal)."""
    port: int
    """Destination port."""
    decision: Literal["allow", "deny"]
    """What the policy said."""
    reason: str
    """The verdict's reason code (plus ``connect_failed``, ``resolve_failed``, ``sni_mismatch``,
    ``bad_request``, ``foreign_client``)."""
    phase: Literal["decide", "close"] = "decide"
    """``decide`` when the decision is taken; ``close`` when an allowed connection ends."""
    method: str = ""
    """``CONNECT`` or the HTTP method of a plain-HTTP request."""
    addresses: list[str] = field(default_factory=list)
    """Resolved addresses that passed the policy (or the refused ones, for a refusal)."""
    address: str | None = None
    """The address actually connected to."""
    bytes_up: int = 0
    """Bytes from the sandbox to the destination (``close`` events)."""
    bytes_down: int = 0
    """Bytes from the destination to the sandbox (``close`` events)."""
    record: bool = False
    """True when the policy was in record mode."""
    time: float = field(default_factory=time.time)
    """Seconds since the epoch."""

    def to_json(self) -> dict[str, JsonValue]:
        """The event as one JSON object (one log line)."""
        return {
            "time": self.time,
            "sandbox_id": self.sandbox_id,
            "host": self.host,
            "port": self.port,
            "decision": self.decision,
            "reason": self.reason,
            "phase": self.phase,
            "method": self.method,
            "addresses": list(self.addresses),
            "address": self.address,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "record": self.record,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> EgressEvent:
        """Read back one log line (unknown keys are ignored, so old readers survive new keys)."""
        decision = data.get("decision")
        phase = data.get("phase", "decide")
        addresses = data.get("addresses", [])
        address = data.get("address")
        if decision not in ("allow", "deny") or phase not in ("decide", "close"):
            msg = f"not an egress event: {dict(data)!r}"
            raise ValueError(msg)
        return cls(
            sandbox_id=str(data.get("sandbox_id", "")),
            host=str(data.get("host", "")),
            port=_int(data.get("port")),
            decision=decision,
            reason=str(data.get("reason", "")),
            phase=phase,
            method=str(data.get("method", "")),
            addresses=[str(a) for a in addresses] if isinstance(addresses, list) else [],
            address=None if address is None else str(address),
            bytes_up=_int(data.get("bytes_up")),
            bytes_down=_int(data.get("bytes_down")),
            record=bool(data.get("record", False)),
            time=float(str(data.get("time", 0.0))),
        )


def _int(v: object) -> int:
    return int(v) if isinstance(v, int | float | str) else 0


# Suffixes under which sibling names belong to unrelated owners: a wildcard there would admit
# strangers. A heuristic, not the Public Suffix List; collapsing is opt-in for that reason.
_SHARED_SUFFIXES = frozenset(
    {
        "github.io",
        "githubusercontent.com",
        "gitlab.io",
        "s3.amazonaws.com",
        "amazonaws.com",
        "cloudfront.net",
        "herokuapp.com",
        "appspot.com",
        "azurewebsites.net",
        "blob.core.windows.net",
        "pages.dev",
        "workers.dev",
        "vercel.app",
        "netlify.app",
        "blogspot.com",
        "firebaseapp.com",
        "web.app",
        "ngrok.io",
        "ngrok-free.app",
        "fly.dev",
        "onrender.com",
        "readthedocs.io",
    }
)
_SLD = frozenset({"co", "com", "net", "org", "gov", "edu", "ac", "or", "ne", "go"})


def _collapsible_parent(parent: str) -> bool:
    labels = parent.split(".")
    if len(labels) < 2 or parent in _SHARED_SUFFIXES:
        return False
    # co.uk, com.au, ac.jp: a second-level public suffix under a two-letter country code.
    return not (len(labels) == 2 and len(labels[1]) == 2 and labels[0] in _SLD)


def suggest(
    events: Iterable[EgressEvent],
    *,
    base: NetworkAllowlist | None = None,
    collapse_at: int | None = None,
) -> NetworkAllowlist:
    """The least-privilege allowlist that covers every allowed connection in ``events``.

    Every host name that was connected to becomes an exact ``allow_domains`` entry, every IP
    literal an exact ``/32`` or ``/128`` in ``allow_cidrs``; ``deny_cidrs`` of ``base`` are kept.
    A protected address that was only reachable because ``base`` allowed it explicitly keeps
    its exact ``allow_cidrs`` entry too, so the suggestion never allows less than what was used.

    Args:
        events: the egress log (refusals and ``close`` events are ignored).
        base: the policy that was in force while recording.
        collapse_at: opt in to wildcards: when at least this many distinct names share a parent
            (``a.cdn.example.com``, ``b.cdn.example.com``, … with ``collapse_at=3``), they
            become ``*.cdn.example.com``. Never under a shared hosting or public suffix such as
            ``github.io`` or ``co.uk``, and never a bare TLD. Off by default: a wildcard admits
            names that were never seen.
    """
    from sandlot.models import NetworkAllowlist

    names: set[str] = set()
    cidrs: set[str] = set()
    for e in events:
        if e.decision != "allow" or e.phase != "decide":
            continue
        ip = parse_ip(e.host)
        if ip is not None:
            cidrs.add(str(ipaddress.ip_network(ip)))
            continue
        name = normalize_host(e.host)
        if name is None:
            continue
        names.add(name)
        if e.address is not None and e.reason == "allow_cidr":
            a = parse_ip(e.address)
            if a is not None and CompiledPolicy._protection(a, HostFacts()) is not None:
                cidrs.add(str(ipaddress.ip_network(a)))
    domains = sorted(names)
    if collapse_at is not None and collapse_at >= 2:
        domains = _collapse(names, collapse_at)
    return NetworkAllowlist(
        allow_domains=domains,
        allow_cidrs=sorted(cidrs, key=_cidr_key),
        deny_cidrs=list(base.deny_cidrs) if base is not None else [],
        record=False,
    )


def _collapse(names: set[str], at: int) -> list[str]:
    by_parent: dict[str, set[str]] = {}
    for n in names:
        if "." in n:
            by_parent.setdefault(n.split(".", 1)[1], set()).add(n)
    out = set(names)
    for parent, children in by_parent.items():
        if len(children) >= at and _collapsible_parent(parent):
            out -= children
            out.add(f"*.{parent}")
    # A wildcard already covers deeper names that collapsed separately or stayed exact.
    wild = sorted(d for d in out if d.startswith("*."))
    return sorted(d for d in out if not any(w != d and d.endswith(w[1:]) for w in wild))


def _cidr_key(c: str) -> tuple[int, int, int]:
    n = ipaddress.ip_network(c)
    return (n.version, int(n.network_address), n.prefixlen)


def addresses_json(addrs: Sequence[IPAddress]) -> list[str]:
    """Addresses as strings, for log lines."""
    return [str(a) for a in addrs]
