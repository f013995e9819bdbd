"""Each way of tampering with an exported log is detected, and named by seq and check."""

from __future__ import annotations

import json
from base64 import b64decode

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandlot.receipts import Check, Ed25519Signer, Receipt, verify_files, verify_log
from sandlot.receipts.canonical import sha256_ref


def _verify(ex, lines):
    return verify_log(lines, ex.trust_root, checkpoint=ex.checkpoint)


def _body(line: str) -> dict:
    return json.loads(b64decode(json.loads(line)["payload"]))


def test_the_untouched_log_verifies(exported):
    result = verify_files(exported.log_path, exported.trust_path, exported.checkpoint_path)
    assert result.ok, result.failure
    assert result.receipts == len(exported.lines) == 15


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_flipping_any_byte_anywhere_is_detected(exported, data):
    index = data.draw(st.integers(0, len(exported.lines) - 1), label="line")
    raw = bytearray(exported.lines[index].encode())
    pos = data.draw(st.integers(0, len(raw) - 1), label="byte")
    raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
    lines = [ln.encode() for ln in exported.lines]
    lines[index] = bytes(raw)
    result = verify_files(exported.write(lines), exported.trust_path, exported.checkpoint_path)
    assert not result.ok
    assert result.failure.seq == index + 1


def test_dropping_a_line_is_detected(exported):
    for dropped in (0, 4, 9):
        lines = exported.lines[:dropped] + exported.lines[dropped + 1 :]
        result = _verify(exported, lines)
        assert not result.ok
        assert (result.failure.check, result.failure.seq) == (Check.SEQ, dropped + 1)


def test_reordering_two_lines_is_detected(exported):
    lines = list(exported.lines)
    lines[2], lines[6] = lines[6], lines[2]
    result = _verify(exported, lines)
    assert (result.failure.check, result.failure.seq) == (Check.SEQ, 3)


def test_resigning_with_an_unknown_key_is_detected(exported, forge_line):
    attacker = Ed25519Signer.generate()
    body = _body(exported.lines[2])
    body["reason_code"] = "OK"
    for key_id in (attacker.key_id, body["key_id"]):  # the attacker's id, or the real one
        body["key_id"] = key_id
        lines = list(exported.lines)
        lines[2] = forge_line(body, attacker)
        result = _verify(exported, lines)
        assert (result.failure.check, result.failure.seq) == (Check.SIGNATURE, 3)


def test_turning_a_deny_into_an_allow_is_detected(exported, forge_line):
    deny = 2
    assert _body(exported.lines[deny])["decision"] == "DENY"
    envelope = json.loads(exported.lines[deny])
    body = _body(exported.lines[deny])
    body["decision"] = "ALLOW"
    edited = Receipt.from_line(forge_line(body, Ed25519Signer.generate())).envelope
    envelope["payload"] = json.loads(edited.to_json())["payload"]  # keep the real signature
    lines = list(exported.lines)
    lines[deny] = json.dumps(envelope, separators=(",", ":"), sort_keys=True)
    result = _verify(exported, lines)
    assert (result.failure.check, result.failure.seq) == (Check.SIGNATURE, deny + 1)


def test_executing_a_deny_is_detected_even_with_the_real_key(exported, forge_line):
    deny = Receipt.from_line(exported.lines[-1])
    assert deny.decision.value == "DENY"
    last = Receipt.from_line(exported.lines[-1])
    body = _execution_after(last, deny.entry_hash, deny.request_hash)
    result = _verify(exported, [*exported.lines, forge_line(body, exported.signer)])
    assert (result.failure.check, result.failure.seq) == (Check.REFERENCE, last.seq + 1)
    assert "DENY" in result.failure.message


def test_an_execution_without_a_decision_is_detected(exported, forge_line):
    last = Receipt.from_line(exported.lines[-1])
    body = _execution_after(last, sha256_ref(b"no such decision"), sha256_ref(b"request"))
    result = _verify(exported, [*exported.lines, forge_line(body, exported.signer)])
    assert (result.failure.check, result.failure.seq) == (Check.REFERENCE, last.seq + 1)


def test_executing_an_allow_twice_is_detected(exported, forge_line):
    allow = Receipt.from_line(exported.lines[-3])
    assert allow.decision.value == "ALLOW"
    last = Receipt.from_line(exported.lines[-1])
    body = _execution_after(last, allow.entry_hash, allow.request_hash)
    result = _verify(exported, [*exported.lines, forge_line(body, exported.signer)])
    assert result.failure.check == Check.REFERENCE
    assert "was used at seq" in result.failure.message


def test_truncating_the_tail_after_a_checkpoint_is_detected(exported):
    for keep in (len(exported.lines) - 1, 3, 0):
        result = _verify(exported, exported.lines[:keep])
        assert not result.ok
        assert (result.failure.check, result.failure.seq) == (Check.CHECKPOINT, keep + 1)


def test_rewriting_the_tail_with_the_real_key_is_caught_by_the_checkpoint(exported, forge_line):
    # Whoever holds the key can re-sign a different tail; the published checkpoint still
    # pins the original one.
    lines = exported.lines[:-1]
    last = Receipt.from_line(lines[-1])
    body = _body(exported.lines[-1])
    body["reason_code"] = "REWRITTEN"
    body["prev_hash"] = last.entry_hash
    lines.append(forge_line(body, exported.signer))
    assert verify_log(lines, exported.trust_root).ok  # the chain alone cannot tell
    result = _verify(exported, lines)
    assert result.failure.check == Check.CHECKPOINT
    assert "Merkle root" in result.failure.message


def _execution_after(last: Receipt, decision_ref: str, request_hash: str) -> dict:
    return {
        "v": 1,
        "type": "execution",
        "log_id": last.body["log_id"],
        "seq": last.seq + 1,
        "lamport": last.lamport + 1,
        "ts": "2026-01-01T00:00:00.000000Z",
        "op": "exec",
        "request_hash": request_hash,
        "decision_ref": decision_ref,
        "exit_code": 0,
        "prev_hash": last.entry_hash,
        "key_id": last.body["key_id"],
    }
