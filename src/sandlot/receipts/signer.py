"""Receipt-signing keys: the ``Signer`` seam, Ed25519 keys on disk, and the trust root.

This module owns how a key signs, where keys live (``$SANDLOT_HOME/keys/``, PKCS#8 PEM, mode
0600) and the trust-root file a verifier pins. It imports nothing from sandlot but
:mod:`sandlot.errors` and :mod:`sandlot.config`; it must not import the log or the database.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, final, runtime_checkable

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from nacl.bindings import crypto_sign, crypto_sign_BYTES, crypto_sign_seed_keypair

from sandlot import config
from sandlot.errors import InvalidRequest, InvalidState, NotFound

__all__ = [
    "TRUST_ROOT_FORMAT",
    "Ed25519Signer",
    "KeyStore",
    "Signer",
    "TrustRoot",
    "TrustedKey",
    "key_id_for",
]

TRUST_ROOT_FORMAT = "sandlot.trust-root/v1"
_ALG = "ed25519"
_ACTIVE = "active"


def key_id_for(public_key: bytes) -> str:
    """The stable id of an Ed25519 public key: ``"ed25519:"`` + 32 hex digits of its SHA-256.

    An id is a label, not a credential: verifiers look the public key up by id and then check
    the signature with that key, so a colliding id only ever yields a failed signature.
    """
    return f"{_ALG}:{hashlib.sha256(public_key).hexdigest()[:32]}"


@runtime_checkable
class Signer(Protocol):
    """Something that signs receipts with one Ed25519 key (a file, a KMS, an HSM)."""

    @property
    def key_id(self) -> str:
        """The key's id, ``key_id_for(public_key)``."""
        ...

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        ...

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        ...


