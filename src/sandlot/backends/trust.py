"""Extra CA certificates a sandbox trusts, shared by the backends and the CLI.

A host behind an intercepting proxy trusts the proxy's CA; a sandbox with a root filesystem of
its own (an image, a microVM guest) trusts only its distribution's, so HTTPS from inside fails.
A sandbox's extra CAs are the operator's default (:data:`SETTING`, read on the host that makes
the sandbox) plus its spec's ``ca_certificates``. Each backend puts them into the sandbox's
system trust at create, the same way:

- a root with Debian's layout (:data:`DEBIAN_BUNDLE` is a file) gets each certificate in
  :data:`DEBIAN_CA_DIR`/``sandlot/`` (so an ``update-ca-certificates`` run inside keeps them)
  when that directory is the root's own, and the bundle rewritten with them appended;
- any other root gets :data:`OWN_BUNDLE`: its distribution's bundle, if one of
  :data:`OTHER_BUNDLES` is there, with them appended;

and every command it runs gets :func:`environment`: the variables Python, pip, requests, curl,
git and node read, pointing at that bundle (the caller's own variables win). Nothing here runs
``update-ca-certificates``: it takes 25 s in a microVM under TCG, and the bundle it would write
is the one made here. This module imports only the models, errors and the backend base.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import ValidationError

from sandlot.backends.base import DoctorCheck
from sandlot.errors import InvalidRequest
from sandlot.models import SandboxSpec

__all__ = [
    "DEBIAN_BUNDLE",
    "DEBIAN_CA_DIR",
    "ENV_VARS",
    "HOST",
    "HOST_CA_DIR",
    "OTHER_BUNDLES",
    "OWN_BUNDLE",
    "SETTING",
    "bundle_path",
    "certificates_for",
    "certificates_in",
    "doctor_check",
    "environment",
    "file_name",
    "fingerprint",
    "host_certificates",
    "key",
    "merge_bundle",
    "operator_certificates",
]

SETTING = "SANDLOT_CA_CERTS"
"""The operator's default: colon-separated absolute paths of PEM files, or :data:`HOST`."""
HOST = "host"
"""Stands for the CA files this host adds to its distribution's (:data:`HOST_CA_DIR`)."""
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
"""Where a Debian host keeps the CAs it adds (``update-ca-certificates`` reads ``*.crt``)."""

DEBIAN_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
"""Debian's system bundle (OpenSSL's default file there, through ``/usr/lib/ssl/cert.pem``)."""
DEBIAN_CA_DIR = "/usr/local/share/ca-certificates"
"""Debian's directory of locally added CAs, inside a sandbox."""
OWN_BUNDLE = "/etc/sandlot/ca-certificates.crt"
"""The bundle sandlot writes in a root without Debian's layout."""
OTHER_BUNDLES = (
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",  # Alpine
    "/etc/ssl/ca-bundle.pem",  # openSUSE
)
"""Other distributions' bundles, whose certificates :data:`OWN_BUNDLE` starts with."""

ENV_VARS = (
    "SSL_CERT_FILE",  # OpenSSL's default file: Python's ssl, curl, git, wget, …
    "REQUESTS_CA_BUNDLE",  # requests (its certifi bundle otherwise)
    "PIP_CERT",  # pip (an upgraded pip vendors certifi)
    "CURL_CA_BUNDLE",  # curl built with another TLS library
    "NODE_EXTRA_CA_CERTS",  # node (added to its built-in roots)
    "GIT_SSL_CAINFO",  # git over https
)
"""The variables every command of a sandbox with extra CAs gets, naming its bundle."""

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.DOTALL)


def certificates_in(text: str, source: str) -> list[str]:
    """The certificates in one PEM text, as the spec stores them.

    Validated by :class:`SandboxSpec` itself, so the rules are the field's.

    Raises:
        InvalidRequest: ``source: <what is wrong>``.
    """
    try:
        return SandboxSpec(ca_certificates=[text]).ca_certificates
    except ValidationError as e:
        reason = str(e.errors()[0]["msg"]).removeprefix("Value error, ").removeprefix("entry 0: ")
        msg = f"{source}: {reason}"
        raise InvalidRequest(msg) from None


def _read(path: Path, source: str) -> list[str]:
    try:
        st = path.stat()
        return list(_parse_file(str(path), st.st_ino, st.st_size, st.st_mtime_ns, source))
    except OSError as e:
        msg = f"{source}: cannot read {path}: {e.strerror or e}"
        raise InvalidRequest(msg) from None


@functools.lru_cache(maxsize=64)
def _parse_file(path: str, _ino: int, _size: int, _mtime_ns: int, source: str) -> tuple[str, ...]:
    # Keyed by the file's identity and version too: the operator's files are read at every
    # create, and parsing them was most of its cost (0.6 ms for two); a changed file is a new key.
    text = Path(path).read_text(errors="replace")
    return tuple(certificates_in(text, f"{source}: {path}"))


