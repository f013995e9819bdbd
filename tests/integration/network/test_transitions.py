"""Changing a running local sandbox's network policy: every transition, both ways.

Each test boots a real crun sandbox whose network service resolves with the fake internet's
DNS server, changes its policy at run time and checks from inside, with commands started
after the change (exec, a background process, a terminal), through the channel opened
before it (a Manager keeps its channels): the proxy variables, ``/etc/resolv.conf``, the
interfaces, what is reachable through the proxy, directly and over UDP. Under ``allow-all``
nothing inside resolves a name (its resolver is the host's real one): it reaches the fake
internet by address.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.channel.base import Channel
from sandlot.errors import NotSupported
from sandlot.models import NetworkAllowlist, NetworkPolicy, SandboxSpec, new_id
from sandlot.network.service import SandboxNetworks
from sandlot.sdk import AsyncSandlot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ALLOW_WWW = NetworkAllowlist(allow_domains=["www.example.test"])
POLICIES: dict[str, NetworkPolicy] = {
    "allow-all": "allow-all",
    "deny-all": "deny-all",
    "allowlist": ALLOW_WWW,
}
PROXY_VARS = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
]

# What a new command sees: its proxy variables and resolver configuration.
SEEN = (
    f"import json, os; print(json.dumps({{'env': {{k: os.environ.get(k) for k in {PROXY_VARS!r}}}, "
    "'resolv': open('/etc/resolv.conf').read()}))"
)

# Runs inside: what the sandbox can reach. ``names`` fetches names through whatever proxy the
# environment names (only asked for where the sandbox must not resolve names itself).
PROBE = r"""
import json, socket, sys, time, urllib.error, urllib.request

def fetch(url, proxies=None):
    handlers = [] if proxies is None else [urllib.request.ProxyHandler(proxies)]
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=5) as r:
            return [r.status, r.read(100).decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.headers.get("X-Sandlot-Egress")]
    except OSError as e:
        return ["error", str(e)]

def tcp(addr, port):
    try:
        socket.create_connection((addr, port), timeout=3).close()
        return "open"
    except OSError as e:
        return "error: %s" % e

def udp_dns(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03www\x07example\x04test\x00\x00\x01\x00\x01"
    try:
        s.sendto(query, (addr, 53))
        s.recvfrom(512)
        return "answered"
    except OSError as e:
        return "error: %s" % e

def lookup(name):
    t0 = time.monotonic()
    try:
        socket.getaddrinfo(name, 80)
        return "resolved"
    except OSError as e:
        return "error: %s (%.2f s)" % (e, time.monotonic() - t0)

out = {
    "ifaces": sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]),
    "direct": fetch("http://198.51.100.10/", proxies={}),
    "tcp": tcp("198.51.100.10", 80),
    "udp": udp_dns("198.51.100.53"),
}
if "names" in sys.argv[1:]:
    out["allowed"] = fetch("http://www.example.test/")
    out["denied"] = fetch("http://sibling.test/")
    out["lookup"] = lookup("www.example.test")
print(json.dumps(out))
"""


def _host_nameservers() -> list[str]:
    """The host's nameservers an ``allow-all`` sandbox is given (those not on loopback)."""
    servers = []
    for line in Path("/etc/resolv.conf").read_text().splitlines():
        parts = line.split()
        if (
            len(parts) > 1
            and parts[0] == "nameserver"
            and not ipaddress.ip_address(parts[1].split("%")[0]).is_loopback
        ):
            servers.append(parts[1])
    return servers


def _nameservers(resolv: str) -> list[str]:
    return [
        line.split()[1]
        for line in resolv.splitlines()
        if line.startswith("nameserver") and len(line.split()) > 1
    ]


@pytest.fixture(scope="module")
def rootfs_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rootfs-cache")


@pytest.fixture
async def networks(tmp_path: Path, fakenet: Any) -> AsyncIterator[SandboxNetworks]:
    service = SandboxNetworks(tmp_path / "network", nameserver=fakenet.nameserver)
    yield service
    service._stop_daemon()


@pytest.fixture
async def backend(
    tmp_path: Path, rootfs_cache: Path, networks: SandboxNetworks
) -> AsyncIterator[LocalBackend]:
    if shutil.which("crun") is None:
        pytest.skip("needs crun (Debian package crun)")
    impl = LocalBackend(tmp_path / "state", networks=networks, cache=rootfs_cache)
    yield impl
    for ref in (await impl.list_owned()).values():
        await impl.destroy(ref)
    await impl.aclose()


