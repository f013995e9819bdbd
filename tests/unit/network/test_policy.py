"""The egress policy matcher: rule order, domain patterns, protected ranges, record mode."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandlot.models import NetworkAllowlist
from sandlot.network.policy import (
    CompiledPolicy,
    EgressEvent,
    HostFacts,
    compile_policy,
    match_domain,
    normalize_host,
    parse_ip,
    policy_to_json,
    suggest,
)

ip = ipaddress.ip_address
FACTS = HostFacts(
    local_addresses=frozenset({ip("192.0.2.7"), ip("2001:db8::7")}),
    internal_networks=(ipaddress.ip_network("10.213.0.0/16"),),
)


def allowlist(**kw) -> CompiledPolicy:
    return compile_policy(NetworkAllowlist(**kw))


def decide(policy: CompiledPolicy, host: str, resolved: list[str] | None = None):
    """What the proxy would do: literal check, or name check then resolved addresses."""
    literal = parse_ip(host)
    if literal is not None:
        return policy.check_address(literal, FACTS)
    pre = policy.check_name(host)
    if not pre.allowed:
        return pre
    _, v = policy.check_resolved(host, [ip(a) for a in resolved or []], FACTS)
    return v


# ------------------------------------------------------------------ domains


@pytest.mark.parametrize(
    ("host", "pattern", "expected"),
    [
        ("example.com", "example.com", True),
        ("www.example.com", "example.com", False),
        ("badexample.com", "example.com", False),
        ("example.com", "*.example.com", False),
        ("a.example.com", "*.example.com", True),
        ("a.b.example.com", "*.example.com", True),
        ("aexample.com", "*.example.com", False),
        ("example.com.evil.net", "*.example.com", False),
    ],
)
def test_domain_patterns(host, pattern, expected):
    assert match_domain(host, pattern) is expected


def test_exact_domain_allows_itself_not_siblings_or_children():
    p = allowlist(allow_domains=["example.com"])
    assert decide(p, "example.com", ["93.184.216.34"]).allowed
    assert decide(p, "EXAMPLE.com.", ["93.184.216.34"]).allowed
    assert not decide(p, "www.example.com", ["93.184.216.34"]).allowed
    assert not decide(p, "example.org", ["93.184.216.34"]).allowed


def test_wildcard_allows_subdomains_only():
    p = allowlist(allow_domains=["*.example.com"])
    assert decide(p, "api.example.com", ["93.184.216.34"]).reason == "allow_domain"
    assert decide(p, "example.com", ["93.184.216.34"]).reason == "not_listed"


def test_unlisted_name_is_never_resolved_without_allow_cidrs():
    p = allowlist(allow_domains=["example.com"])
    assert p.check_name("exfil-data.attacker.net").reason == "not_listed"
    assert (
        allowlist(allow_domains=["example.com"], allow_cidrs=["203.0.113.0/24"])
        .check_name("other.net")
        .allowed
    )


def test_deny_all_refuses_before_resolution():
    p = compile_policy("deny-all")
    assert p.check_name("example.com").reason == "deny_all"
    assert p.check_address(ip("93.184.216.34"), FACTS).reason == "deny_all"


def test_malformed_host_names_are_refused():
    p = compile_policy("allow-all")
    for bad in ["", "a..b", "-a.com", "a b.com", "x/y", "a" * 64 + ".com", "fe80::1%eth0"]:
        assert not p.check_name(bad).allowed, bad


def test_idna_names_are_normalized():
    assert normalize_host("BÜCHER.example") == "xn--bcher-kva.example"
    p = allowlist(allow_domains=["xn--bcher-kva.example"])
    assert decide(p, "bücher.example", ["93.184.216.34"]).allowed


# ------------------------------------------------------------------ cidrs


def test_name_allowed_when_it_resolves_into_allow_cidrs():
    p = allowlist(allow_cidrs=["203.0.113.0/24"])
    assert decide(p, "anything.net", ["203.0.113.5"]).reason == "allow_cidr"
    assert decide(p, "anything.net", ["198.51.100.5"]).reason == "not_allowed"


def test_only_the_addresses_that_pass_are_used():
    p = allowlist(allow_cidrs=["203.0.113.0/24"])
    usable, v = p.check_resolved("mixed.net", [ip("198.51.100.5"), ip("203.0.113.5")], FACTS)
    assert v.allowed
    assert usable == [ip("203.0.113.5")]


def test_ip_literal_needs_allow_cidrs_even_if_a_listed_name_resolves_there():
    p = allowlist(allow_domains=["example.com"])
    assert not decide(p, "93.184.216.34").allowed
    assert decide(allowlist(allow_cidrs=["93.184.216.0/24"]), "93.184.216.34").allowed
    assert decide(allowlist(allow_cidrs=["2001:db8:1::/48"]), "[2001:db8:1::5]").allowed


def test_deny_cidrs_win_over_domains_and_cidrs():
    p = allowlist(
        allow_domains=["example.com"],
        allow_cidrs=["203.0.113.0/24"],
        deny_cidrs=["203.0.113.64/26"],
    )
    assert decide(p, "example.com", ["203.0.113.66"]).reason == "deny_cidr"
    assert decide(p, "203.0.113.66").reason == "deny_cidr"
    assert decide(p, "203.0.113.5").allowed


def test_ipv4_mapped_ipv6_is_checked_as_ipv4():
    p = allowlist(allow_cidrs=["0.0.0.0/0"], deny_cidrs=["203.0.113.0/24"])
    assert decide(p, "::ffff:203.0.113.9").reason == "deny_cidr"
    assert decide(p, "::ffff:127.0.0.1").reason == "protected:loopback"
    mapped_rule = allowlist(deny_cidrs=["::ffff:203.0.113.0/120"], allow_cidrs=["0.0.0.0/0"])
    assert decide(mapped_rule, "203.0.113.9").reason == "deny_cidr"


# ------------------------------------------------------------------ protected


@pytest.mark.parametrize(
    ("addr", "kind"),
    [
        ("169.254.169.254", "link_local"),
        ("fd00:ec2::254", "link_local"),
        ("fe80::1", "link_local"),
        ("127.0.0.1", "loopback"),
        ("127.8.9.1", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.251", "multicast"),
        ("192.0.2.7", "host_address"),
        ("2001:db8::7", "host_address"),
        ("10.213.4.2", "sandbox_pool"),
    ],
)
def test_protected_addresses_refused_even_by_broad_allows(addr, kind):
    for policy in (
        compile_policy("allow-all"),
        allowlist(record=True),
        allowlist(allow_cidrs=["0.0.0.0/0", "::/0"]),
        allowlist(allow_domains=["metadata.internal"]),
    ):
        assert decide(policy, addr).reason == f"protected:{kind}"
        assert decide(policy, "metadata.internal", [addr]).reason == f"protected:{kind}"


def test_protected_address_opens_only_to_an_entry_inside_its_range():
    assert decide(allowlist(allow_cidrs=["169.254.169.254/32"]), "169.254.169.254").allowed
    assert decide(allowlist(allow_cidrs=["169.254.0.0/16"]), "169.254.1.1").allowed
    assert not decide(allowlist(allow_cidrs=["169.254.0.0/15"]), "169.254.1.1").allowed
    assert decide(allowlist(allow_cidrs=["192.0.2.7/32"]), "192.0.2.7").allowed
    assert not decide(allowlist(allow_cidrs=["192.0.2.0/24"]), "192.0.2.7").allowed
    # deny_cidrs still win over an explicit allowance.
    p = allowlist(allow_cidrs=["169.254.169.254/32"], deny_cidrs=["169.254.0.0/16"])
    assert decide(p, "169.254.169.254").reason == "deny_cidr"


# ------------------------------------------------------------------ modes


def test_allow_all_allows_public_addresses():
    p = compile_policy("allow-all")
    assert decide(p, "anything.example", ["93.184.216.34"]).reason == "allow_all"


def test_open_record_mode_allows_everything_not_denied():
    p = allowlist(record=True, deny_cidrs=["198.51.100.0/24"])
    assert p.open_record
    assert decide(p, "who.example", ["203.0.113.1"]).reason == "record"
    assert decide(p, "who.example", ["198.51.100.1"]).reason == "deny_cidr"
    assert decide(p, "169.254.169.254").reason == "protected:link_local"


def test_record_mode_with_lists_keeps_the_base_policy():
    p = allowlist(record=True, allow_domains=["*.example.com"])
    assert not p.open_record
    assert decide(p, "a.example.com", ["93.184.216.34"]).allowed
    assert not decide(p, "other.net", ["93.184.216.34"]).allowed


def test_json_round_trip_compiles_the_same():
    model = NetworkAllowlist(
        allow_domains=["*.a.com", "b.com"], allow_cidrs=["10.0.0.0/8"], deny_cidrs=["10.1.0.0/16"]
    )
    assert compile_policy(policy_to_json(model)) == compile_policy(model)  # type: ignore[arg-type]
    assert compile_policy(policy_to_json("deny-all")) == compile_policy("deny-all")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        compile_policy("allow-some")


# ------------------------------------------------------------------ suggest


def ev(host: str, decision="allow", reason="record", address="203.0.113.1", phase="decide"):
    return EgressEvent(
        sandbox_id="sb-1",
        host=host,
        port=443,
        decision=decision,
        reason=reason,
        address=address,
        phase=phase,
    )


def test_suggest_lists_exactly_the_names_used():
    events = [
        ev("api.example.com"),
        ev("API.example.com."),
        ev("cdn.example.net"),
        ev("blocked.example", decision="deny", reason="deny_cidr"),
        ev("closed.example", phase="close"),
        ev("203.0.113.9"),
        ev("2001:db8::9"),
    ]
    s = suggest(events, base=NetworkAllowlist(record=True, deny_cidrs=["198.51.100.0/24"]))
    assert s.allow_domains == ["api.example.com", "cdn.example.net"]
    assert s.allow_cidrs == ["203.0.113.9/32", "2001:db8::9/128"]
    assert s.deny_cidrs == ["198.51.100.0/24"]
    assert s.record is False


def test_suggest_keeps_explicitly_opened_protected_addresses():
    events = [ev("meta.internal", reason="allow_cidr", address="169.254.169.254")]
    s = suggest(events)
    assert s.allow_domains == ["meta.internal"]
    assert s.allow_cidrs == ["169.254.169.254/32"]


def test_suggest_collapses_only_when_asked_and_never_under_shared_suffixes():
    names = [f"s{i}.cdn.example.com" for i in range(4)] + ["example.com"]
    names += [f"u{i}.github.io" for i in range(4)] + [f"x{i}.co.uk" for i in range(4)]
    events = [ev(n) for n in names]
    assert len(suggest(events).allow_domains) == len(names)
    collapsed = suggest(events, collapse_at=3).allow_domains
    assert "*.cdn.example.com" in collapsed
    assert "example.com" in collapsed
    assert not any(d.endswith("github.io") and d.startswith("*") for d in collapsed)
    assert not any(d.startswith("*") and d.endswith("co.uk") for d in collapsed)
    assert sum(d.endswith(".github.io") for d in collapsed) == 4


def test_suggested_policy_allows_what_was_used():
    events = [ev("a.example.com", address="203.0.113.1"), ev("203.0.113.9", address="203.0.113.9")]
    p = compile_policy(suggest(events))
    assert decide(p, "a.example.com", ["203.0.113.1"]).allowed
    assert decide(p, "203.0.113.9").allowed
    assert not decide(p, "b.example.com", ["203.0.113.1"]).allowed


def test_event_json_round_trip():
    e = ev("a.example.com")
    e.addresses = ["203.0.113.1"]
    assert EgressEvent.from_json(e.to_json()) == e
    with pytest.raises(ValueError):
        EgressEvent.from_json({"decision": "maybe"})


# ------------------------------------------------------------------ properties

label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
names = st.lists(label, min_size=1, max_size=4).map(".".join)
v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
v6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
addrs = st.one_of(v4, v6)


@given(names, names)
def test_wildcard_never_matches_its_apex_and_always_its_children(child, parent):
    assert not match_domain(parent, f"*.{parent}")
    assert match_domain(f"{child}.{parent}", f"*.{parent}")
    assert match_domain(parent, parent)
    assert not match_domain(f"{child}.{parent}", parent)


@given(addrs, st.lists(addrs, max_size=3))
def test_deny_cidr_always_wins(addr, others):
    net = str(ipaddress.ip_network(addr))
    p = allowlist(
        allow_cidrs=["0.0.0.0/0", "::/0", net], deny_cidrs=[net], allow_domains=["x.example"]
    )
    assert decide(p, str(addr)).reason == "deny_cidr"
    usable, _v = p.check_resolved("x.example", [addr, *others], FACTS)
    assert addr not in usable
    unmapped = parse_ip(str(addr))
    assert unmapped not in usable


@given(addrs)
def test_protected_never_allowed_by_default_policies(addr):
    unmapped = parse_ip(str(addr))
    assert unmapped is not None
    protected = CompiledPolicy._protection(unmapped, FACTS) is not None
    for p in (compile_policy("allow-all"), allowlist(record=True)):
        v = p.check_address(addr, FACTS)
        assert v.allowed is not protected


@given(names, st.lists(addrs, min_size=1, max_size=4))
def test_unlisted_names_without_cidrs_are_never_resolved(host, resolved):
    p = allowlist(allow_domains=["only.example"])
    if host != "only.example":
        assert not p.check_name(host).allowed
        usable, v = p.check_resolved(host, resolved, FACTS)
        assert usable == []
        assert not v.allowed
