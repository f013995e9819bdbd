"""Egress policy enforced end to end: a sandbox namespace, the detached proxy, a fake internet."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sandlot.models import NetworkAllowlist

pytestmark = pytest.mark.slow


def prepare(nets, new_id, policy):
    sid = new_id()
    return sid, nets.prepare_sync(sid, policy)


def test_allowed_domain_over_http_and_https_with_tls_end_to_end(nets, new_id, fakenet, tools):
    _, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    rc, code, body = tools.curl(net, "http://www.example.test/hello?x=1", fakenet.ca)
    assert (rc, code) == (0, "200"), body
    assert body.startswith("http www.example.test at 198.51.100.10 got 0 GET /hello?x=1 HTTP/1.1")
    # The certificate is verified against the test CA inside the sandbox: no interception.
    rc, code, body = tools.curl(net, "https://www.example.test/", fakenet.ca)
    assert (rc, code) == (0, "200"), body
    assert body.startswith("https www.example.test at 198.51.100.10")
    # A request body crosses the proxy intact.
    rc, code, body = tools.curl(net, "http://www.example.test/up", fakenet.ca, "--data", "x" * 5000)
    assert code == "200"
    assert "got 5000 POST /up" in body


def test_sibling_domain_refused_and_never_resolved(nets, new_id, fakenet, tools):
    _, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    rc, code, body = tools.curl(net, "http://sibling.test/", fakenet.ca)
    assert code == "403"
    assert "not_listed" in body
    rc, _, body = tools.curl(net, "https://sibling.test/", fakenet.ca)
    assert rc != 0
    assert "403" in body
    rc, code, _ = tools.curl(net, "http://example.test/", fakenet.ca)
    assert code == "403"
    # The proxy resolves only names that could be allowed: no lookup can carry data out.
    assert "sibling.test" not in fakenet.queried()
    assert "example.test" not in fakenet.queried()


def test_wildcard_rule_allows_subdomains_not_the_apex(nets, new_id, fakenet, tools):
    _, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["*.example.test"]))
    assert tools.curl(net, "https://api.example.test/", fakenet.ca)[1] == "200"
    assert tools.curl(net, "https://deep.api.example.test/", fakenet.ca)[1] == "200"
    assert tools.curl(net, "http://example.test/", fakenet.ca)[1] == "403"


def test_direct_ip_refused_unless_in_allow_cidrs(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["cidr.test"]))
    assert tools.curl(net, "http://cidr.test/", fakenet.ca)[1] == "200"
    _rc, code, body = tools.curl(net, "http://203.0.113.10/", fakenet.ca)
    assert code == "403"
    assert "not_allowed" in body
    net = nets.prepare_sync(sid, NetworkAllowlist(allow_cidrs=["203.0.113.0/28"]))
    assert tools.curl(net, "https://203.0.113.10/", fakenet.ca)[1] == "200"
    # A name is allowed when it resolves into allow_cidrs.
    assert tools.curl(net, "https://cidr.test/", fakenet.ca)[1] == "200"
    assert tools.curl(net, "http://www.example.test/", fakenet.ca)[1] == "403"


def test_deny_cidrs_beat_an_allowed_name(nets, new_id, fakenet, tools):
    _, net = prepare(
        nets,
        new_id,
        NetworkAllowlist(
            allow_domains=["blocked.test", "mixed.test"], deny_cidrs=["203.0.113.64/26"]
        ),
    )
    _, code, body = tools.curl(net, "http://blocked.test/", fakenet.ca)
    assert code == "403"
    assert "deny_cidr" in body
    # A name with a denied and an allowed address is connected to the allowed one only.
    _rc, code, body = tools.curl(net, "http://mixed.test/", fakenet.ca)
    assert code == "200"
    assert "at 198.51.100.20" in body


def test_metadata_loopback_and_host_addresses_refused(nets, new_id, fakenet, tools):
    _, net = prepare(
        nets,
        new_id,
        NetworkAllowlist(
            allow_domains=["meta.test", "localhost.test", "hostveth.test"],
            allow_cidrs=["0.0.0.0/0"],
        ),
    )
    for url, reason in [
        ("http://169.254.169.254/latest/meta-data/", "protected:link_local"),
        ("http://meta.test/", "protected:link_local"),
        ("http://localhost.test/", "protected:loopback"),
        ("http://127.0.0.1/", "protected:loopback"),
        ("http://hostveth.test/", "protected:host_address"),
        (f"http://{net.host_address}/", "protected:host_address"),
        ("http://[::1]/", "protected:loopback"),
    ]:
        # --noproxy "": loopback URLs go through the proxy too (NO_PROXY would keep them inside).
        _rc, code, body = tools.curl(net, url, fakenet.ca, "--noproxy", "")
        assert code == "403", (url, body)
        assert reason in body, (url, body)


def test_anything_bypassing_the_proxy_has_no_way_out(nets, new_id, fakenet, tools):
    _, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    # A host-side service on all addresses, which the sandbox must not reach either.
    listener = socket.create_server(("0.0.0.0", 0))
    host_port = listener.getsockname()[1]
    try:
        probe = f"""