async def _seen_by_new_commands(channel: Channel) -> list[dict[str, Any]]:
    """What an exec, a background process and a terminal started now each see."""
    result = await channel.exec(["python3", "-c", SEEN], timeout=30)
    assert result.exit_code == 0, result.stderr
    seen = [json.loads(result.stdout)]
    proc = await channel.start_process(["python3", "-c", SEEN])
    await channel.wait_process(proc.id, timeout=30)
    out = b"".join([c.data async for c in channel.process_output(proc.id) if c.stream == "stdout"])
    seen.append(json.loads(out))
    pty = await channel.open_pty(["python3", "-c", SEEN], rows=24, cols=1000)
    raw = b""
    while True:
        chunk = await pty.read()
        if not chunk:
            break
        raw += chunk
    assert await pty.wait() == 0
    seen.append(json.loads(raw.decode().strip()))
    return seen


async def _probe(channel: Channel, *, names: bool) -> dict[str, Any]:
    await channel.write_file("/tmp/probe.py", PROBE.encode())
    argv = ["python3", "/tmp/probe.py", *(["names"] if names else [])]
    result = await channel.exec(argv, timeout=60)
    assert result.exit_code == 0, result.stderr
    return dict(json.loads(result.stdout))


async def _check(channel: Channel, kind: str, proxy_url: str | None) -> None:
    """Assert that new commands through ``channel`` see exactly policy ``kind``."""
    for seen in await _seen_by_new_commands(channel):
        env = seen["env"]
        if kind == "allowlist":
            assert proxy_url is not None
            want = dict.fromkeys(PROXY_VARS, proxy_url)
            want.update(NO_PROXY="localhost,127.0.0.1,::1", no_proxy="localhost,127.0.0.1,::1")
            assert env == want, seen
        else:
            assert env == dict.fromkeys(PROXY_VARS), seen
        servers = _nameservers(seen["resolv"])
        if kind == "allow-all":
            assert servers == _host_nameservers()[:3], seen
        else:
            # No resolver: the sandbox cannot send a query anywhere (an allowlist's names
            # are resolved by its proxy).
            assert servers == [], seen
    got = await _probe(channel, names=kind == "allowlist")
    if kind == "allow-all":
        assert got["ifaces"] == ["eth0", "lo"], got
        assert got["direct"][0] == 200, got
        assert got["direct"][1].startswith("http 198.51.100.10 at 198.51.100.10"), got
        assert got["tcp"] == "open", got
        assert got["udp"] == "answered", got
    elif kind == "deny-all":
        assert got["ifaces"] == ["lo"], got
        assert got["direct"][0] == "error", got
        assert "unreachable" in got["tcp"].lower(), got
        assert got["udp"] != "answered", got
    else:
        assert got["ifaces"] == ["eth0", "lo"], got
        assert got["allowed"][0] == 200, got
        assert got["allowed"][1].startswith("http www.example.test"), got
        assert got["denied"] == [403, "not_listed"], got
        assert got["direct"][0] == "error", got
        # No default route: raw TCP and UDP fail at once, and no name resolves inside.
        assert "unreachable" in got["tcp"].lower(), got
        assert "unreachable" in got["udp"].lower(), got
        assert got["lookup"].startswith("error"), got


TRANSITIONS = [(a, b) for a in POLICIES for b in POLICIES if a != b]


@pytest.mark.parametrize(
    ("before", "after"), TRANSITIONS, ids=[f"{a}-to-{b}" for a, b in TRANSITIONS]
)
async def test_new_commands_follow_a_policy_change(
    backend: LocalBackend, networks: SandboxNetworks, fakenet: Any, before: str, after: str
) -> None:
    ref = await backend.create(new_id("sb"), SandboxSpec(network=POLICIES[before]))
    channel = await backend.channel(ref)
    try:
        await _check(channel, before, networks.get(ref).proxy_url)
        started = time.monotonic()
        await backend.update_network(ref, POLICIES[after])
        took = time.monotonic() - started
        # The channel opened before the change (a Manager keeps its channels), and new ones.
        await _check(channel, after, networks.get(ref).proxy_url)
        fresh = await backend.channel(ref)
        try:
            await _check(fresh, after, networks.get(ref).proxy_url)
        finally:
            await fresh.close()
        assert took < 1.0, took
        # And back again.
        await backend.update_network(ref, POLICIES[before])
        await _check(channel, before, networks.get(ref).proxy_url)
    finally:
        await channel.close()


