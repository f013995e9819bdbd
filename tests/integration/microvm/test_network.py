"""Network policy for microVMs, end to end: real QEMU guests (TCG here), the detached egress
daemon, and the fake internet of the network suite (its own namespace with HTTP, HTTPS and DNS
servers on documentation addresses; the proxy resolves with that DNS server).

An allowlisted VM has one NIC on QEMU's restricted user-mode network, whose only way out is
the proxy address QEMU forwards to the daemon's unix socket; an ``allow-all`` VM has NAT from
inside its own network namespace; a ``deny-all`` VM has no NIC. At most one VM runs at a time.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from sandlot.backends.base import SnapshotRef
from sandlot.backends.microvm import ImagePaths, MicrovmBackend, qemu
from sandlot.errors import NotSupported
from sandlot.models import NetworkAllowlist, SandboxSpec, new_id
from sandlot.network.policy import EgressEvent
from sandlot.network.service import SandboxNetworks
from sandlot.sdk import AsyncSandbox, AsyncSandlot

pytestmark = [pytest.mark.slow, pytest.mark.needs_root, pytest.mark.timeout(600)]

# The fake internet is the network suite's fixture; it is loaded from there, not copied.
_spec = importlib.util.spec_from_file_location(
    "sandlot_tests_fakenet", Path(__file__).parents[1] / "network" / "conftest.py"
)
assert _spec is not None
assert _spec.loader is not None
_fakenet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakenet)
pki = _fakenet.pki
fakenet = _fakenet.fakenet

ALLOW_WWW = NetworkAllowlist(allow_domains=["www.example.test"])

# Runs inside the guest: each op is [name, *args]; prints one JSON list of results.
PROBE = r"""
import json, socket, ssl, subprocess, sys, urllib.error, urllib.request

def fetch(url, ca=None):
    handlers = []
    if url.startswith("https"):
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca)))
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=10) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "egress": e.headers.get("X-Sandlot-Egress"),
                "body": e.read().decode()}
    except (urllib.error.URLError, OSError) as e:
        return {"error": str(getattr(e, "reason", e))}

def direct(url):
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=5) as r:
            return {"status": r.status, "body": r.read().decode()}
    except (urllib.error.URLError, OSError) as e:
        return {"error": str(getattr(e, "reason", e))}

def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "open"
    except OSError as e:
        return type(e).__name__

def udp_dns(server, name):
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00\x00\x01\x00\x01"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(q, (server, 53))
        s.recvfrom(512)
        return "answered"
    except OSError as e:
        return type(e).__name__

def resolve(name):
    try:
        return socket.getaddrinfo(name, 80, socket.AF_INET)[0][4][0]
    except OSError as e:
        return type(e).__name__

def sh(cmd):
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return [p.returncode, p.stdout, p.stderr]

