"""The offline verifier: what it accepts, what it refuses, and how it reports."""

from __future__ import annotations

import json

import pytest

from sandlot.errors import InvalidRequest
from sandlot.receipts import (
    Check,
    Ed25519Signer,
    ReceiptLog,
    TrustedKey,
    TrustRoot,
    verify_files,
    verify_log,
)


def test_a_full_log_with_rotation_and_approval_verifies(exported):
    result = verify_log(exported.lines, exported.trust_root, checkpoint=exported.checkpoint)
    assert result.ok
    assert result.failure is None
    assert result.checkpoint_size == 15
    assert result.summary() == "OK: 15 receipts verified, matches checkpoint of 15"


def test_a_trust_root_from_before_the_rotation_still_verifies(exported):
    # Only the first key is pinned; the rotation receipt, signed by it, vouches for the next.
    first = exported.trust_root.keys[0]
    pinned = TrustRoot(
        log_id=exported.trust_root.log_id, keys=(TrustedKey(first.key_id, first.public_key),)
    )
    assert verify_log(exported.lines, pinned, checkpoint=exported.checkpoint).ok


def test_a_key_used_beyond_its_trusted_range_fails(exported):
    first = exported.trust_root.keys[0]
    narrowed = TrustRoot(
        log_id=exported.trust_root.log_id,
        keys=(TrustedKey(first.key_id, first.public_key, valid_to_seq=5),),
    )
    result = verify_log(exported.lines, narrowed)
    assert (result.failure.check, result.failure.seq) == (Check.KEY, 6)


def test_a_revoked_key_fails_from_its_revocation(exported):
    first = exported.trust_root.keys[0]
    revoked = TrustRoot(
        log_id=exported.trust_root.log_id,
        keys=(TrustedKey(first.key_id, first.public_key, revoked_at_seq=4),),
    )
    result = verify_log(exported.lines, revoked)
    assert (result.failure.check, result.failure.seq) == (Check.KEY, 4)
    assert "revoked" in result.failure.message


def test_a_trust_root_for_another_log_fails(exported):
    other = TrustRoot(log_id="elsewhere.example/log", keys=exported.trust_root.keys)
    result = verify_log(exported.lines, other)
    assert (result.failure.check, result.failure.seq) == (Check.LOG_ID, 1)


def test_a_log_signed_by_an_untrusted_key_fails_at_seq_1(exported):
    stranger = Ed25519Signer.generate()
    trust = TrustRoot(
        log_id=exported.trust_root.log_id,
        keys=(TrustedKey(stranger.key_id, stranger.public_key),),
    )
    result = verify_log(exported.lines, trust)
    assert (result.failure.check, result.failure.seq) == (Check.SIGNATURE, 1)
    assert "unknown key" in result.failure.message


def test_a_checkpoint_by_an_untrusted_key_fails(log, decision):
    log.append_many([decision(n) for n in range(3)])
    trust = log.export_trust_root()
    lines = list(log.lines())
    stranger = ReceiptLog(log._engine, Ed25519Signer.generate(), log_id="other.example/x")
    stranger.append(decision(1))
    forged = stranger.checkpoint().replace("other.example/x", log.log_id)
    result = verify_log(lines, trust, checkpoint=forged)
    assert result.failure.check == Check.CHECKPOINT


def test_a_flipped_byte_in_the_checkpoint_fails(exported):
    note = exported.checkpoint
    for pos in range(0, len(note), 7):
        flipped = note[:pos] + chr(ord(note[pos]) ^ 1) + note[pos + 1 :]
        result = verify_log(exported.lines, exported.trust_root, checkpoint=flipped)
        assert not result.ok, pos
        assert result.failure.check == Check.CHECKPOINT


def test_a_log_longer_than_its_checkpoint_verifies_up_to_it(log, decision):
    log.append_many([decision(n) for n in range(4)])
    note = log.checkpoint()
    log.append_many([decision(n) for n in range(4, 9)])
    result = verify_log(log.lines(), log.export_trust_root(), checkpoint=note)
    assert result.ok
    assert (result.receipts, result.checkpoint_size) == (9, 4)


def test_an_empty_log_against_an_empty_checkpoint(log):
    note = log.checkpoint()
    assert verify_log([], log.export_trust_root(), checkpoint=note).ok


def test_a_blank_line_fails_as_format(exported):
    lines = [*exported.lines[:3], "", *exported.lines[3:]]
    result = verify_log(lines, exported.trust_root)
    assert (result.failure.check, result.failure.seq, result.failure.line) == (Check.FORMAT, 4, 4)


def test_result_as_json(exported):
    lines = exported.lines[:5] + exported.lines[6:]
    data = verify_log(lines, exported.trust_root).to_dict()
    json.dumps(data)
    assert data["ok"] is False
    assert data["failure"] == {
        "check": "seq",
        "seq": 6,
        "line": 6,
        "message": "found seq 7, expected 6",
    }
    assert "signature" in data["checks"]


def test_trust_root_file_round_trip(exported, tmp_path):
    loaded = TrustRoot.load(exported.trust_path)
    assert loaded == exported.trust_root
    data = json.loads(exported.trust_path.read_text())
    assert data["format"] == "sandlot.trust-root/v1"
    assert [k["status"] for k in data["keys"]] == ["retired", "active"]


def test_unreadable_inputs_are_usage_errors_not_failures(exported, tmp_path):
    with pytest.raises(InvalidRequest):
        verify_files(tmp_path / "missing.jsonl", exported.trust_path)
    with pytest.raises(InvalidRequest):
        verify_files(exported.log_path, tmp_path / "missing.json")
    bad_root = tmp_path / "bad.json"
    bad_root.write_text('{"format": "something else"}')
    with pytest.raises(InvalidRequest):
        verify_files(exported.log_path, bad_root)
    with pytest.raises(InvalidRequest):
        verify_files(exported.log_path, exported.trust_path, tmp_path / "missing.txt")