async def test_through_the_manager_a_change_holds_across_stop_and_resume(
    backend: LocalBackend, networks: SandboxNetworks, tmp_path: Path, fakenet: Any
) -> None:
    # ``sandlot network set``: the Manager's cached channel, then a stop, then a resume that
    # must come back with the policy set last (not the one the sandbox was made with).
    async with AsyncSandlot(tmp_path / "home", backends={"local": backend}) as client:
        sb = await client.create(SandboxSpec(network=ALLOW_WWW))
        channel = await client.manager._channel(await client.manager.get(sb.id))
        ref = str((await client.manager.get(sb.id)).backend_ref)
        await _check(channel, "allowlist", networks.get(ref).proxy_url)
        await sb.update_network("allow-all")
        channel = await client.manager._channel(await client.manager.get(sb.id))
        await _check(channel, "allow-all", None)
        await sb.stop()
        await sb.resume()
        channel = await client.manager._channel(await client.manager.get(sb.id))
        await _check(channel, "allow-all", None)
        await sb.update_network("deny-all")
        await sb.stop()
        await sb.resume()
        channel = await client.manager._channel(await client.manager.get(sb.id))
        await _check(channel, "deny-all", None)
        await sb.update_network(ALLOW_WWW)
        await sb.stop()
        await sb.resume()
        channel = await client.manager._channel(await client.manager.get(sb.id))
        await _check(channel, "allowlist", networks.get(ref).proxy_url)
        await sb.destroy()


async def test_a_pooled_sandbox_claimed_for_allow_all_can_resolve(
    tmp_path: Path, rootfs_cache: Path, networks: SandboxNetworks, fakenet: Any
) -> None:
    # Pooled sandboxes boot deny-all; a claim switches them to the spec's policy at run time.
    pooled = LocalBackend(
        tmp_path / "pooled", networks=networks, cache=rootfs_cache, pool={"namespaces": 1}
    )
    try:
        await pooled.fill_pool()
        assert pooled.pooled()
        ref = await pooled.create(new_id("sb"), SandboxSpec(network="allow-all"))
        channel = await pooled.channel(ref)
        try:
            await _check(channel, "allow-all", None)
        finally:
            await channel.close()
    finally:
        for ref in (await pooled.list_owned()).values():
            await pooled.destroy(ref)
        await pooled.drain_pool()
        await pooled.aclose()


async def test_gvisor_refuses_a_network_before_changing_anything(
    backend: LocalBackend, networks: SandboxNetworks
) -> None:
    if shutil.which("runsc") is None:
        pytest.skip("needs runsc (Debian package runsc)")
    spec = SandboxSpec(network="deny-all", backend_options={"local": {"isolation": "gvisor"}})
    ref = await backend.create(new_id("sb"), spec)
    for policy in ("allow-all", ALLOW_WWW):
        with pytest.raises(NotSupported, match="gVisor"):
            await backend.update_network(ref, policy)
        assert networks.get(ref).kind == "deny-all"
    await backend.update_network(ref, "deny-all")  # what it has: nothing to do
    channel = await backend.channel(ref)
    try:
        result = await channel.exec(["cat", "/proc/net/dev"])
        assert "eth0" not in result.stdout
    finally:
        await channel.close()


def test_a_policy_set_by_another_process_reaches_the_next_command(nets: Any, new_id: Any) -> None:
    # Another process (``sandlot network set``) changes the policy; a backend that keeps its
    # channels asks its own service object at each command, which must not answer from memory.
    sid = new_id()
    nets.prepare_sync(sid, ALLOW_WWW)
    elsewhere = SandboxNetworks(nets.state_dir)
    assert elsewhere.env(sid) == nets.get(sid).env() != {}
    nets.prepare_sync(sid, "allow-all")
    assert elsewhere.env(sid) == {}
    nets.prepare_sync(sid, "deny-all")
    assert elsewhere.env(sid) == {}
    nets.prepare_sync(sid, ALLOW_WWW)
    assert elsewhere.env(sid) == nets.get(sid).env() != {}


# ----------------------------------------------------------------------------- rootless

