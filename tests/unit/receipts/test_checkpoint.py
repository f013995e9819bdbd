"""Checkpoints in the C2SP signed-note / tlog-checkpoint format."""

from __future__ import annotations

import base64
import hashlib

import pytest

from sandlot.errors import InvalidRequest
from sandlot.receipts import Checkpoint, Ed25519Signer, TrustedKey
from sandlot.receipts.checkpoint import (
    note_key_hash,
    note_verifier_key,
    parse_note,
    sign_checkpoint,
    verify_note,
)

ORIGIN = "example.com/log"


def _signed(size=5, root=b"\x11" * 32):
    signer = Ed25519Signer.generate()
    note = sign_checkpoint(Checkpoint(ORIGIN, size, root), signer)
    return signer, note


def test_note_layout_follows_c2sp():
    signer, note = _signed()
    lines = note.split("\n")
    root_b64 = base64.b64encode(b"\x11" * 32).decode()
    text, blank, sig_line, end = lines[:3], lines[3], lines[4], lines[5]
    assert text == [ORIGIN, "5", root_b64]
    assert blank == ""
    assert end == ""
    dash, name, blob = sig_line.split(" ")
    assert (dash, name) == ("\u2014", ORIGIN)
    raw = base64.b64decode(blob)
    expected_hash = hashlib.sha256(ORIGIN.encode() + b"\n\x01" + signer.public_key).digest()[:4]
    assert raw[:4] == expected_hash == note_key_hash(ORIGIN, signer.public_key)
    signed_text = f"{ORIGIN}\n5\n{root_b64}\n".encode()
    assert TrustedKey(signer.key_id, signer.public_key).verify(raw[4:], signed_text)


def test_verifier_key_string():
    signer = Ed25519Signer.generate()
    name, key_hash, key = note_verifier_key(ORIGIN, signer.public_key).split("+", 2)
    assert name == ORIGIN
    assert bytes.fromhex(key_hash) == note_key_hash(ORIGIN, signer.public_key)
    assert base64.b64decode(key) == b"\x01" + signer.public_key


def test_verify_note_with_known_and_unknown_keys():
    signer, note = _signed()
    known = TrustedKey(signer.key_id, signer.public_key)
    stranger = Ed25519Signer.generate()
    checkpoint, verified = verify_note(note, [known])
    assert (checkpoint.size, verified) == (5, [signer.key_id])
    _, verified = verify_note(note, [TrustedKey(stranger.key_id, stranger.public_key)])
    assert verified == []  # unknown signers are ignored, not errors


def test_a_bad_signature_from_a_known_key_is_an_error():
    signer, note = _signed()
    forged = note.replace("\n5\n", "\n6\n")
    with pytest.raises(InvalidRequest, match="does not verify"):
        verify_note(forged, [TrustedKey(signer.key_id, signer.public_key)])


@pytest.mark.parametrize(
    "note",
    [
        "example.com/log\n5\n",
        "example.com/log\n05\nAAAA\n\n\u2014 x AAAAAAAA\n",
        "example.com/log\nfive\n"
        + base64.b64encode(b"\0" * 32).decode()
        + "\n\n\u2014 x AAAAAAAA\n",
        "example.com/log\n5\nAAAA\n\n\u2014 x AAAAAAAA\n",  # root not 32 bytes
        "example.com/log\n5\n" + base64.b64encode(b"\0" * 32).decode() + "\n\n- x AAAAAAAA\n",
        "bad origin\n5\n" + base64.b64encode(b"\0" * 32).decode() + "\n\n\u2014 x AAAAAAAA\n",
        "example.com/log\n5\n" + base64.b64encode(b"\0" * 32).decode() + "\n\n\u2014 x AAAAAAAA",
    ],
)
def test_malformed_notes_are_refused(note):
    with pytest.raises(InvalidRequest):
        parse_note(note)