import socket, sys
def tcp(addr, port):
    try:
        socket.create_connection((addr, port), timeout=1.5).close(); return "open"
    except OSError as e: return type(e).__name__
def udp(addr, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.5)
    try:
        s.sendto(b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x03www\\x07example\\x04test\\x00\\x00\\x01\\x00\\x01", (addr, port))
        s.recvfrom(512); return "answered"
    except OSError as e: return type(e).__name__
print(tcp("198.51.100.10", 80), tcp("{net.host_address}", {host_port}), tcp("{net.host_address}", 22),
      udp("198.51.100.53", 53), udp("{net.host_address}", 53), tcp("169.254.169.254", 80))
try:
    socket.getaddrinfo("www.example.test", 80); print("resolved")
except OSError as e: print("noresolve")
"""
        p = tools.inside(net, "python3", "-c", probe)
        lines = p.stdout.split("\n")
        results = lines[0].split()
        assert results[0] == "OSError" or "Unreachable" in results[0] or results[0] != "open"
        assert "open" not in results, p.stdout + p.stderr
        assert "answered" not in results, p.stdout + p.stderr
        assert lines[1] == "noresolve"
        # Off the veth subnet there is no route at all: the kernel says so at once.
        route = tools.inside(net, "ip", "route", "get", "198.51.100.10")
        assert route.returncode != 0
        assert "unreachable" in route.stderr.lower()
        if shutil.which("ping"):
            ping = tools.inside(net, "ping", "-c", "1", "-W", "1", net.host_address)
            assert ping.returncode == 1, ping.stderr  # 1: no reply (2 would be an error)
    finally:
        listener.close()


def test_proxy_serves_only_its_own_sandbox(nets, new_id, fakenet, tools):
    _, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    _, other = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    host, port = net.proxy_url.removeprefix("http://").split(":")
    # From the host itself: the peer is not the sandbox, so the proxy hangs up without a word.
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(b"GET http://www.example.test/ HTTP/1.1\r\nHost: www.example.test\r\n\r\n")
        try:
            answer = s.recv(100)
        except ConnectionResetError:  # closed with our request unread: a reset, same meaning
            answer = b""
        assert answer == b""
    # From another sandbox: its packets never reach this proxy's port.
    rc, _, _ = tools.curl(other, "http://www.example.test/", fakenet.ca, "--proxy", net.proxy_url)
    assert rc != 0
    assert tools.curl(other, "http://www.example.test/", fakenet.ca)[1] == "200"


def test_sni_must_match_the_connect_host(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["sibling.test"]))
    # CONNECT sibling.test (allowed), but a ClientHello naming www.example.test.
    rc, _, body = tools.curl(
        net,
        "https://www.example.test/",
        fakenet.ca,
        "--connect-to",
        "www.example.test:443:sibling.test:443",
    )
    assert rc != 0, body
    events, _ = nets.read_events(sid)
    assert any(e.reason == "sni_mismatch" and e.host == "sibling.test" for e in events)


def test_runtime_policy_update_applies_within_a_second(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    assert tools.curl(net, "http://www.example.test/", fakenet.ca)[1] == "200"
    assert tools.curl(net, "http://sibling.test/", fakenet.ca)[1] == "403"
    t0 = time.monotonic()
    net = nets.prepare_sync(sid, NetworkAllowlist(allow_domains=["sibling.test"]))
    took = time.monotonic() - t0
    assert tools.curl(net, "http://sibling.test/", fakenet.ca)[1] == "200"
    assert tools.curl(net, "http://www.example.test/", fakenet.ca)[1] == "403"
    assert took < 1.0, took


def test_deny_all_has_no_route_at_all(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, "deny-all")
    assert net.proxy_url is None
    assert net.env() == {}
    links = tools.inside(net, "ip", "-o", "link").stdout
    assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"]
    assert tools.inside(net, "ip", "route").stdout.strip() == ""
    p = tools.inside(
        net, "python3", "-c", "import socket; socket.create_connection(('198.51.100.10', 80), 2)"
    )
    assert "Network is unreachable" in p.stderr
    # And back to an allowlist at run time, then deny-all again.
    net = nets.prepare_sync(sid, NetworkAllowlist(allow_domains=["www.example.test"]))
    assert tools.curl(net, "http://www.example.test/", fakenet.ca)[1] == "200"
    net = nets.prepare_sync(sid, "deny-all")
    assert tools.inside(net, "ip", "route").stdout.strip() == ""


def test_allow_all_reaches_out_through_nat_but_not_the_host_or_metadata(
    nets, new_id, fakenet, tools
):
    _, net = prepare(nets, new_id, "allow-all")
    assert net.env() == {}
    rc, code, body = tools.curl(net, "http://198.51.100.10/", fakenet.ca, proxy=False)
    assert (rc, code) == (0, "200"), body
    listener = socket.create_server(("0.0.0.0", 0))
    try:
        port = listener.getsockname()[1]
        rc, _, _ = tools.curl(net, f"http://{net.host_address}:{port}/", fakenet.ca, proxy=False)
        assert rc != 0
    finally:
        listener.close()
    rc, _, _ = tools.curl(
        net, "http://169.254.169.254/", fakenet.ca, "--max-time", "2", proxy=False
    )
    assert rc != 0


def test_record_mode_logs_everything_and_suggests_exactly_what_was_used(
    nets, new_id, fakenet, tools
):
    sid, net = prepare(nets, new_id, NetworkAllowlist(record=True, deny_cidrs=["203.0.113.64/26"]))
    for url in [
        "https://www.example.test/",
        "http://api.example.test/",
        "https://api.example.test/again",
        "http://203.0.113.10/",
    ]:
        assert tools.curl(net, url, fakenet.ca)[1] == "200", url
    assert tools.curl(net, "http://blocked.test/", fakenet.ca)[1] == "403"
    assert tools.curl(net, "http://169.254.169.254/", fakenet.ca)[1] == "403"
    suggestion = nets.suggest(sid)
    assert suggestion.allow_domains == ["api.example.test", "www.example.test"]
    assert suggestion.allow_cidrs == ["203.0.113.10/32"]
    assert suggestion.deny_cidrs == ["203.0.113.64/26"]
    assert suggestion.record is False
    # The suggestion, applied, allows what was used and nothing beside it.
    net = nets.prepare_sync(sid, suggestion)
    assert tools.curl(net, "https://www.example.test/", fakenet.ca)[1] == "200"
    assert tools.curl(net, "http://sibling.test/", fakenet.ca)[1] == "403"


def test_log_has_every_decision_with_bytes(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    tools.curl(net, "https://www.example.test/", fakenet.ca)
    tools.curl(net, "http://sibling.test/", fakenet.ca)
    assert tools.wait_for(lambda: len(nets.read_events(sid)[0]) >= 3)
    lines = [json.loads(x) for x in nets.log_path(sid).read_text().splitlines()]
    allow = next(x for x in lines if x["decision"] == "allow" and x["phase"] == "decide")
    assert allow["host"] == "www.example.test"
    assert allow["port"] == 443
    assert allow["method"] == "CONNECT"
    assert allow["addresses"] == ["198.51.100.10"]
    assert allow["reason"] == "allow_domain"
    closed = next(x for x in lines if x["phase"] == "close")
    assert closed["bytes_up"] > 200
    assert closed["bytes_down"] > 500
    deny = next(x for x in lines if x["decision"] == "deny")
    assert (deny["host"], deny["port"], deny["reason"]) == ("sibling.test", 80, "not_listed")
    assert {"time", "sandbox_id", "address", "record"} <= set(deny)
    # Reading from an offset returns only what came after it.
    _, offset = nets.read_events(sid)
    tools.curl(net, "http://www.example.test/", fakenet.ca)
    assert tools.wait_for(lambda: len(nets.read_events(sid, offset)[0]) >= 2)
    assert all(e.port == 80 for e in nets.read_events(sid, offset)[0])


def test_exposed_port_reachable_and_follows_restarts(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, "deny-all")
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            net.netns,
            "python3",
            "-m",
            "http.server",
            "8000",
            "--bind",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
    )
    try:
        assert tools.wait_for(
            lambda: (
                tools.inside(
                    net, "curl", "-s", "-o", "/dev/null", "http://127.0.0.1:8000/"
                ).returncode
                == 0
            )
        )
        m = nets.expose_port_sync(sid, 8000)
        assert m.host == "127.0.0.1"
        assert m.port == 8000
        assert m.url == f"http://127.0.0.1:{m.host_port}"

        def fetch(url: str) -> int:
            p = subprocess.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "3", url],
                capture_output=True,
                text=True,
            )
            return int(p.stdout or 0)

        assert fetch(m.url + "/") == 200
        # The daemon dies (host crash, OOM kill): list_ports brings it back and follows the port.
        pid = (nets.state_dir / "netd.pid").read_text().strip()
        os.kill(int(pid), 9)
        assert tools.wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid))
        (m2,) = nets.list_ports_sync(sid)
        assert fetch(m2.url + "/") == 200
        # Someone else took the port meanwhile: resume publishes elsewhere and the URL follows.
        nets._stop_daemon()
        squatter = socket.create_server(("127.0.0.1", m2.host_port))
        try:
            nets.prepare_sync(sid, "deny-all")
            (m3,) = nets.list_ports_sync(sid)
            assert m3.host_port != m2.host_port
            assert fetch(m3.url + "/") == 200
        finally:
            squatter.close()
    finally:
        server.kill()
        server.wait()


def _zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_prepare_rebuilds_after_a_reboot(nets, new_id, fakenet, tools):
    sid, net = prepare(nets, new_id, NetworkAllowlist(allow_domains=["www.example.test"]))
    # A reboot loses /run/netns, every veth, the nft tables and the daemon.
    nets._stop_daemon()
    tools.sh("ip", "netns", "del", net.netns)
    from sandlot.network.netns import names_for

    tools.sh("nft", "delete", "table", "inet", names_for(sid).table)
    net = nets.prepare_sync(sid, NetworkAllowlist(allow_domains=["www.example.test"]))
    assert tools.curl(net, "https://www.example.test/", fakenet.ca)[1] == "200"


def test_teardown_leaves_nothing(nets, new_id, fakenet, tools):
    ids = []
    for policy in (NetworkAllowlist(allow_domains=["www.example.test"]), "allow-all", "deny-all"):
        sid, _ = prepare(nets, new_id, policy)
        ids.append(sid)
    nets.expose_port_sync(ids[2], 8000)
    pid = int((nets.state_dir / "netd.pid").read_text())
    assert Path(f"/proc/{pid}").exists()
    for sid in ids:
        nets.teardown_sync(sid)
        nets.made.remove(sid)
    nss, links, tables = tools.kernel_objects()
    from sandlot.network.netns import names_for

    for sid in ids:
        n = names_for(sid)
        assert n.netns not in nss
        assert n.host_if not in links
        assert n.table not in tables
        assert n.netns not in tools.sh("ip", "netns", "list").stdout
        assert n.host_if not in tools.sh("ip", "-o", "link").stdout
        assert n.table not in tools.sh("nft", "list", "tables").stdout
    assert tools.wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(str(pid)))
    assert not (nets.state_dir / "netd.sock").exists()
    # Tearing down again, or something never prepared, is fine.
    nets.teardown_sync(ids[0])


def test_embedded_proxy_reports_events_through_on_event(fakenet):
    """The proxy as an asyncio object in the caller's loop (how the Manager can embed it)."""
    import asyncio

    from sandlot.network.dns import NameserverResolver
    from sandlot.network.policy import compile_policy
    from sandlot.network.proxy import EgressProxy

    seen = []

    async def main():
        proxy = EgressProxy(
            "sb-embedded",
            compile_policy(NetworkAllowlist(allow_domains=["www.example.test"])),
            listen="127.0.0.1",
            resolver=NameserverResolver(fakenet.nameserver),
            on_event=seen.append,
        )
        await proxy.start()
        host, port = proxy.address

        async def get(url: str) -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"GET {url} HTTP/1.1\r\nHost: ignored.example\r\nConnection: keep-alive\r\n\r\n".encode()
            )
            data = await reader.read()
            writer.close()
            return data

        ok = await get("http://www.example.test/x")
        refused = await get("http://sibling.test/")
        proxy.update_policy(compile_policy("deny-all"))
        after = await get("http://www.example.test/x")
        await proxy.aclose()
        return ok, refused, after

    ok, refused, after = asyncio.run(main())
    # The origin sees the Host the policy checked, not the one the client tried to smuggle.
    assert b"200 OK" in ok
    assert b"http www.example.test at 198.51.100.10" in ok
    assert refused.startswith(b"HTTP/1.1 403")
    assert b"X-Sandlot-Egress: not_listed" in refused
    assert after.startswith(b"HTTP/1.1 403")
    assert b"deny_all" in after
    decisions = [(e.host, e.decision, e.phase, e.reason) for e in seen]
    assert decisions == [
        ("www.example.test", "allow", "decide", "allow_domain"),
        ("www.example.test", "allow", "close", "allow_domain"),
        ("sibling.test", "deny", "decide", "not_listed"),
        ("www.example.test", "deny", "decide", "deny_all"),
    ]
    assert seen[1].bytes_down > 100
