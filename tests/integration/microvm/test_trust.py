"""Extra CA certificates in microVM guests (real QEMU, TCG here), end to end through the egress
proxy: the fake internet of the network suite (its own namespace, documentation addresses) has
an HTTPS server whose certificate comes from a CA that suite's fixture made. The proxy keeps TLS
end to end, so a guest sees that certificate, as a guest behind a host's intercepting proxy sees
the proxy's: refused by curl and Python until the sandbox trusts the CA, accepted after, in
forks and after a reset too. The operator's ``SANDLOT_CA_CERTS`` does the same for every VM.

A set of extra CAs is written into the template booted for it, so it costs one cold boot per
set and machine (here: one with a NIC, shared, and one without), and nothing per create. At
most one VM runs at a time.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.backends.microvm import ImagePaths, MicrovmBackend
from sandlot.errors import InvalidRequest
from sandlot.models import NetworkAllowlist, SandboxSpec, new_id
from sandlot.network.service import SandboxNetworks

pytestmark = [pytest.mark.slow, pytest.mark.needs_root, pytest.mark.timeout(900)]

# The fake internet is the network suite's fixture; it is loaded from there, not copied.
_spec = importlib.util.spec_from_file_location(
    "sandlot_tests_fakenet_trust", Path(__file__).parents[1] / "network" / "conftest.py"
)
assert _spec is not None
assert _spec.loader is not None
_fakenet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakenet)
pki = _fakenet.pki
fakenet = _fakenet.fakenet

ALLOW_WWW = NetworkAllowlist(allow_domains=["www.example.test"])
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

# Runs inside the guest: each client against one URL, with the guest's default trust (no CA
# given to any of them); prints one JSON object.
PROBE = r"""
import json, os, subprocess, sys, urllib.request
url = sys.argv[1]
out = {}
try:
    with urllib.request.urlopen(url, timeout=20) as r:
        out["python"] = [r.status, r.read().decode()]
except Exception as e:
    out["python"] = [None, str(getattr(e, "reason", e))]
p = subprocess.run(["curl", "-sS", "--max-time", "20", url], capture_output=True, text=True)
out["curl"] = [p.returncode, p.stdout + p.stderr]
if sys.argv[2:] == ["requests"]:  # its import alone takes seconds under TCG
    try:
        from pip._vendor import requests  # what pip itself downloads with
        r = requests.get(url, timeout=20)
        out["requests"] = [r.status_code, r.text]
    except Exception as e:
        out["requests"] = [None, type(e).__name__]
out["env"] = {k: os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT",
              "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO")}
