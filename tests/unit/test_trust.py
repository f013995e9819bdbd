"""Extra CA certificates: the spec field, the operator's SANDLOT_CA_CERTS, the CLI's --ca-cert,
and the bundle a sandbox gets (``sandlot.backends.trust``). The backends' use of them runs in
``tests/integration/local/test_trust.py`` and ``tests/integration/microvm/test_trust.py``."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandlot.backends import trust
from sandlot.backends.local.rootfs import Layer, RootfsCache, trust_bundle
from sandlot.cli.spec import spec_from_options
from sandlot.errors import InvalidRequest
from sandlot.models import SandboxSpec, parse_model


def make_ca(name: str) -> str:
    """A self-signed CA certificate (PEM) nobody else trusts."""
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


def private_key_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


CA1 = make_ca("sandlot unit CA 1")
CA2 = make_ca("sandlot unit CA 2")
BROKEN = "-----BEGIN CERTIFICATE-----\nTm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"


# ------------------------------------------------------------------ the spec field


def test_spec_keeps_one_canonical_certificate_per_item() -> None:
    # A bundle file (comments, two certificates, one of them twice) becomes its certificates.
    bundle = f"# Issuer: CN=sandlot unit CA 1\n{CA1}\n{CA2}{CA1}"
    spec = SandboxSpec(ca_certificates=[bundle, CA2.replace("\n", "\r\n")])
    assert spec.ca_certificates == [CA1, CA2]
    # What is stored is what comes back: a record read again validates to itself.
    assert SandboxSpec.model_validate(spec.model_dump(mode="json")) == spec
    assert SandboxSpec().ca_certificates == []


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("not a certificate", "entry 1: no PEM certificate in it"),
        (BROKEN, "entry 1: certificate 0 in it is not valid X.509"),
        (CA2 + private_key_pem(), "entry 1: it holds a private key"),
        (
            "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n",
            "entry 1: it holds a X509 CRL block",
        ),
    ],
)
def test_a_bad_certificate_is_one_error_naming_it(bad: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_model(SandboxSpec, {"ca_certificates": [CA1, bad]})
    assert str(e.value).startswith("invalid SandboxSpec: ca_certificates: "), e.value
    assert says in str(e.value)
    assert "-----" not in str(e.value)  # the refused text (a key, say) is not repeated


def test_a_whole_distribution_bundle_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="at most 100 certificates, got 101"):
        parse_model(SandboxSpec, {"ca_certificates": [make_ca(f"ca {i}") for i in range(101)]})


# ------------------------------------------------------------------ the operator's setting


def test_operator_setting_reads_files_and_the_host_shorthand(tmp_path: Path) -> None:
    one = tmp_path / "one.pem"
    one.write_text(CA1)
    host = tmp_path / "host"
    (host / "team").mkdir(parents=True)
    (host / "team" / "proxy.crt").write_text(CA2)
    (host / "README").write_text("update-ca-certificates reads *.crt files only\n")
    env = {"SANDLOT_CA_CERTS": f"{one}::host"}
    assert trust.operator_certificates(env, host_dir=host) == (CA1, CA2)
    assert trust.operator_certificates({}, host_dir=host) == ()
    assert trust.host_certificates(tmp_path / "nowhere") == ()
    # Asked for by name, the host's CAs must exist: a sandbox would silently lack them.
    with pytest.raises(InvalidRequest, match=r"^SANDLOT_CA_CERTS \(host\): this host adds no"):
        trust.operator_certificates(env, host_dir=tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{missing}", "SANDLOT_CA_CERTS: cannot read {missing}"),
        ("{broken}", "SANDLOT_CA_CERTS: {broken}: certificate 0 in it is not valid X.509"),
        ("{empty}", "SANDLOT_CA_CERTS: {empty}: no PEM certificate in it"),
        ("relative.pem", "SANDLOT_CA_CERTS: 'relative.pem' is neither 'host' nor an absolute"),
    ],
)
def test_a_bad_operator_setting_is_refused_naming_the_file(
    tmp_path: Path, value: str, says: str
) -> None:
    paths = {
        "missing": tmp_path / "missing.pem",
        "broken": tmp_path / "broken.pem",
        "empty": tmp_path / "empty.pem",
    }
    paths["broken"].write_text(BROKEN)
    paths["empty"].write_text("")
    with pytest.raises(InvalidRequest) as e:
        trust.operator_certificates({"SANDLOT_CA_CERTS": value.format(**paths)})
    assert str(e.value).startswith(says.format(**paths)), e.value


def test_doctor_reports_the_operators_setting(tmp_path: Path) -> None:
    one = tmp_path / "one.pem"
    one.write_text(CA1 + CA2)
    good = trust.doctor_check({"SANDLOT_CA_CERTS": str(one)})
    assert (good.ok, good.detail) == (True, "2 certificate(s)")
    assert trust.doctor_check({}).detail == "none (unset)"
    bad = trust.doctor_check({"SANDLOT_CA_CERTS": str(tmp_path / "gone.pem")})
    assert not bad.ok
    assert bad.detail.startswith("SANDLOT_CA_CERTS: cannot read"), bad
    assert bad.fix == "fix or unset SANDLOT_CA_CERTS"


def test_sandbox_trust_is_the_operators_and_the_specs_in_one_order(tmp_path: Path) -> None:
    one = tmp_path / "one.pem"
    one.write_text(CA1)
    env = {"SANDLOT_CA_CERTS": str(one)}
    both = trust.certificates_for(SandboxSpec(ca_certificates=[CA2, CA1]), env)
    assert sorted(both) == sorted([CA1, CA2])
    # The same set however it was given: caches and templates are keyed by it.
    assert both == trust.certificates_for(SandboxSpec(ca_certificates=[CA1, CA2]), {})
    assert trust.certificates_for(SandboxSpec(), {}) == ()
    assert trust.key(both) != trust.key((CA1,))


# ------------------------------------------------------------------ the bundle and variables


def test_bundle_adds_what_the_base_lacks_once() -> None:
    base = f"{CA1}".encode()
    merged = trust.merge_bundle(base, (CA1, CA2))
    assert merged.startswith(base)
    assert merged.count(b"BEGIN CERTIFICATE") == 2
    assert merged == trust.merge_bundle(merged, (CA1, CA2))  # adding again changes nothing
    # A base without a final newline does not glue two PEM lines together.
    assert trust.merge_bundle(base.rstrip(b"\n"), (CA2,)).count(b"\n-----BEGIN") == 1
    assert trust.merge_bundle(None, (CA2,)) == CA2.encode()


def test_variables_point_every_client_at_the_bundle() -> None:
    env = trust.environment("/etc/ssl/certs/ca-certificates.crt")
    assert set(env) == {
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "PIP_CERT",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
        "GIT_SSL_CAINFO",
    }
    assert set(env.values()) == {"/etc/ssl/certs/ca-certificates.crt"}


# ------------------------------------------------------------------ the CLI


def test_cli_ca_cert_reads_files_and_host_over_the_spec_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = tmp_path / "one.pem", tmp_path / "two.pem"
    one.write_text(CA1)
    two.write_text(CA2)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"ca_certificates": [CA1]}))
    got = spec_from_options({"spec": spec_file, "ca_cert": [str(two)]})
    assert got.ca_certificates == [CA1, CA2]
    host = tmp_path / "host"
    host.mkdir()
    (host / "proxy.crt").write_text(CA2)
    monkeypatch.setattr(trust, "HOST_CA_DIR", host)
    assert spec_from_options({"ca_cert": ["host", str(one)]}).ca_certificates == [CA2, CA1]


def test_cli_ca_cert_names_the_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text(CA1 + private_key_pem())
    with pytest.raises(InvalidRequest) as e:
        spec_from_options({"ca_cert": [str(bad)]})
    assert str(e.value).startswith(f"--ca-cert {bad}: it holds a private key"), e.value
    with pytest.raises(InvalidRequest, match=r"--ca-cert .*nope\.pem: cannot read"):
        spec_from_options({"ca_cert": [str(tmp_path / "nope.pem")]})


# ------------------------------------------------------------------ the local trust layer


def test_a_trust_layer_never_follows_an_images_symlinks_out_of_it(tmp_path: Path) -> None:
    # An image whose links name host paths: inside the sandbox they lead into the image.
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret.crt").write_text(CA2)
    image = tmp_path / "image"
    (image / "etc" / "ssl" / "certs").mkdir(parents=True)
    (image / "etc" / "ssl" / "certs" / "ca-certificates.crt").symlink_to(host / "secret.crt")
    (image / "etc" / "sandlot").symlink_to(host)
    layer = RootfsCache(tmp_path / "cache").trust_layer(Layer(image, "dir:test"), (CA1,))
    # Its bundle link leads nowhere inside, so it is no Debian layout: sandlot's own bundle,
    # with nothing of the host file in it, written where /etc/sandlot leads inside the image.
    assert trust_bundle([layer.key]) == trust.OWN_BUNDLE
    written = [p for p in layer.path.rglob("*") if not p.is_dir()]
    assert written == [layer.path / str(host).lstrip("/") / "ca-certificates.crt"], written
    assert written[0].read_text() == CA1
    assert not any(p.is_symlink() for p in layer.path.rglob("*"))
    assert sorted(p.name for p in host.iterdir()) == ["secret.crt"]
    assert (host / "secret.crt").read_text() == CA2
    # The same image and CAs are one layer, built once.
    again = RootfsCache(tmp_path / "cache").trust_layer(Layer(image, "dir:test"), (CA1,))
    assert again == layer


def test_the_cli_takes_ca_cert_on_create_and_refuses_a_file_that_is_none(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    ca = tmp_path / "ca.pem"
    ca.write_text(CA1)
    env = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "200"}
    cli = [sys.executable, "-m", "sandlot"]
    made = subprocess.run(
        [*cli, "create", "--ca-cert", str(ca), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["spec"]["ca_certificates"] == [CA1]
    bad = subprocess.run(
        [*cli, "create", "--ca-cert", "/etc/hostname"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 1
    (line,) = bad.stderr.strip().splitlines()
    assert "/etc/hostname" in line
