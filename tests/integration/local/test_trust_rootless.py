"""Extra CA certificates on rootless ``local`` sandboxes, run by a real unprivileged user (the
driver and user of ``test_rootless.py``, loaded from there): the trust layer keeps an image's
directory owners, subordinate ids included, as a rootful one does."""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

pytestmark = [pytest.mark.needs_root, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "sandlot_tests_rootless_driver", Path(__file__).with_name("test_rootless.py")
)
assert _spec is not None
assert _spec.loader is not None
_rootless = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rootless)
user = _rootless.user
driver = _rootless.driver


def _ca(name: str) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def test_rootless_sandboxes_trust_their_cas_in_the_default_root_and_an_image(
    user: object, driver: object
) -> None:
    ca, own = _ca("sandlot rootless test CA"), _ca("the image's own CA")
    ref = driver("create", id="rl-trust-1", spec={"network": "deny-all", "ca_certificates": [ca]})[
        "ref"
    ]
    out = driver("sh", ref=ref, script='echo "$SSL_CERT_FILE"; cat "$SSL_CERT_FILE"')
    path, _, bundle = out["stdout"].partition("\n")
    assert path == "/etc/ssl/certs/ca-certificates.crt", out
    assert bundle == Path("/etc/ssl/certs/ca-certificates.crt").read_text() + ca

    # An image with Debian's layout, its /usr/local/share owned by group staff (50): a
    # subordinate id outside, which the trust layer's copy of the directory must keep.
    src = user.mkdir(driver.dir / "image-src")
    (src / "etc" / "ssl" / "certs").mkdir(parents=True)
    (src / "etc" / "ssl" / "certs" / "ca-certificates.crt").write_text(own)
    shared = src / "usr" / "local" / "share"
    (shared / "ca-certificates").mkdir(parents=True)
    os.chown(shared, 0, 50)
    shared.chmod(0o2775)
    tarball = driver.dir / "image.tar"
    subprocess.run(["tar", "-C", str(src), "-cf", str(tarball), "."], check=True)
    tarball.chmod(0o644)
    spec = {"network": "deny-all", "image": str(tarball), "ca_certificates": [ca]}
    image = driver("create", id="rl-trust-2", spec=spec)["ref"]
    assert driver("read", ref=image, path="/etc/ssl/certs/ca-certificates.crt") == own + ca
    loader = Path("/usr/lib64/ld-linux-x86-64.so.2").resolve()
    if not loader.is_relative_to("/usr"):
        pytest.skip("needs an x86-64 host with a merged /usr")
    # Nothing runs in this image: the host's stat, with the host's loader (as the agent runs).
    stat = [f"/.sandlot{loader}", "--library-path", f"/.sandlot{loader.parent}"]
    stat += ["/.sandlot/usr/bin/stat", "-c", "%g %a %n", "/usr/local/share"]
    got = driver("sh_argv", ref=image, argv=stat)
    assert got["stdout"] == "50 2775 /usr/local/share\n", got
    ls = [*stat[:3], "/.sandlot/usr/bin/ls", "/usr/local/share/ca-certificates/sandlot"]
    [name] = driver("sh_argv", ref=image, argv=ls)["stdout"].split()
    assert driver("read", ref=image, path=f"/usr/local/share/ca-certificates/sandlot/{name}") == ca