print(json.dumps(out))
"""


async def probe(
    backend: MicrovmBackend, ref: str, url: str, *, requests: bool = False
) -> dict[str, Any]:
    channel = await backend.channel(ref)
    try:
        await channel.write_file("/tmp/probe.py", PROBE.encode())
        argv = ["python3", "/tmp/probe.py", url, *(["requests"] if requests else [])]
        result = await channel.exec(argv, timeout=240)
    finally:
        await channel.close()
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert isinstance(out, dict)
    return out


def assert_refused(out: dict[str, Any]) -> None:
    assert "CERTIFICATE_VERIFY_FAILED" in str(out["python"][1]), out
    assert out["curl"][0] == 60, out  # curl: peer certificate cannot be authenticated
    if "requests" in out:
        assert out["requests"] == [None, "SSLError"], out
    assert set(out["env"].values()) == {None}, out


def assert_trusted(out: dict[str, Any], body: str) -> None:
    assert out["python"][0] == 200, out
    assert out["python"][1].startswith(body), out
    assert out["curl"][0] == 0, out
    assert out["curl"][1].startswith(body), out
    if "requests" in out:
        assert out["requests"][0] == 200, out
    assert set(out["env"].values()) == {BUNDLE}, out


@pytest.fixture
async def netvm(
    microvm_image: ImagePaths, microvm_state: Path, tmp_path: Path, fakenet: Any
) -> AsyncIterator[MicrovmBackend]:
    if subprocess.run(["which", "socat"], capture_output=True, check=False).returncode != 0:
        pytest.skip("needs socat (apt-get install socat)")
    networks = SandboxNetworks(tmp_path / "network", nameserver=fakenet.nameserver)
    impl = MicrovmBackend(microvm_state, image=microvm_image, networks=networks)
    yield impl
    for ref in (await impl.list_owned()).values():
        await impl.destroy(ref)
    await impl.aclose()
    networks._stop_daemon()


async def test_a_guest_trusts_its_spec_cas_through_the_proxy_in_forks_and_resets(
    netvm: MicrovmBackend, fakenet: Any
) -> None:
    url, body = "https://www.example.test/", "https www.example.test at 198.51.100.10"
    plain = await netvm.create(new_id("sb"), SandboxSpec(network=ALLOW_WWW))
    assert_refused(await probe(netvm, plain, url, requests=True))
    await netvm.destroy(plain)

    spec = SandboxSpec(network=ALLOW_WWW, ca_certificates=[fakenet.ca.read_text()])
    ref = await netvm.create(new_id("sb"), spec)
    # The CAs are part of the baseline: a fresh VM verifies as one.
    assert (await netvm.verify(ref)).ok
    assert_trusted(await probe(netvm, ref, url, requests=True), body)
    channel = await netvm.channel(ref)
    try:
        listed = await channel.list_files("/usr/local/share/ca-certificates/sandlot")
        bundle = b"".join([c async for c in channel.read_file(BUNDLE)]).decode()
    finally:
        await channel.close()
    assert len(listed) == 1, listed
    assert bundle.endswith(fakenet.ca.read_text())
    assert bundle.count("BEGIN CERTIFICATE") > 100  # Debian's own are still there

    snap = await netvm.snapshot(ref, new_id("snap"))
    [child] = await netvm.fork(snap, [new_id("sb")], SandboxSpec(network=ALLOW_WWW))
    assert_trusted(await probe(netvm, child, url), body)
    await netvm.destroy(child)
    await netvm.delete_snapshot(snap)

    report = await netvm.reset_to_baseline(ref)
    assert report.ok, report.to_dict()
    assert_trusted(await probe(netvm, ref, url), body)


async def test_the_operators_setting_reaches_an_allow_all_guest(
    netvm: MicrovmBackend, fakenet: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if "allow-all" not in netvm.capabilities().network:
        pytest.skip("allow-all needs root with ip and nft")
    monkeypatch.setenv("SANDLOT_CA_CERTS", str(tmp_path / "missing.pem"))
    with pytest.raises(InvalidRequest, match=r"^SANDLOT_CA_CERTS: cannot read"):
        await netvm.create(new_id("sb"), SandboxSpec(network="allow-all"))
    assert await netvm.list_owned() == {}

    monkeypatch.setenv("SANDLOT_CA_CERTS", str(fakenet.ca))
    ref = await netvm.create(new_id("sb"), SandboxSpec(network="allow-all"))
    # NAT, no proxy: straight to the fake internet's address (its certificate names it).
    assert_trusted(await probe(netvm, ref, "https://198.51.100.10/"), "https 198.51.100.10")


async def test_a_guest_without_a_nic_gets_them_too(backend: MicrovmBackend, fakenet: Any) -> None:
    ca = fakenet.ca.read_text()
    ref = await backend.create(new_id("sb"), SandboxSpec(network="deny-all", ca_certificates=[ca]))
    channel = await backend.channel(ref)
    try:
        got = await channel.exec(
            ["sh", "-c", 'echo "$GIT_SSL_CAINFO"; tail -c 2000 "$SSL_CERT_FILE"']
        )
    finally:
        await channel.close()
    path, _, tail = got.stdout.partition("\n")
    assert path == BUNDLE, got
    assert tail.endswith(ca), got