# The unprivileged test user and its interpreter come from the rootless suite, loaded from
# there rather than copied.
_rl_spec = importlib.util.spec_from_file_location(
    "sandlot_tests_rootless", Path(__file__).parents[1] / "local" / "test_rootless.py"
)
assert _rl_spec is not None
assert _rl_spec.loader is not None
_rootless = importlib.util.module_from_spec(_rl_spec)
_rl_spec.loader.exec_module(_rootless)

# Runs as the unprivileged user: a rootless backend, one sandbox taken through its network
# changes; prints one JSON object of what new commands saw after each step.
ROOTLESS_SCRIPT = r"""
import json, sys
import anyio
from sandlot.backends.local import LocalBackend
from sandlot.config import backend_dir, home
from sandlot.errors import NotSupported
from sandlot.models import NetworkAllowlist, SandboxSpec

SEEN, PROBE = sys.argv[2], sys.argv[3]

async def main():
    backend = LocalBackend(backend_dir(home(), "local"))
    out = {}
    ref = await backend.create(sys.argv[1], SandboxSpec(network="allow-all"))
    channel = await backend.channel(ref)

    async def look():
        seen = await channel.exec(["python3", "-c", SEEN], timeout=30)
        got = await channel.exec(["python3", "-c", PROBE], timeout=60)
        return {**json.loads(seen.stdout), **json.loads(got.stdout)}

    try:
        out["allow-all"] = await look()
        await backend.update_network(ref, "deny-all")
        out["deny-all"] = await look()
        try:
            await backend.update_network(ref, NetworkAllowlist(allow_domains=["www.example.test"]))
            out["allowlist"] = "accepted"
        except NotSupported as e:
            out["allowlist"] = str(e)
        out["still deny-all"] = await look()
        await backend.update_network(ref, "allow-all")
        out["allow-all again"] = await look()
        await backend.update_network(ref, "deny-all")
        await channel.close()
        await backend.stop(ref)
        await backend.start(ref, SandboxSpec(network="deny-all"))
        channel = await backend.channel(ref)
        out["deny-all after a restart"] = await look()
    finally:
        await channel.close()
        await backend.destroy(ref)
        await backend.aclose()
    print(json.dumps(out))

anyio.run(main)
"""


@pytest.fixture
def tun_for_users() -> Iterator[None]:
    """slirp4netns opens /dev/net/tun with the user's rights: opened up for the test, as
    Debian's udev has it (0666)."""
    tun = Path("/dev/net/tun")
    if not tun.exists():
        pytest.skip("needs /dev/net/tun (CONFIG_TUN)")
    if shutil.which("slirp4netns") is None:
        pytest.skip("needs slirp4netns (Debian package slirp4netns)")
    mode = tun.stat().st_mode & 0o777
    if mode & 0o006 != 0o006:
        tun.chmod(0o666)
    try:
        yield
    finally:
        tun.chmod(mode)