print(json.dumps([globals()[op[0]](*op[1:]) for op in json.loads(sys.argv[1])]))
"""


async def _probe(backend: MicrovmBackend, ref: str, *ops: list[Any]) -> list[Any]:
    channel = await backend.channel(ref)
    try:
        await channel.write_file("/tmp/probe.py", PROBE.encode())
        result = await channel.exec(["python3", "/tmp/probe.py", json.dumps(ops)], timeout=120)
    finally:
        await channel.close()
    assert result.exit_code == 0, result.stderr
    return list(json.loads(result.stdout))


async def _probe_sdk(sb: AsyncSandbox, *ops: list[Any]) -> list[Any]:
    await sb.write_file("/tmp/probe.py", PROBE.encode())
    result = await sb.exec(["python3", "/tmp/probe.py", json.dumps(ops)], timeout=120)
    assert result.exit_code == 0, result.stderr
    return list(json.loads(result.stdout))


def _detail(body: Mapping[str, Any]) -> dict[str, Any]:
    detail = body["detail"]
    assert isinstance(detail, dict), body
    return detail


async def _put_ca(backend: MicrovmBackend, ref: str, ca: Path) -> None:
    channel = await backend.channel(ref)
    try:
        await channel.write_file("/tmp/ca.pem", ca.read_bytes())
    finally:
        await channel.close()


def _events(backend: MicrovmBackend, ref: str) -> list[EgressEvent]:
    raw, _ = backend.network_events(ref)
    return [EgressEvent.from_json(e) for e in raw]


def _qemu_argv(backend: MicrovmBackend, ref: str) -> list[str]:
    pid = qemu.read_pid(backend._vm_dir(ref))
    assert pid is not None
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.fixture
async def netvm(
    microvm_image: ImagePaths, microvm_state: Path, tmp_path: Path, fakenet: Any
) -> AsyncIterator[MicrovmBackend]:
    if subprocess.run(["which", "socat"], capture_output=True).returncode != 0:
        pytest.skip("needs socat (apt-get install socat)")
    networks = SandboxNetworks(tmp_path / "network", nameserver=fakenet.nameserver)
    impl = MicrovmBackend(microvm_state, image=microvm_image, networks=networks)
    yield impl
    for ref in (await impl.list_owned()).values():
        await impl.destroy(ref)
    await impl.aclose()
    networks._stop_daemon()


async def test_allowlisted_vm_reaches_only_allowed_domains_through_the_proxy(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    ref = await netvm.create(new_id("sb"), SandboxSpec(network=ALLOW_WWW))
    assert "allowlist" in netvm.capabilities().network
    await _put_ca(netvm, ref, fakenet.ca)
    seen, http, https, body, sibling, sibling_tls, apex = await _probe(
        netvm,
        ref,
        ["sh", "ls /sys/class/net; cat /proc/net/route; env | grep -i _proxy | sort"],
        ["fetch", "http://www.example.test/hello?x=1"],
        ["fetch", "https://www.example.test/", "/tmp/ca.pem"],
        ["sh", "python3 -c 'import os; print(os.environ[\"HTTPS_PROXY\"])'"],
        ["fetch", "http://sibling.test/"],
        ["fetch", "https://sibling.test/", "/tmp/ca.pem"],
        ["fetch", "http://example.test/"],
    )
    # What the guest sees: one NIC, no default route, the proxy in its environment.
    out = seen[1]
    assert out.split("\n")[:2] == ["eth0", "lo"], out
    routes = [line.split() for line in out.split("Iface", 1)[1].split("\n")[1:] if "\t" in line]
    assert [r[1] for r in routes if r[0] == "eth0"] == ["0002000A"], out  # 10.0.2.0/24 only
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy"):
        assert f"{name}=" in out, out
    assert body[1].strip() == "http://10.0.2.100:3128"

    assert http["status"] == 200, http
    assert http["body"].startswith("http www.example.test at 198.51.100.10 got 0 GET /hello?x=1")
    # TLS is end to end: the guest verified the fake internet's certificate itself.
    assert https["status"] == 200, https
    assert https["body"].startswith("https www.example.test at 198.51.100.10")
    assert sibling["status"] == 403, sibling
    assert sibling["egress"] == "not_listed", sibling
    assert "403" in sibling_tls["error"], sibling_tls
    assert apex["status"] == 403, apex
    assert "sibling.test" not in fakenet.queried()

    events = _events(netvm, ref)
    decided = {(e.host, e.decision, e.reason) for e in events if e.phase == "decide"}
    assert ("www.example.test", "allow", "allow_domain") in decided
    assert ("sibling.test", "deny", "not_listed") in decided
    assert all(e.sandbox_id == ref for e in events)
    assert netvm.suggest_network(ref).allow_domains == ["www.example.test"]


async def test_nothing_but_the_proxy_leaves_an_allowlisted_vm(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    # Host services on loopback and on every address, which the guest must not reach either.
    loop_listener = socket.create_server(("127.0.0.1", 0))
    any_listener = socket.create_server(("0.0.0.0", 0))
    lport, aport = loop_listener.getsockname()[1], any_listener.getsockname()[1]
    # A name asked nowhere else in the session: the fake DNS server logs every query.
    leak = f"leak-{secrets.token_hex(4)}.example.test"
    try:
        ref = await netvm.create(new_id("sb"), SandboxSpec(network=ALLOW_WWW))
        # The guest is root: it adds a default route itself, so what stops it below is QEMU's
        # restricted network, not the missing route.
        results = await _probe(
            netvm,
            ref,
            ["tcp", "198.51.100.10", 80],
            ["sh", "/run/sandlot/busybox ip route add default via 10.0.2.2"],
            ["tcp", "198.51.100.10", 80],
            ["tcp", "198.51.100.10", 443],
            ["tcp", "10.0.2.2", lport],
            ["tcp", "10.0.2.2", aport],
            ["tcp", "192.0.2.1", aport],
            ["tcp", "169.254.169.254", 80],
            ["tcp", "10.0.2.100", 80],
            ["udp_dns", "198.51.100.53", leak],
            ["udp_dns", "10.0.2.3", leak],
            ["resolve", leak],
            ["direct", "http://198.51.100.10/"],
            ["sh", "/run/sandlot/busybox ping -c 1 -W 2 198.51.100.10"],
            ["fetch", "http://www.example.test/"],
        )
    finally:
        loop_listener.close()
        any_listener.close()
    no_route, added, *tcps, dns1, dns2, resolved, direct, ping, through = results
    assert no_route == "OSError", results  # ENETUNREACH: no route at all
    assert added[0] == 0, added
    assert "open" not in tcps, results
    assert dns1 != "answered", results
    assert dns2 != "answered", results
    assert resolved == "gaierror", results
    assert "error" in direct, results
    assert ping[0] != 0, ping
    assert leak not in fakenet.queried()
    assert through["status"] == 200, through  # the proxy still works


async def test_runtime_policy_update_stop_start_and_destroy_leave_nothing(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    sid = new_id("sb")
    ref = await netvm.create(sid, SandboxSpec(network=ALLOW_WWW))
    sock = Path(str(netvm._record(ref).egress_socket))
    assert sock.is_socket()
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    before = await _probe(netvm, ref, ["fetch", "http://sibling.test/"])
    assert before[0]["status"] == 403

    started = time.monotonic()
    await netvm.update_network(ref, NetworkAllowlist(allow_domains=["sibling.test"]))
    took = time.monotonic() - started
    after = await _probe(
        netvm, ref, ["fetch", "http://sibling.test/"], ["fetch", "http://www.example.test/"]
    )
    assert after[0]["status"] == 200, after
    assert after[1]["status"] == 403, after
    assert took < 1.0, took

    # deny-all keeps the NIC (it cannot be removed from a running VM); the proxy refuses all.
    await netvm.update_network(ref, "deny-all")
    denied = await _probe(netvm, ref, ["fetch", "http://sibling.test/"])
    assert denied[0]["egress"] == "deny_all", denied
    with pytest.raises(NotSupported):
        await netvm.update_network(ref, "allow-all")

    # Stop and start: the network comes back with the policy the caller passes.
    await netvm.stop(ref)
    await netvm.start(ref, SandboxSpec(network=NetworkAllowlist(allow_domains=["sibling.test"])))
    again = await _probe(netvm, ref, ["fetch", "http://sibling.test/"])
    assert again[0]["status"] == 200, again

    log = netvm.networks.log_path(ref)
    assert log.exists()
    await netvm.destroy(ref)
    assert not sock.exists()
    assert not log.exists()
    assert list((netvm.networks.state_dir / "sandboxes").glob("*.json")) == []
    assert await netvm.networks.daemon_health() is None  # the last user gone: daemon stopped
    assert not (netvm.networks.state_dir / "netd.sock").exists()


async def test_deny_all_vm_has_no_nic_and_snapshots_keep_their_devices(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    ref = await netvm.create(new_id("sb"), SandboxSpec(network="deny-all"))
    argv = _qemu_argv(netvm, ref)
    assert "-nic" in argv
    assert argv[argv.index("-nic") + 1] == "none"
    assert not any(a.startswith("virtio-net") for a in argv)
    [out] = await _probe(netvm, ref, ["sh", "ls /sys/class/net"])
    assert out[1].split() == ["lo"]
    with pytest.raises(NotSupported):
        await netvm.update_network(ref, ALLOW_WWW)
    await netvm.update_network(ref, "deny-all")  # what it already has
    snap = await netvm.snapshot(ref, new_id("snap"))
    await netvm.destroy(ref)
    # A memory image without a NIC restores only into a VM without one.
    with pytest.raises(NotSupported):
        await netvm.fork(snap, [new_id("sb")], SandboxSpec(network=ALLOW_WWW))
    assert await netvm.list_owned() == {}
    await netvm.delete_snapshot(snap)


async def test_snapshot_of_an_allowlisted_vm_forks_with_its_own_proxy(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    ref = await netvm.create(new_id("sb"), SandboxSpec(network=ALLOW_WWW))
    parent_socket = netvm._record(ref).egress_socket
    snap: SnapshotRef = await netvm.snapshot(ref, new_id("snap"))
    await netvm.destroy(ref)
    [child] = await netvm.fork(
        snap, [new_id("sb")], SandboxSpec(network=NetworkAllowlist(allow_domains=["sibling.test"]))
    )
    assert netvm._record(child).egress_socket not in (None, parent_socket)
    got = await _probe(
        netvm, child, ["fetch", "http://sibling.test/"], ["fetch", "http://www.example.test/"]
    )
    assert got[0]["status"] == 200, got
    assert got[1]["status"] == 403, got
    assert {e.sandbox_id for e in _events(netvm, child)} == {child}
    await netvm.destroy(child)
    await netvm.delete_snapshot(snap)


async def test_allow_all_vm_gets_nat_but_not_the_host_or_metadata(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    if "allow-all" not in netvm.capabilities().network:
        pytest.skip("allow-all needs root with ip and nft")
    loop_listener = socket.create_server(("127.0.0.1", 0))
    any_listener = socket.create_server(("0.0.0.0", 0))
    lport, aport = loop_listener.getsockname()[1], any_listener.getsockname()[1]
    try:
        ref = await netvm.create(new_id("sb"), SandboxSpec(network="allow-all"))
        argv = _qemu_argv(netvm, ref)
        assert not any("restrict=on" in a for a in argv)
        results = await _probe(
            netvm,
            ref,
            ["direct", "http://198.51.100.10/"],
            ["tcp", "203.0.113.10", 443],
            ["udp_dns", "198.51.100.53", "www.example.test"],
            ["tcp", "10.0.2.2", lport],
            ["tcp", "10.0.2.2", aport],
            ["tcp", "192.0.2.1", aport],
            ["tcp", "169.254.169.254", 80],
            ["sh", "cat /etc/resolv.conf; env | grep -ic _proxy"],
        )
        direct, tls_port, udp, *blocked, seen = results
        assert direct["status"] == 200, results
        assert direct["body"].startswith("http 198.51.100.10 at 198.51.100.10")
        assert tls_port == "open", results
        assert udp == "answered", results  # UDP is NATed too
        assert "open" not in blocked, results
        assert "nameserver 10.0.2.3" in seen[1]
        assert seen[1].strip().endswith("0")  # no proxy variables

        # The same VM can be narrowed at run time: its namespace lets out only the proxy.
        await netvm.update_network(ref, ALLOW_WWW)
        narrowed = await _probe(
            netvm,
            ref,
            ["fetch", "http://www.example.test/"],
            ["fetch", "http://sibling.test/"],
            ["tcp", "198.51.100.10", 80],
        )
        assert narrowed[0]["status"] == 200, narrowed
        assert narrowed[1]["status"] == 403, narrowed
        assert narrowed[2] != "open", narrowed
        netns = netvm.networks.get(ref).netns
        await netvm.destroy(ref)
        assert (
            netns
            not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )
    finally:
        loop_listener.close()
        any_listener.close()


def test_unix_listener_serves_its_user_only_and_goes_away(tmp_path: Path, fakenet: Any) -> None:
    nets = SandboxNetworks(tmp_path / "network", nameserver=fakenet.nameserver)
    sock = tmp_path / "egress.sock"
    try:
        net = nets.prepare_unix_sync("sbx-unix", ALLOW_WWW, sock)
        assert net.proxy_socket == str(sock)
        assert net.proxy_url is None
        assert net.env() == {}
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(sock))
            s.sendall(b"GET http://www.example.test/x HTTP/1.1\r\nHost: www.example.test\r\n\r\n")
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply
        # Another user cannot even connect (the socket is 0600 and the daemon checks the uid).
        code = subprocess.run(
            [
                sys.executable,
                "-c",
                "import os, socket, sys\n"
                "os.setgid(65534); os.setuid(65534)\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(3)\n"
                "s.sendall(b'GET http://www.example.test/ HTTP/1.1\\r\\n\\r\\n')\n"
                "sys.exit(4 if s.recv(10) else 5)",
                str(sock),
            ],
            check=False,
        ).returncode
        assert code in (3, 5), code
        # A unix sandbox has no namespace to publish ports from.
        with pytest.raises(NotSupported):
            nets.expose_port_sync("sbx-unix", 8080)
        nets.teardown_sync("sbx-unix")
        assert not sock.exists()
        assert nets._ping() is None
    finally:
        nets._stop_daemon()
        sock.unlink(missing_ok=True)


async def test_through_the_sdk_egress_becomes_receipts_and_updates_persist(
    netvm: MicrovmBackend, tmp_path: Path, fakenet: Any
) -> None:
    # The Manager's path: exec gets the proxy environment, the log drains into receipts, and
    # update_network is gated, applied and stored (a resume would bring it back).
    async with AsyncSandlot(tmp_path / "home", backends={"microvm": netvm}) as client:
        sb = await client.create(SandboxSpec(network=ALLOW_WWW))
        allowed, denied = await _probe_sdk(
            sb, ["fetch", "http://www.example.test/"], ["fetch", "http://sibling.test/"]
        )
        assert allowed["status"] == 200, allowed
        assert denied["status"] == 403, denied
        log = await sb.network_log()
        decided = {(e["host"], e["decision"]) for e in log if e["phase"] == "decide"}
        assert decided == {("www.example.test", "allow"), ("sibling.test", "deny")}, log
        egress = [r for r in client.receipts.tail(40) if r.type == "network.egress"]
        seen = {(_detail(r.body)["host"], r.body["decision"]) for r in egress}
        assert ("www.example.test", "ALLOW") in seen, seen
        assert ("sibling.test", "DENY") in seen, seen

        info = await sb.update_network(NetworkAllowlist(allow_domains=["sibling.test"]))
        assert isinstance(info.spec.network, NetworkAllowlist)
        assert info.spec.network.allow_domains == ["sibling.test"]
        [now] = await _probe_sdk(sb, ["fetch", "http://sibling.test/"])
        assert now["status"] == 200, now
        await sb.destroy()
        assert await netvm.list_owned() == {}


async def test_a_pooled_vm_claimed_for_an_allowlist_gets_its_proxy(
    netvm: MicrovmBackend, microvm_image: ImagePaths, microvm_state: Path, fakenet: Any
) -> None:
    pooled = MicrovmBackend(
        microvm_state, image=microvm_image, networks=netvm.networks, pool_size=1
    )
    pooled._spawn_refill = lambda machine: None  # type: ignore[method-assign]  # no detached refill in a test
    try:
        with pytest.raises(NotSupported):
            await pooled.fill_pool(SandboxSpec(network="allow-all"))
        assert await pooled.fill_pool(SandboxSpec(network=ALLOW_WWW)) == 1
        [entry] = [
            p for p in (microvm_state / "pool").glob("*/pool-*") if (p / "egress-socket").exists()
        ]
        pid = qemu.read_pid(entry)
        ref = await pooled.create(new_id("sb"), SandboxSpec(network=ALLOW_WWW))
        assert qemu.read_pid(pooled._vm_dir(ref)) == pid  # claimed, not restored
        got = await _probe(
            pooled, ref, ["fetch", "http://www.example.test/"], ["fetch", "http://sibling.test/"]
        )
        assert got[0]["status"] == 200, got
        assert got[1]["status"] == 403, got
        assert {e.sandbox_id for e in _events(pooled, ref)} == {ref}
        await pooled.destroy(ref)
    finally:
        await pooled.drain_pool()
        await pooled.aclose()
