"""DSSE envelopes: how a receipt payload and its signatures travel together.

An envelope is ``{"payload": b64, "payloadType": str, "signatures": [{"keyid", "sig"}]}``; each
signature covers ``PAE(payloadType, payload)`` so the type is signed along with the payload
(checking the type beside the signature instead was CVE-2022-35929 in cosign). This module
owns the envelope's one byte form (RFC 8785 of the envelope, standard padded base64) and refuses
every other spelling of it. It imports nothing from sandlot but :mod:`sandlot.errors` and the
receipts' own ``canonical`` and ``signer`` modules.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from sandlot.errors import InvalidRequest
from sandlot.receipts.signer import Signer

__all__ = ["Envelope", "Signature", "pae", "sign_envelope"]


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding: ``DSSEv1 SP len(type) SP type SP len(body) SP body``.

    Lengths are ASCII decimal byte counts.
    """
    t = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(t), t, len(payload), payload)


@final
@dataclass(frozen=True)
class Signature:
    """One DSSE signature: the signing key's id and the raw signature bytes."""

    keyid: str
    sig: bytes


@final
@dataclass(frozen=True)
class Envelope:
    """A DSSE envelope: a typed payload and one or more signatures over its PAE."""

    payload_type: str
    payload: bytes
    signatures: tuple[Signature, ...]

    def pae(self) -> bytes:
        """The bytes every signature in this envelope signs."""
        return pae(self.payload_type, self.payload)

    def to_json(self) -> str:
        """The envelope as one line of RFC 8785 canonical JSON (a JSONL record).

        Written by hand because it runs on every append: the keys are in canonical order and
        ``json.dumps`` escapes strings exactly as RFC 8785 does (a test pins this).
        """
        sigs = ",".join(
            [f'{{"keyid":{_string(s.keyid)},"sig":"{_b64encode(s.sig)}"}}' for s in self.signatures]
        )
        return (
            f'{{"payload":"{_b64encode(self.payload)}",'
            f'"payloadType":{_string(self.payload_type)},"signatures":[{sigs}]}}'
        )

    @classmethod
    def from_json(cls, line: str) -> Envelope:
        """Parse one envelope, accepting only its canonical spelling.

        Any other spelling of the same content (whitespace, key order, escapes, base64 with
        stray bits) is refused, so that a flipped byte can never leave an envelope that still
        parses to the same signed content.

        Raises:
            InvalidRequest: ``line`` is not exactly a canonical envelope.
        """
        try:
            data = json.loads(line)
            envelope = cls(
                payload_type=_field(data, "payloadType"),
                payload=_b64(_field(data, "payload")),
                signatures=tuple(_signature(s) for s in _list(data, "signatures")),
            )
        except (ValueError, TypeError) as e:
            msg = f"not a DSSE envelope: {e}"
            raise InvalidRequest(msg) from e
        if set(data) != {"payload", "payloadType", "signatures"}:
            msg = f"unexpected envelope fields: {sorted(data)}"
            raise InvalidRequest(msg)
        if envelope.to_json() != line.removesuffix("\n"):
            msg = "envelope is not in canonical form"
            raise InvalidRequest(msg)
        return envelope


def sign_envelope(payload_type: str, payload: bytes, signers: Sequence[Signer]) -> Envelope:
    """Sign ``payload`` with every signer, in order."""
    message = pae(payload_type, payload)
    sigs = tuple([Signature(s.key_id, s.sign(message)) for s in signers])
    return Envelope(payload_type=payload_type, payload=payload, signatures=sigs)


def _field(data: object, name: str) -> str:
    if not isinstance(data, dict) or not isinstance(data.get(name), str):
        msg = f"missing string field {name!r}"
        raise ValueError(msg)
    value: str = data[name]
    return value


def _list(data: object, name: str) -> list[object]:
    if not isinstance(data, dict) or not isinstance(data.get(name), list):
        msg = f"missing list field {name!r}"
        raise ValueError(msg)
    value: list[object] = data[name]
    return value


def _signature(data: object) -> Signature:
    if not isinstance(data, dict) or set(data) != {"keyid", "sig"}:
        msg = "a signature must have exactly 'keyid' and 'sig'"
        raise ValueError(msg)
    return Signature(keyid=_field(data, "keyid"), sig=_b64(_field(data, "sig")))


@functools.lru_cache(maxsize=64)
def _string(text: str) -> str:
    # Cached: the payload type and a handful of key ids are all it ever sees on the hot path.
    return json.dumps(text, ensure_ascii=False)


def _b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        msg = f"bad base64: {e}"
        raise ValueError(msg) from e