@final
class Ed25519Signer:
    """An Ed25519 private key held in this process.

    ``cryptography`` reads and writes the key file; libsodium (PyNaCl) makes the signatures,
    because signing sits on every receipt append and libsodium signs faster (measured 26 µs
    against 40 µs here). Ed25519 signatures are deterministic (RFC 8032), so both libraries
    give the same bytes for the same key and message; a test pins that.
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        """Wrap a ``cryptography`` private key."""
        self._key = private_key
        seed = private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        # libsodium's 64-byte secret key (seed + public key), for its functional API: the
        # SigningKey wrapper adds a few µs a signature (checks, encoders, a SignedMessage).
        self._secret = crypto_sign_seed_keypair(seed)[1]
        self._public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._key_id = key_id_for(self._public)

    @classmethod
    def generate(cls) -> Ed25519Signer:
        """A fresh random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes) -> Ed25519Signer:
        """Load an unencrypted PKCS#8 PEM Ed25519 key.

        Raises:
            InvalidRequest: ``data`` is not an unencrypted Ed25519 PKCS#8 key.
        """
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            msg = f"not an unencrypted PKCS#8 PEM key: {e}"
            raise InvalidRequest(msg) from e
        if not isinstance(key, Ed25519PrivateKey):
            msg = f"not an Ed25519 key: {type(key).__name__}"
            raise InvalidRequest(msg)
        return cls(key)

    def to_pem(self) -> bytes:
        """The key as unencrypted PKCS#8 PEM (protect it with file permissions)."""
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @property
    def key_id(self) -> str:
        """The key's id, ``key_id_for(public_key)``."""
        return self._key_id

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key."""
        return self._public

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return crypto_sign(data, self._secret)[:crypto_sign_BYTES]

    def __repr__(self) -> str:
        return f"Ed25519Signer({self._key_id!r})"


@final
class KeyStore:
    """Ed25519 keys as PKCS#8 PEM files (mode 0600) in one directory, one of them active.

    The active key is named by the file ``active``. It is generated on first use; when two
    processes race to create it, exactly one key wins (a hard link cannot replace a file) and
    both use it. Retired keys stay on disk so that a log rotated by another process can still
    be reopened with the key it now expects (:meth:`load`).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        """Use ``directory`` (created with mode 0700 if missing)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    @classmethod
    def default(cls, home_dir: str | os.PathLike[str] | None = None) -> KeyStore:
        """The store under ``<home>/keys`` (see :func:`sandlot.config.home`)."""
        return cls(config.home(home_dir) / "keys")

    def active(self) -> Ed25519Signer:
        """The active key, generated and activated if there is none yet."""
        pointer = self.directory / _ACTIVE
        if not pointer.exists():
            signer = self.generate()
            self._link_active(signer.key_id)
        return self.load(pointer.read_text().strip())

    def generate(self) -> Ed25519Signer:
        """Create a new key on disk without making it active (see :meth:`activate`)."""
        signer = Ed25519Signer.generate()
        path = self._path(signer.key_id)
        # O_EXCL with mode 0600 from the start: the key is never readable by others, not even
        # for the moment between creating and chmod-ing the file.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(signer.to_pem())
            f.flush()
            os.fsync(f.fileno())
        return signer

    def activate(self, key_id: str) -> None:
        """Make ``key_id`` the active key (atomically replaces the pointer).

        Raises:
            NotFound: No such key in this store.
        """
        self.load(key_id)
        tmp = self.directory / f".{_ACTIVE}.{os.getpid()}"
        tmp.write_text(key_id + "\n")
        tmp.replace(self.directory / _ACTIVE)

    def load(self, key_id: str) -> Ed25519Signer:
        """Load one key by id.

        Raises:
            NotFound: No such key in this store.
            InvalidState: The file is readable by group or others, or is not the key its name
                says.
        """
        path = self._path(key_id)
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except FileNotFoundError as e:
            msg = f"no signing key {key_id} in {self.directory}"
            raise NotFound(msg) from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            msg = f"signing key {path} is accessible by other users (mode {mode & 0o777:o}); chmod 600 it"
            raise InvalidState(msg)
        try:
            signer = Ed25519Signer.from_pem(data)
        except InvalidRequest as e:
            msg = f"signing key {path} is unreadable: {e}"
            raise InvalidState(msg) from e
        if signer.key_id != key_id:
            msg = f"signing key {path} holds {signer.key_id}, not {key_id}"
            raise InvalidState(msg)
        return signer

    def key_ids(self) -> list[str]:
        """Every key id in the store, sorted."""
        return sorted(p.stem.replace("-", ":", 1) for p in self.directory.glob(f"{_ALG}-*.pem"))

    def _path(self, key_id: str) -> Path:
        prefix = f"{_ALG}:"
        name = key_id.removeprefix(prefix)
        if not key_id.startswith(prefix) or not name.isalnum():
            msg = f"not a sandlot key id: {key_id!r}"
            raise InvalidRequest(msg)
        return self.directory / f"{_ALG}-{name}.pem"

    def _link_active(self, key_id: str) -> None:
        tmp = self.directory / f".{_ACTIVE}.{os.getpid()}.{key_id[-8:]}"
        tmp.write_text(key_id + "\n")
        try:
            os.link(tmp, self.directory / _ACTIVE)
        except FileExistsError:
            # Another process activated its key first; ours was never used, so drop it.
            self._path(key_id).unlink()
        finally:
            tmp.unlink()


@final
@dataclass(frozen=True)
class TrustedKey:
    """One key a verifier trusts, and the receipt seqs it may sign.

    Attributes:
        key_id: ``key_id_for(public_key)``.
        public_key: The raw 32-byte Ed25519 public key.
        valid_from_seq: The first seq this key may sign.
        valid_to_seq: The last seq it may sign (set once it was rotated out), or None.
        revoked_at_seq: From this seq on, nothing it signed is accepted, or None.
    """

    key_id: str
    public_key: bytes
    valid_from_seq: int = 1
    valid_to_seq: int | None = None
    revoked_at_seq: int | None = None
    _verifier: Ed25519PublicKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if key_id_for(self.public_key) != self.key_id:
            msg = f"trusted key {self.key_id} does not match its public key"
            raise InvalidRequest(msg)
        object.__setattr__(self, "_verifier", Ed25519PublicKey.from_public_bytes(self.public_key))

    @property
    def status(self) -> str:
        """``revoked``, ``retired`` (rotated out) or ``active``."""
        if self.revoked_at_seq is not None:
            return "revoked"
        return "retired" if self.valid_to_seq is not None else "active"

    def valid_at(self, seq: int) -> bool:
        """Whether this key may sign the receipt at ``seq``."""
        if seq < self.valid_from_seq:
            return False
        if self.valid_to_seq is not None and seq > self.valid_to_seq:
            return False
        return self.revoked_at_seq is None or seq < self.revoked_at_seq

    def verify(self, signature: bytes, data: bytes) -> bool:
        """Whether ``signature`` is this key's Ed25519 signature of ``data``."""
        try:
            self._verifier.verify(signature, data)
        except InvalidSignature:
            return False
        return True

    def to_dict(self) -> dict[str, str | int | None]:
        """The key as one entry of the trust-root file."""
        return {
            "key_id": self.key_id,
            "alg": _ALG,
            "public_key": base64.b64encode(self.public_key).decode(),
            "status": self.status,
            "valid_from_seq": self.valid_from_seq,
            "valid_to_seq": self.valid_to_seq,
            "revoked_at_seq": self.revoked_at_seq,
        }


