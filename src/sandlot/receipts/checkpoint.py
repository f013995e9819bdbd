"""Signed checkpoints: a log's size and Merkle root, in the C2SP tlog-checkpoint format.

A checkpoint is a C2SP signed note (c2sp.org/signed-note) whose text is
``<origin>\\n<tree size>\\n<base64 root hash>\\n`` (c2sp.org/tlog-checkpoint), followed by a
blank line and one line per signature: ``— <key name> <base64(key hash || signature)>``. The key
name is the log's origin and the 4-byte key hash is ``SHA-256(name || 0x0A || 0x01 ||
public key)[:4]``, so existing witness and verifier tooling can read our checkpoints. This
module imports nothing from sandlot but :mod:`sandlot.errors` and the receipts' ``signer``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, final

from sandlot.errors import InvalidRequest
from sandlot.receipts.signer import Signer, TrustedKey

__all__ = [
    "Checkpoint",
    "NoteSignature",
    "check_origin",
    "note_key_hash",
    "note_verifier_key",
    "parse_note",
    "sign_checkpoint",
    "verify_note",
]

_DASH = "\u2014"
_ED25519 = b"\x01"  # the signed-note signature type byte for Ed25519


@final
@dataclass(frozen=True)
class Checkpoint:
    """A log's state: its origin, its size and the Merkle root of its first ``size`` receipts."""

    origin: str
    size: int
    root: bytes

    def text(self) -> str:
        """The note text that gets signed."""
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


@final
@dataclass(frozen=True)
class NoteSignature:
    """One signature line of a signed note."""

    name: str
    key_hash: bytes
    signature: bytes


def check_origin(origin: str) -> str:
    """Return ``origin`` if it can name a log and its key in a note.

    Raises:
        InvalidRequest: It is empty or holds a space, a ``+`` or a control character.
    """
    if not origin or any(c.isspace() or c == "+" or ord(c) < 0x20 for c in origin):
        msg = f"a log origin must be non-empty, without spaces or '+': {origin!r}"
        raise InvalidRequest(msg)
    return origin


def note_key_hash(name: str, public_key: bytes) -> bytes:
    """The 4-byte signed-note key hash of an Ed25519 key under ``name``."""
    return hashlib.sha256(name.encode() + b"\n" + _ED25519 + public_key).digest()[:4]


def note_verifier_key(name: str, public_key: bytes) -> str:
    """The key in signed-note verifier-key form: ``<name>+<hex key hash>+<base64(0x01||key)>``."""
    encoded = base64.b64encode(_ED25519 + public_key).decode()
    return f"{name}+{note_key_hash(name, public_key).hex()}+{encoded}"


def sign_checkpoint(checkpoint: Checkpoint, signer: Signer) -> str:
    """The checkpoint as a signed note, signed by ``signer`` under the origin as key name."""
    text = checkpoint.text()
    sig = note_key_hash(checkpoint.origin, signer.public_key) + signer.sign(text.encode())
    return f"{text}\n{_DASH} {checkpoint.origin} {base64.b64encode(sig).decode()}\n"


def parse_note(note: str) -> tuple[Checkpoint, list[NoteSignature]]:
    """Split a signed checkpoint note into its checkpoint and its signature lines.

    Raises:
        InvalidRequest: The note is malformed.
    """
    if any(ord(c) < 0x20 and c != "\n" for c in note):
        _bad("control characters in the note")
    cut = note.rfind("\n\n")
    if cut < 0 or not note.endswith("\n"):
        _bad("no blank line before the signatures")
    text, sig_block = note[: cut + 1], note[cut + 2 :]
    sigs = [_signature_line(line) for line in sig_block[:-1].split("\n")]
    return _checkpoint(text), sigs


def verify_note(note: str, keys: Sequence[TrustedKey]) -> tuple[Checkpoint, list[str]]:
    """Parse a checkpoint note and check its signatures against ``keys``.

    Signatures from unknown keys are ignored, as the signed-note spec requires.

    Returns:
        The checkpoint and the ids of the keys whose signatures verified (possibly none).

    Raises:
        InvalidRequest: The note is malformed, or a signature from a known key is bad.
    """
    checkpoint, sigs = parse_note(note)
    signed = note[: note.rfind("\n\n") + 1].encode()
    verified: list[str] = []
    for sig in sigs:
        for key in keys:
            if sig.name != checkpoint.origin or sig.key_hash != note_key_hash(
                sig.name, key.public_key
            ):
                continue
            if not key.verify(sig.signature, signed):
                msg = f"checkpoint signature by {key.key_id} does not verify"
                raise InvalidRequest(msg)
            verified.append(key.key_id)
    return checkpoint, verified


def _checkpoint(text: str) -> Checkpoint:
    lines = text[:-1].split("\n")
    if len(lines) < 3 or any(not line for line in lines):
        _bad("a checkpoint needs an origin, a size and a root hash")
    origin, size_text, root_text = lines[0], lines[1], lines[2]
    if not size_text.isdigit() or (size_text != "0" and size_text.startswith("0")):
        _bad(f"bad tree size {size_text!r}")
    root = _b64(root_text)
    if len(root) != 32:
        _bad("the root hash is not 32 bytes")
    return Checkpoint(origin=check_origin(origin), size=int(size_text), root=root)


def _signature_line(line: str) -> NoteSignature:
    parts = line.split(" ")
    if len(parts) != 3 or parts[0] != _DASH:
        _bad(f"bad signature line {line!r}")
    raw = _b64(parts[2])
    if len(raw) < 5:
        _bad("signature too short")
    return NoteSignature(name=parts[1], key_hash=raw[:4], signature=raw[4:])


def _b64(text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        _bad(f"bad base64 {text!r}")
    if base64.b64encode(raw).decode() != text:
        _bad(f"non-canonical base64 {text!r}")
    return raw


def _bad(message: str) -> NoReturn:
    msg = f"malformed checkpoint: {message}"
    raise InvalidRequest(msg)
