"""Fixtures: a fake internet in its own network namespace, and sandbox networks to test.

The fake internet is a namespace ``slt-inet-XXXX`` joined to the host by a veth
(192.0.2.1 host side, 192.0.2.2 inside) and holding documentation addresses (198.51.100.0/24,
203.0.113.0/24) on its loopback; the host routes those two ranges to it. It serves HTTP, HTTPS
(a certificate from a CA the fixture makes) and DNS. Nothing here touches a real outside
address. Every test needs root, ``ip``, ``nft`` and ``curl``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandlot.network import netns as nl
from sandlot.network.service import SandboxNetworks

HERE = Path(__file__).parent
INET_HOST = "192.0.2.1"
INET_PEER = "192.0.2.2"
DNS = "198.51.100.53"
ZONE = {
    "example.test": ["198.51.100.10"],
    "www.example.test": ["198.51.100.10"],
    "api.example.test": ["198.51.100.11"],
    "deep.api.example.test": ["198.51.100.11"],
    "sibling.test": ["198.51.100.20"],
    "cidr.test": ["203.0.113.10"],
    "blocked.test": ["203.0.113.66"],
    "mixed.test": ["203.0.113.66", "198.51.100.20"],
    "meta.test": ["169.254.169.254"],
    "localhost.test": ["127.0.0.1"],
    "hostveth.test": [INET_HOST],
}
SERVICE_ADDRESSES = [
    "198.51.100.10",
    "198.51.100.11",
    "198.51.100.20",
    DNS,
    "203.0.113.10",
    "203.0.113.66",
]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "root (network namespaces, veth, nftables)"
    for tool, pkg in (("ip", "iproute2"), ("nft", "nftables"), ("curl", "curl")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {pkg})"
    return None


def pytest_collection_modifyitems(items):
    reason = _missing()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.needs_root)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"needs {reason}"))


def sh(
    *argv: str, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, check=check, input=input, timeout=60
    )


# ------------------------------------------------------------------ PKI


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandlot test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in ZONE]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in SERVICE_ADDRESSES]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake internet")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


# ------------------------------------------------------------------ fake internet


class FakeNet:
    def __init__(self, netns: str, link: str, dns_log: Path, ca: Path) -> None:
        self.netns = netns
        self.link = link
        self.dns_log = dns_log
        self.ca = ca
        self.nameserver = DNS

    def queried(self) -> list[str]:
        try:
            return self.dns_log.read_text().split()
        except FileNotFoundError:
            return []


@pytest.fixture(scope="session")
def fakenet(pki, tmp_path_factory):
    if _missing():
        pytest.skip(f"needs {_missing()}")
    d = tmp_path_factory.mktemp("fakenet")
    tag = secrets.token_hex(2)
    ns, link = f"slt-inet-{tag}", f"sltinet{tag}"
    sh("ip", "netns", "add", ns)
    proc = None
    try:
        sh("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{INET_HOST}/30", "dev", link)
        sh("ip", "link", "set", link, "up")
        batch = f"addr add {INET_PEER}/30 dev eth0\nlink set eth0 up\nlink set lo up\n"
        batch += "".join(f"addr add {a}/32 dev lo\n" for a in SERVICE_ADDRESSES)
        sh("ip", "-n", ns, "-batch", "-", input=batch)
        for net in ("198.51.100.0/24", "203.0.113.0/24"):
            sh("ip", "route", "replace", net, "via", INET_PEER, "dev", link)
        config = {
            "cert": str(pki["cert"]),
            "key": str(pki["key"]),
            "zone": ZONE,
            "dns_log": str(d / "dns.log"),
            "dns": DNS,
        }
        (d / "config.json").write_text(json.dumps(config))
        server_log = open(d / "server.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                str(HERE / "fakenet_server.py"),
                str(d / "config.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=server_log,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", (d / "server.log").read_text()
        yield FakeNet(ns, link, d / "dns.log", pki["ca"])
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
            server_log.close()
        for net in ("198.51.100.0/24", "203.0.113.0/24"):
            sh("ip", "route", "del", net, check=False)
        sh("ip", "link", "del", link, check=False)
        sh("ip", "netns", "del", ns, check=False)


# ------------------------------------------------------------------ sandbox networks


@pytest.fixture
def nets(tmp_path, fakenet):
    service = SandboxNetworks(tmp_path / "network", nameserver=fakenet.nameserver)
    made: list[str] = []
    service.made = made  # type: ignore[attr-defined]
    yield service
    for sid in made:
        service.teardown_sync(sid)
    service._stop_daemon()


@pytest.fixture
def new_id(nets):
    def make() -> str:
        sid = f"sbt-{secrets.token_hex(5)}"
        nets.made.append(sid)
        return sid

    return make


def inside(net, *argv: str, env: dict[str, str] | None = None, timeout: float = 20):
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}
    return subprocess.run(
        ["ip", "netns", "exec", net.netns, *argv],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def curl(net, url: str, ca: Path, *extra: str, proxy: bool = True):
    """curl from inside a sandbox: (exit code, HTTP status, body)."""
    env = net.env() if proxy else {}
    p = inside(
        net,
        "curl",
        "-sS",
        "--max-time",
        "5",
        "--cacert",
        str(ca),
        "-o",
        "-",
        "-w",
        "\n%{http_code}",
        *extra,
        url,
        env=env,
    )
    body, _, code = p.stdout.rpartition("\n")
    return p.returncode, code.strip(), body + p.stderr


def wait_for(pred, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def kernel_objects():
    return nl.list_kernel_objects()


class Tools:
    inside = staticmethod(inside)
    curl = staticmethod(curl)
    wait_for = staticmethod(wait_for)
    kernel_objects = staticmethod(kernel_objects)
    sh = staticmethod(sh)


@pytest.fixture
def tools():
    return Tools