@final
@dataclass(frozen=True)
class TrustRoot:
    """The keys a verifier trusts for one log, as kept in a trust-root JSON file.

    The file::

        {"format": "sandlot.trust-root/v1", "log_id": "<origin>",
         "keys": [{"key_id": "ed25519:…", "alg": "ed25519", "public_key": "<base64>",
                   "status": "active|retired|revoked", "valid_from_seq": 1,
                   "valid_to_seq": null, "revoked_at_seq": null}]}

    Attributes:
        log_id: The log (checkpoint origin) these keys sign for.
        keys: The trusted keys.
    """

    log_id: str
    keys: tuple[TrustedKey, ...]

    def key(self, key_id: str) -> TrustedKey | None:
        """The trusted key with this id, or None."""
        for k in self.keys:
            if k.key_id == key_id:
                return k
        return None

    def dumps(self) -> str:
        """The trust root as indented JSON text."""
        data = {
            "format": TRUST_ROOT_FORMAT,
            "log_id": self.log_id,
            "keys": [k.to_dict() for k in self.keys],
        }
        return json.dumps(data, indent=2) + "\n"

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`dumps` to ``path``."""
        Path(path).write_text(self.dumps())

    @classmethod
    def loads(cls, text: str) -> TrustRoot:
        """Parse a trust-root file's text.

        Raises:
            InvalidRequest: The text is not a valid trust root.
        """
        try:
            data = json.loads(text)
            if data.get("format") != TRUST_ROOT_FORMAT:
                msg = f"not a {TRUST_ROOT_FORMAT} file"
                raise InvalidRequest(msg)
            keys = tuple(_trusted_key(k) for k in data["keys"])
            return cls(log_id=str(data["log_id"]), keys=keys)
        except InvalidRequest:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as e:
            msg = f"malformed trust root: {e!r}"
            raise InvalidRequest(msg) from e

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TrustRoot:
        """Read a trust-root file.

        Raises:
            InvalidRequest: The file cannot be read or is not a valid trust root.
        """
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            msg = f"cannot read trust root {path}: {e}"
            raise InvalidRequest(msg) from e
        return cls.loads(text)


def _trusted_key(data: dict[str, object]) -> TrustedKey:
    if data.get("alg") != _ALG:
        msg = f"unsupported key algorithm {data.get('alg')!r}"
        raise InvalidRequest(msg)
    public = base64.b64decode(str(data["public_key"]), validate=True)
    valid_from = _optional_int(data.get("valid_from_seq")) or 1
    revoked = _optional_int(data.get("revoked_at_seq"))
    if data.get("status") == "revoked" and revoked is None:
        revoked = valid_from  # revoked with no seq given: trust nothing it signed
    if len(public) != 32:
        msg = f"trusted key {data.get('key_id')} is not a 32-byte Ed25519 key"
        raise InvalidRequest(msg)
    return TrustedKey(
        key_id=str(data["key_id"]),
        public_key=public,
        valid_from_seq=valid_from,
        valid_to_seq=_optional_int(data.get("valid_to_seq")),
        revoked_at_seq=revoked,
    )


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"expected an integer seq, got {value!r}"
        raise InvalidRequest(msg)
    return value