@pytest.mark.usefixtures("tun_for_users")
def test_rootless_switches_between_deny_all_and_allow_all(fakenet: Any) -> None:
    reason = _rootless._missing()
    if reason:
        pytest.skip(f"needs {reason}")
    user = _rootless.User(_rootless.USER)
    try:
        base = user.mkdir(user.base / "transitions")
        env = {
            "HOME": user.pw.pw_dir,
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "PYTHONPATH": user.pythonpath,
            "SANDLOT_HOME": str(user.mkdir(base / "home")),
            "SANDLOT_CACHE": str(user.cache),
            "XDG_RUNTIME_DIR": str(user.mkdir(base / "run")),
            "LANG": "C.UTF-8",
        }
        proc = subprocess.run(
            [
                "setpriv",
                f"--reuid={user.uid}",
                f"--regid={user.gid}",
                "--init-groups",
                user.python,
                "-c",
                ROOTLESS_SCRIPT,
                new_id("rl"),
                SEEN,
                PROBE,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd="/",
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout)
    finally:
        user.remove()
    for step in ("allow-all", "allow-all again"):
        seen = got[step]
        assert seen["env"] == dict.fromkeys(PROXY_VARS), seen
        assert _nameservers(seen["resolv"]) == ["10.0.2.3"], seen  # slirp4netns's resolver
        assert seen["ifaces"] == ["lo", "tap0"], seen
        assert seen["direct"][0] == 200, seen
        assert seen["tcp"] == "open", seen
        assert seen["udp"] == "answered", seen
    for step in ("deny-all", "still deny-all", "deny-all after a restart"):
        seen = got[step]
        assert seen["env"] == dict.fromkeys(PROXY_VARS), seen
        assert _nameservers(seen["resolv"]) == [], seen
        assert seen["ifaces"] == ["lo"], seen
        assert "unreachable" in seen["tcp"].lower(), seen
        assert seen["udp"] != "answered", seen
    assert "rootless" in got["allowlist"], got["allowlist"]


# ----------------------------------------------------------------------------- microVMs

# The guest image and state directory come from the microVM suite's fixtures.
_mv_spec = importlib.util.spec_from_file_location(
    "sandlot_tests_microvm", Path(__file__).parents[1] / "microvm" / "conftest.py"
)
assert _mv_spec is not None
assert _mv_spec.loader is not None
_microvm = importlib.util.module_from_spec(_mv_spec)
_mv_spec.loader.exec_module(_microvm)
microvm_image = _microvm.microvm_image
microvm_state = _microvm.microvm_state


@pytest.mark.timeout(600)
async def test_an_allow_all_microvm_takes_every_policy_and_back(
    microvm_image: Any, microvm_state: Path, tmp_path: Path, fakenet: Any
) -> None:
    from sandlot.backends.microvm import MicrovmBackend

    # A VM made with allow-all (NAT inside its own namespace) can take any policy: its NIC
    # stays, the namespace around QEMU's NAT is re-prepared, and the proxy variables follow.
    networks = SandboxNetworks(tmp_path / "network", nameserver=fakenet.nameserver)
    vm = MicrovmBackend(microvm_state, image=microvm_image, networks=networks)
    if "allow-all" not in vm.capabilities().network:
        pytest.skip("allow-all microVMs need root with ip and nft")
    steps = ["deny-all", "allowlist", "allow-all", "allowlist", "deny-all", "allow-all"]
    try:
        ref = await vm.create(new_id("sb"), SandboxSpec(network="allow-all"))
        channel = await vm.channel(ref)
        await channel.write_file("/tmp/probe.py", PROBE.encode())
        for kind in ["allow-all", *steps]:
            await vm.update_network(ref, POLICIES[kind])
            seen = json.loads((await channel.exec(["python3", "-c", SEEN], timeout=120)).stdout)
            argv = ["python3", "/tmp/probe.py", *(["names"] if kind == "allowlist" else [])]
            result = await channel.exec(argv, timeout=120)
            assert result.exit_code == 0, result.stderr
            got = json.loads(result.stdout)
            proxied = kind == "allowlist"
            assert got["ifaces"] == ["eth0", "lo"], (kind, got)
            # The guest keeps user-mode networking's resolver; it answers only under
            # allow-all (it forwards from inside the namespace).
            assert _nameservers(seen["resolv"]) == ["10.0.2.3"], (kind, seen)
            if kind == "allow-all":
                assert seen["env"] == dict.fromkeys(PROXY_VARS), (kind, seen)
                assert got["direct"][0] == 200, (kind, got)
                assert got["tcp"] == "open", (kind, got)
                assert got["udp"] == "answered", (kind, got)
                continue
            assert got["direct"][0] == "error", (kind, got)
            assert got["tcp"] != "open", (kind, got)
            assert got["udp"] != "answered", (kind, got)
            if proxied:
                url = networks.get(ref).proxy_url
                assert url is not None
                assert seen["env"]["HTTPS_PROXY"] == seen["env"]["http_proxy"] == url, seen
                assert got["allowed"][0] == 200, (kind, got)
                assert got["denied"] == [403, "not_listed"], (kind, got)
                assert got["lookup"].startswith("error"), (kind, got)
            else:
                assert seen["env"] == dict.fromkeys(PROXY_VARS), (kind, seen)
        await channel.close()
        # A stop and a start with the policy set last: it comes back with it.
        await vm.update_network(ref, ALLOW_WWW)
        await vm.stop(ref)
        await vm.start(ref, SandboxSpec(network=ALLOW_WWW))
        channel = await vm.channel(ref)
        result = await channel.exec(["python3", "/tmp/probe.py", "names"], timeout=120)
        got = json.loads(result.stdout)
        assert got["allowed"][0] == 200, got
        assert got["tcp"] != "open", got
        await channel.close()
    finally:
        for r in (await vm.list_owned()).values():
            await vm.destroy(r)
        await vm.aclose()
        networks._stop_daemon()
