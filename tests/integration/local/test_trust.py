"""Extra CA certificates on real ``local`` sandboxes (crun): an HTTPS server of the test's own,
on the sandbox's own loopback, with a certificate from a CA the test made, is refused by every
usual client inside until the sandbox trusts that CA; then Python's ``ssl``, curl, pip, git and
node all accept it. Forks, snapshots and resets keep the trust; the operator's
``SANDLOT_CA_CERTS`` gives it to every sandbox; images get it in their own layout.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandlot.backends.local import LocalBackend
from sandlot.errors import InvalidRequest
from sandlot.models import ExecResult, new_id

BUSYBOX = shutil.which("busybox")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Pki:
    """A CA of the test's own and a server certificate for ``localhost``/127.0.0.1 it signed."""

    def __init__(self, label: str) -> None:
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca = (
            x509.CertificateBuilder()
            .subject_name(_name(f"sandlot {label} CA"))
            .issuer_name(_name(f"sandlot {label} CA"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = (
            x509.CertificateBuilder()
            .subject_name(_name("localhost"))
            .issuer_name(self.ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        self.ca_pem = self.ca.public_bytes(serialization.Encoding.PEM).decode()
        self.cert_pem = leaf.public_bytes(serialization.Encoding.PEM).decode()
        self.key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki("local trust test")


# Runs inside the sandbox: an HTTPS server on its loopback (a thread of this process), then
# each client against it; prints one JSON object of what each saw.
PROBE = r"""
import json, os, ssl, subprocess, sys, threading, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

seen = []

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        seen.append(self.path)
        body = b"<html><body></body></html>" if self.path.startswith("/simple") else b"hello"
        self.send_response(404 if "/info/refs" in self.path else 200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tmp/tls/cert.pem", "/tmp/tls/key.pem")
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
base = f"https://localhost:{server.server_address[1]}"

def run(*argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return [p.returncode, (p.stdout + p.stderr)[-600:]]

out = {}
try:
    with urllib.request.urlopen(base + "/py", timeout=10) as r:
        out["python"] = [r.status, r.read().decode()]
except Exception as e:
    out["python"] = [None, str(getattr(e, "reason", e))]
out["curl"] = run("curl", "-sS", "--max-time", "10", base + "/curl")
out["pip"] = run("python3", "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                 "--retries", "0", "--timeout", "10", "--index-url", base + "/simple/",
                 "-d", "/tmp/dl", "sandlot-nothing")
out["git"] = run("git", "ls-remote", base + "/repo.git")
if os.path.exists("/usr/bin/node"):
    out["node"] = run("node", "-e",
        "require('https').get(process.argv[1], r => console.log(r.statusCode))"
        ".on('error', e => { console.log(e.code); process.exit(1); })", base + "/node")
out["seen"] = seen
out["env"] = {k: os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT",
              "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO")}
print(json.dumps(out))
"""


async def run(backend: LocalBackend, ref: str, *argv: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(list(argv), timeout=120)
    finally:
        await channel.close()


async def probe(backend: LocalBackend, ref: str, pki: Pki) -> dict[str, Any]:
    channel = await backend.channel(ref)
    try:
        await channel.write_file("/tmp/tls/cert.pem", pki.cert_pem.encode())
        await channel.write_file("/tmp/tls/key.pem", pki.key_pem.encode(), mode=0o600)
        await channel.write_file("/tmp/probe.py", PROBE.encode())
        result = await channel.exec(["python3", "/tmp/probe.py"], timeout=180)
    finally:
        await channel.close()
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert isinstance(out, dict)
    return out


def assert_refused(out: dict[str, Any]) -> None:
    assert "CERTIFICATE_VERIFY_FAILED" in str(out["python"][1]), out
    assert out["curl"][0] == 60, out  # curl: peer certificate cannot be authenticated
    assert out["pip"][0] != 0, out
    assert "CERTIFICATE_VERIFY_FAILED" in out["pip"][1], out
    assert out["git"][0] != 0, out
    assert "certificate" in out["git"][1], out  # "server certificate verification failed"
    if "node" in out:
        assert out["node"][0] == 1, out
    assert out["seen"] == [], out  # not one request got through a handshake


def assert_trusted(out: dict[str, Any], bundle: str) -> None:
    assert out["python"] == [200, "hello"], out
    assert out["curl"] == [0, "hello"], out
    seen = out["seen"]
    # pip and git got answers (an empty index, a 404): their handshakes were accepted.
    assert any(str(p).startswith("/simple/sandlot-nothing") for p in seen), out
    assert any("/repo.git/info/refs" in str(p) for p in seen), out
    assert "CERTIFICATE_VERIFY_FAILED" not in str(out["pip"]), out
    assert "certificate" not in str(out["git"]), out
    if "node" in out:
        assert out["node"] == [0, "200\n"], out
    assert set(out["env"].values()) == {bundle}, out


async def test_a_sandbox_trusts_its_spec_cas_and_only_then(
    backend: LocalBackend, isolation: str, spec_for, pki: Pki
) -> None:
    plain = await backend.create(new_id("sb"), spec_for(isolation))
    assert_refused(await probe(backend, plain, pki))
    await backend.destroy(plain)

    spec = spec_for(isolation, ca_certificates=[pki.ca_pem], env={"KEEP": "1"})
    ref = await backend.create(new_id("sb"), spec)
    assert_trusted(await probe(backend, ref, pki), "/etc/ssl/certs/ca-certificates.crt")
    # Added to what the root trusted already (the default root's bundle is the host's).
    host_bundle = Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    inside = (await run(backend, ref, "cat", "/etc/ssl/certs/ca-certificates.crt")).stdout
    assert inside == host_bundle + pki.ca_pem
    # A caller's own variable wins over sandlot's.
    channel = await backend.channel(ref)
    try:
        mine = await channel.exec(
            ["sh", "-c", "echo $SSL_CERT_FILE $KEEP"], env={"SSL_CERT_FILE": "/x"}
        )
    finally:
        await channel.close()
    assert mine.stdout == "/x 1\n"


async def test_forks_snapshots_and_resets_keep_the_trust(
    backend: LocalBackend, spec_for, pki: Pki
) -> None:
    spec = spec_for("namespaces", ca_certificates=[pki.ca_pem])
    ref = await backend.create(new_id("sb"), spec)
    # Right after create the sandbox is its baseline: the trust is below the writable layer.
    await backend.verify(ref)
    snap = await backend.snapshot(ref, new_id("snap"))
    [child] = await backend.fork(snap, [new_id("sb")], spec_for("namespaces"))
    assert_trusted(await probe(backend, child, pki), "/etc/ssl/certs/ca-certificates.crt")
    # A reset to the baseline swaps the writable layer, not the trust under it.
    await run(backend, ref, "sh", "-c", "rm -f /etc/ssl/certs/ca-certificates.crt")
    await backend.reset(ref, None, spec)
    assert_trusted(await probe(backend, ref, pki), "/etc/ssl/certs/ca-certificates.crt")
    for sid in (child, ref):
        await backend.destroy(sid)
    await backend.delete_snapshot(snap)


async def test_the_operators_setting_reaches_every_sandbox_and_a_bad_one_makes_nothing(
    make_backend, spec_for, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make_backend(pool={"namespaces": 1})
    await backend.fill_pool()  # made before the setting: a create with it must not claim it
    pem = tmp_path / "team-proxy.pem"
    pem.write_text(pki.ca_pem)
    monkeypatch.setenv("SANDLOT_CA_CERTS", str(pem))
    ref = await backend.create(new_id("sb"), spec_for("namespaces"))
    assert not str(
        json.loads((backend.state_dir / ref / "meta.json").read_text())["container"]
    ).startswith("slp-")
    assert_trusted(await probe(backend, ref, pki), "/etc/ssl/certs/ca-certificates.crt")
    await backend.destroy(ref)

    monkeypatch.setenv("SANDLOT_CA_CERTS", str(tmp_path / "missing.pem"))
    with pytest.raises(InvalidRequest, match=r"^SANDLOT_CA_CERTS: cannot read .*missing\.pem"):
        await backend.create(new_id("sb"), spec_for("namespaces"))
    assert await backend.list_owned() == {}

    # Without the setting, the pooled sandbox (made without it) serves a plain create.
    monkeypatch.delenv("SANDLOT_CA_CERTS")
    plain = await backend.create(new_id("sb"), spec_for("namespaces"))
    assert str(
        json.loads((backend.state_dir / plain / "meta.json").read_text())["container"]
    ).startswith("slp-")
    assert (
        await run(backend, plain, "sh", "-c", "echo ${SSL_CERT_FILE:-unset}")
    ).stdout == "unset\n"


@pytest.mark.skipif(BUSYBOX is None, reason="needs busybox (Debian package busybox-static)")
@pytest.mark.parametrize("layout", ["debian", "bare"])
async def test_images_get_the_cas_in_their_own_layout(
    backend: LocalBackend, spec_for, pki: Pki, tmp_path: Path, layout: str
) -> None:
    root = tmp_path / "rootfs"
    for d in ("bin", "etc", "tmp", "root"):
        (root / d).mkdir(parents=True)
    assert BUSYBOX is not None
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    for applet in ("sh", "cat", "ls", "env"):
        (root / "bin" / applet).symlink_to("busybox")
    other = Pki("image's own")
    if layout == "debian":
        (root / "etc" / "ssl" / "certs").mkdir(parents=True)
        (root / "etc" / "ssl" / "certs" / "ca-certificates.crt").write_text(other.ca_pem)
        (root / "usr" / "local" / "share" / "ca-certificates").mkdir(parents=True)
        bundle = "/etc/ssl/certs/ca-certificates.crt"
    else:
        bundle = "/etc/sandlot/ca-certificates.crt"
    ref = await backend.create(
        new_id("sb"), spec_for("namespaces", image=str(root), ca_certificates=[pki.ca_pem])
    )
    got = await run(
        backend, ref, "sh", "-c", 'cat "$SSL_CERT_FILE"; env | grep -c "=/etc/.*ca-cert"'
    )
    if layout == "debian":
        assert got.stdout == other.ca_pem + pki.ca_pem + "6\n", got
        files = await run(backend, ref, "ls", "/usr/local/share/ca-certificates/sandlot")
        [name] = files.stdout.split()
        copy = await run(backend, ref, "cat", f"/usr/local/share/ca-certificates/sandlot/{name}")
        assert copy.stdout == pki.ca_pem
    else:
        assert got.stdout == pki.ca_pem + "6\n", got
    env = await run(backend, ref, "sh", "-c", "echo $SSL_CERT_FILE $PIP_CERT")
    assert env.stdout == f"{bundle} {bundle}\n"
    # The image itself is untouched: the trust is a layer of its own.
    assert not (root / "etc" / "sandlot").exists()
    if layout == "debian":
        assert (root / "etc" / "ssl" / "certs" / "ca-certificates.crt").read_text() == other.ca_pem


def test_the_cli_takes_them_from_a_spec_file_and_names_a_bad_one(tmp_path: Path, pki: Pki) -> None:
    env = {**os.environ, "SANDLOT_HOME": str(tmp_path / "home"), "SANDLOT_BACKEND": "local"}

    def sandlot(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sandlot", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )

    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"network": "deny-all", "ca_certificates": [pki.ca_pem]}))
    bad.write_text(json.dumps({"network": "deny-all", "ca_certificates": [pki.key_pem]}))
    refused = sandlot("create", "--spec", str(bad))
    assert refused.returncode != 0
    assert "ca_certificates: entry 0: it holds a private key" in refused.stderr, refused.stderr
    assert "-----" not in refused.stderr  # the key itself is not repeated
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert json.loads(sandlot("list", "--json").stdout) == []

    made = sandlot("run", "--spec", str(good), "--", "sh", "-c", 'tail -c 2000 "$CURL_CA_BUNDLE"')
    assert made.returncode == 0, made.stderr
    assert made.stdout.endswith(pki.ca_pem)