def host_certificates(
    directory: Path | None = None, *, source: str | None = None
) -> tuple[str, ...]:
    """The CAs this host adds to its distribution's: every ``*.crt`` under ``directory``
    (default :data:`HOST_CA_DIR`), as ``update-ca-certificates`` takes them.

    Args:
        directory: Where to look (tests point it elsewhere).
        source: Who asked for them (``--ca-cert host``): then finding none is an error, since
            the sandbox would silently lack what was asked for. Without it, none is ``()``.

    Raises:
        InvalidRequest: A file is unreadable or not certificates, or (with ``source``) there
            are none.
    """
    top = directory if directory is not None else HOST_CA_DIR
    out: list[str] = []
    for path in sorted(top.rglob("*.crt")) if top.is_dir() else []:
        if path.is_file():
            out.extend(_read(path, source or HOST))
    if source is not None and not out:
        msg = f"{source}: this host adds no CAs to its distribution's (no *.crt under {top})"
        raise InvalidRequest(msg)
    return tuple(out)


def operator_certificates(
    environ: Mapping[str, str] | None = None, *, host_dir: Path | None = None
) -> tuple[str, ...]:
    """The operator's default CAs from :data:`SETTING` (none when unset), in the order given.

    Read at each create, where it applies (a long-running server picks a changed file up).

    Raises:
        InvalidRequest: An entry is not :data:`HOST` or an absolute path, or a file cannot be
            read or holds something other than certificates; the message names it.
    """
    value = (os.environ if environ is None else environ).get(SETTING, "")
    out: list[str] = []
    for entry in value.split(":"):
        if not entry:
            continue
        if entry == HOST:
            out.extend(host_certificates(host_dir, source=f"{SETTING} ({HOST})"))
            continue
        if not entry.startswith("/"):
            msg = (
                f"{SETTING}: {entry!r} is neither {HOST!r} nor an absolute path of a PEM file "
                "(entries are separated by ':')"
            )
            raise InvalidRequest(msg)
        out.extend(_read(Path(entry), SETTING))
    return tuple(out)


def fingerprint(pem: str | bytes) -> str:
    """SHA-256 of a PEM certificate's DER, in hex (of its first certificate)."""
    raw = pem.encode() if isinstance(pem, str) else pem
    match = _PEM_CERT.search(raw)
    body = match.group(1) if match else raw
    try:
        der = base64.b64decode(b"".join(body.split()))
    except (binascii.Error, ValueError):
        der = body
    return hashlib.sha256(der).hexdigest()


def certificates_for(
    spec: SandboxSpec, environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """A sandbox's extra CAs: the operator's and the spec's, each once, in fingerprint order
    (the same set however it was given: layers and templates are keyed by it)."""
    unique = {
        fingerprint(pem): pem for pem in (*operator_certificates(environ), *spec.ca_certificates)
    }
    return tuple(unique[fp] for fp in sorted(unique))


def key(certificates: Iterable[str]) -> str:
    """A short name for a set of certificates (empty for none)."""
    fps = sorted(fingerprint(pem) for pem in certificates)
    if not fps:
        return ""
    return hashlib.sha256("\n".join(fps).encode()).hexdigest()[:16]


def file_name(pem: str) -> str:
    """The name a certificate gets in :data:`DEBIAN_CA_DIR`/``sandlot/``."""
    return f"sandlot-{fingerprint(pem)[:16]}.crt"


def merge_bundle(base: bytes | None, certificates: Iterable[str]) -> bytes:
    """``base`` (a distribution's bundle, or nothing) with the certificates it lacks appended."""
    out = bytearray(base or b"")
    have = {fingerprint(m.group(0)) for m in _PEM_CERT.finditer(out)}
    for pem in certificates:
        fp = fingerprint(pem)
        if fp in have:
            continue
        have.add(fp)
        if out and not out.endswith(b"\n"):
            out += b"\n"
        out += pem.encode()
    return bytes(out)


def bundle_path(debian_layout: bool) -> str:
    """Where a root's bundle with the extra CAs is: Debian's own, or :data:`OWN_BUNDLE`."""
    return DEBIAN_BUNDLE if debian_layout else OWN_BUNDLE


def environment(bundle: str) -> dict[str, str]:
    """The variables that make every usual TLS client of a sandbox trust ``bundle``."""
    return dict.fromkeys(ENV_VARS, bundle)


def doctor_check(environ: Mapping[str, str] | None = None) -> DoctorCheck:
    """What ``sandlot doctor`` says of :data:`SETTING`: the CAs every new sandbox will trust,
    or the error every create would fail with."""
    name = f"extra CAs for every sandbox ({SETTING})"
    try:
        found = operator_certificates(environ)
    except InvalidRequest as e:
        return DoctorCheck(name, False, e.message, f"fix or unset {SETTING}")
    detail = f"{len(found)} certificate(s)" if found else "none (unset)"
    return DoctorCheck(name, True, detail, required=False)
