"""DNS wire parsing, TLS ClientHello SNI parsing and the proxy env, without a network."""

from __future__ import annotations

import ipaddress
import ssl
import struct

import pytest

from sandlot.network.dns import ResolveError, encode_name, parse_response
from sandlot.network.proxy import client_hello_sni
from sandlot.network.service import proxy_env


def response(qid: int, name: str, answers: list[tuple[int, bytes]], rcode: int = 0, tc=False):
    flags = 0x8180 | rcode | (0x0200 if tc else 0)
    msg = struct.pack("!HHHHHH", qid, flags, 1, len(answers), 0, 0)
    msg += encode_name(name) + struct.pack("!HH", 1, 1)
    for rtype, rdata in answers:
        # 0xC00C: a compression pointer back to the question's name.
        msg += struct.pack("!HHHIH", 0xC00C, rtype, 1, 60, len(rdata)) + rdata
    return msg


def test_parse_a_and_aaaa_answers_with_compression():
    v4 = ipaddress.IPv4Address("203.0.113.5").packed
    v6 = ipaddress.IPv6Address("2001:db8::5").packed
    cname = encode_name("other.example")
    msg = response(7, "a.example", [(5, cname), (1, v4), (28, v6)])
    addrs, truncated = parse_response(msg, 7)
    assert [str(a) for a in addrs] == ["203.0.113.5", "2001:db8::5"]
    assert truncated is False
    assert parse_response(response(7, "a.example", [], tc=True), 7)[1] is True


def test_parse_rejects_wrong_id_and_reports_nxdomain():
    msg = response(7, "a.example", [])
    with pytest.raises(ResolveError):
        parse_response(msg, 8)
    with pytest.raises(ResolveError, match="no such name"):
        parse_response(response(7, "a.example", [], rcode=3), 7)
    with pytest.raises(ResolveError):
        parse_response(msg[:20] + b"\xc0", 7)


def client_hello(server_hostname: str | None) -> bytes:
    ctx = ssl.create_default_context()
    if server_hostname is None:
        # A client dialling an IP address sends no SNI, and checks no hostname: a context that
        # checks one refuses (or, on some builds, warns about) a handshake without a name.
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_is_read_from_a_real_client_hello():
    assert client_hello_sni(client_hello("Api.Example.com")) == "api.example.com"


def test_no_sni_for_ip_hosts_or_non_tls_bytes():
    assert client_hello_sni(client_hello(None)) is None
    assert client_hello_sni(b"SSH-2.0-OpenSSH_9.2\r\n") is None
    assert client_hello_sni(client_hello("a.example")[:40]) is None


def test_proxy_env_sets_both_cases():
    env = proxy_env("http://10.213.0.5:3128")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        assert env[name] == env[name.lower()] == "http://10.213.0.5:3128"
    assert "127.0.0.1" in env["NO_PROXY"]
    assert env["no_proxy"] == env["NO_PROXY"]
