"""Offline verification of an exported receipt log against a trust root (and a checkpoint).

This module owns what "a valid log" means. For each line, in order, it checks:

1. ``format``: the line is a canonical DSSE envelope of our payload type around a v1 body.
2. ``canonical``: the payload is exactly the RFC 8785 form of the body.
3. ``signature``: the signature verifies under the key the body names, a key the trust root
   lists (or an earlier in-log rotation introduced).
4. ``key``: that key is the log's current key at this seq and the trust root allows it here
   (validity range, revocation).
5. ``log_id``: the receipt belongs to the trust root's log.
6. ``seq``: seqs run 1, 2, 3, … with no gap, repeat or reordering.
7. ``prev_hash``: each receipt names the ``entry_hash`` of the one before.
8. ``lamport``: the Lamport clock strictly increases.
9. ``reference``: every execution follows an earlier ALLOW (a decision, or an approval of a
   HOLD) for the same request, and no ALLOW is executed twice; every approval answers an
   earlier HOLD once.
10. ``rotation``: a key rotation names a well-formed new key, countersigned by that key.

Then ``checkpoint``: the checkpoint's signature is by a key valid at its size, and the Merkle
root of the first ``size`` receipts equals its root (so a truncated or rewritten tail fails).
Verification stops at the first failure and names its seq and check. Needs only the receipts'
own modules (stdlib, ``cryptography``, ``rfc8785``); never the database.
"""

from __future__ import annotations

import base64
import binascii
import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import final

from sandlot.errors import InvalidRequest
from sandlot.receipts import merkle
from sandlot.receipts.canonical import JsonValue, canonical_json
from sandlot.receipts.checkpoint import Checkpoint, parse_note, verify_note
from sandlot.receipts.receipt import (
    APPROVAL,
    DECISION,
    EXECUTION,
    KEY_ROTATION,
    PAYLOAD_TYPE,
    Decision,
    Receipt,
)
from sandlot.receipts.signer import TrustedKey, TrustRoot, key_id_for

__all__ = ["Check", "Failure", "VerifyResult", "verify_files", "verify_log"]


class Check(enum.StrEnum):
    """The name of each verification check (see the module docstring)."""

    FORMAT = "format"
    CANONICAL = "canonical"
    SIGNATURE = "signature"
    KEY = "key"
    LOG_ID = "log_id"
    SEQ = "seq"
    PREV_HASH = "prev_hash"
    LAMPORT = "lamport"
    REFERENCE = "reference"
    ROTATION = "rotation"
    CHECKPOINT = "checkpoint"


@final
@dataclass(frozen=True)
class Failure:
    """The first thing found wrong.

    Attributes:
        check: Which check failed.
        seq: The seq at which it failed (for a line that cannot be read: the seq it should
            have had), or None when the checkpoint itself is bad.
        line: The 1-based line number in the log file, if a line failed.
        message: What exactly is wrong.
    """

    check: Check
    seq: int | None
    line: int | None
    message: str


@final
@dataclass(frozen=True)
class VerifyResult:
    """The outcome of verifying a log.

    Attributes:
        ok: True when every check passed.
        receipts: How many receipts were read and passed before any failure.
        root: The Merkle root of those receipts.
        checkpoint_size: The size of the checkpoint checked against, if one was given.
        failure: The first failure, or None.
        seconds: Wall time spent verifying.
    """

    ok: bool
    receipts: int
    root: bytes
    checkpoint_size: int | None
    failure: Failure | None
    seconds: float

    def to_dict(self) -> dict[str, JsonValue]:
        """The result as JSON-able data (``receipts verify --json``)."""
        failure: JsonValue = None
        if self.failure is not None:
            f = self.failure
            failure = {"check": f.check.value, "seq": f.seq, "line": f.line, "message": f.message}
        return {
            "ok": self.ok,
            "receipts": self.receipts,
            "root": base64.b64encode(self.root).decode(),
            "checkpoint_size": self.checkpoint_size,
            "checks": [c.value for c in Check],
            "failure": failure,
            "seconds": round(self.seconds, 3),
        }

    def summary(self) -> str:
        """One human-readable line."""
        if self.failure is None:
            cp = f", matches checkpoint of {self.checkpoint_size}" if self.checkpoint_size else ""
            return f"OK: {self.receipts} receipts verified{cp}"
        f = self.failure
        where = f"seq {f.seq}" if f.seq is not None else "checkpoint"
        return f"FAILED at {where}: {f.check.value}: {f.message}"


class _Bad(Exception):
    """One check failed (internal: turned into a :class:`Failure`)."""

    def __init__(self, check: Check, message: str) -> None:
        super().__init__(message)
        self.check = check
        self.message = message


@dataclass
class _Authorization:
    seq: int
    type: str
    decision: Decision | None
    request_hash: str | None
    used_at: int | None = None


@dataclass
class _State:
    """What the verifier has learned from the receipts so far."""

    trust: TrustRoot
    keys: dict[str, TrustedKey]
    seq: int = 0
    entry_hash: str = ""
    lamport: int = 0
    current_key: str | None = None
    key_since: list[tuple[int, str]] = field(default_factory=list)  # (first seq, key id)
    authorizations: dict[str, _Authorization] = field(default_factory=dict)
    tree: merkle.CompactRange = field(default_factory=merkle.CompactRange)


def verify_log(
    lines: Iterable[str | bytes], trust_root: TrustRoot, *, checkpoint: str | None = None
) -> VerifyResult:
    """Verify a log given as JSONL lines.

    Args:
        lines: The exported log, one envelope per line, without line ends (text, or bytes
            that must be UTF-8; blank lines are an error).
        trust_root: The keys to trust and the log they sign for.
        checkpoint: A signed checkpoint note to check the log against, if any.

    Returns:
        The result; ``result.failure`` names the first bad seq and the check that failed.
    """
    started = time.perf_counter()
    state = _State(trust=trust_root, keys={k.key_id: k for k in trust_root.keys})
    target: Checkpoint | None = None
    checkpoint_root: bytes | None = None
    failure: Failure | None = None
    try:
        if checkpoint is not None:
            target = parse_note(checkpoint)[0]
            checkpoint_root = merkle.EMPTY_ROOT if target.size == 0 else None
    except InvalidRequest as e:
        failure = Failure(Check.CHECKPOINT, None, None, str(e))
    line_no = 0
    if failure is None:
        for line_no, line in enumerate(lines, start=1):
            try:
                _check_line(state, line)
            except _Bad as e:
                failure = Failure(e.check, state.seq + 1, line_no, e.message)
                break
            if target is not None and state.seq == target.size:
                checkpoint_root = state.tree.root()
    if failure is None and checkpoint is not None and target is not None:
        failure = _check_checkpoint(state, checkpoint, target, checkpoint_root)
    return VerifyResult(
        ok=failure is None,
        receipts=state.seq,
        root=state.tree.root(),
        checkpoint_size=target.size if target is not None else None,
        failure=failure,
        seconds=time.perf_counter() - started,
    )


def verify_files(
    log: str | Path, trust_root: str | Path, checkpoint: str | Path | None = None
) -> VerifyResult:
    """Verify a JSONL log file against a trust-root file and, optionally, a checkpoint file.

    Raises:
        InvalidRequest: A file cannot be read, or the trust root is malformed (a usage error,
            not a verification failure).
    """
    root = TrustRoot.load(trust_root)
    note = None
    if checkpoint is not None:
        try:
            note = Path(checkpoint).read_text()
        except (OSError, UnicodeDecodeError) as e:
            msg = f"cannot read checkpoint {checkpoint}: {e}"
            raise InvalidRequest(msg) from e
    try:
        # Bytes, split on LF only: a corrupted byte must fail a check, not the file decoding.
        with open(log, "rb") as f:
            return verify_log((line.removesuffix(b"\n") for line in f), root, checkpoint=note)
    except OSError as e:
        msg = f"cannot read log {log}: {e}"
        raise InvalidRequest(msg) from e


# -- one line ------------------------------------------------------------------------------


def _check_line(state: _State, line: str | bytes) -> None:
    if isinstance(line, bytes):
        try:
            line = line.decode()
        except UnicodeDecodeError as e:
            raise _Bad(Check.FORMAT, f"not UTF-8: {e}") from e
    receipt = _parse(line)
    _check_canonical(receipt)
    _check_signature(state, receipt)
    _check_chain(state, receipt)
    if receipt.type in (EXECUTION, APPROVAL):
        _check_reference(state, receipt)
    if receipt.type == KEY_ROTATION:
        _rotate(state, receipt)
    if receipt.type in (DECISION, APPROVAL):
        state.authorizations[receipt.entry_hash] = _Authorization(
            seq=receipt.seq,
            type=receipt.type,
            decision=receipt.decision,
            request_hash=receipt.request_hash,
        )
    state.seq, state.entry_hash, state.lamport = receipt.seq, receipt.entry_hash, receipt.lamport
    state.tree.append(receipt.leaf_hash)


_BODY_STRINGS = ("type", "log_id", "ts", "prev_hash", "key_id")
_REQUIRED = {
    DECISION: ("op", "request_hash", "decision", "reason_code"),
    EXECUTION: ("op", "request_hash", "decision_ref"),
    APPROVAL: ("request_hash", "decision", "reason_code", "decision_ref"),
    KEY_ROTATION: ("detail",),
}


def _parse(line: str) -> Receipt:
    try:
        receipt = Receipt.from_line(line)
    except InvalidRequest as e:
        raise _Bad(Check.FORMAT, str(e)) from e
    if receipt.envelope.payload_type != PAYLOAD_TYPE:
        raise _Bad(Check.FORMAT, f"payload type {receipt.envelope.payload_type!r}")
    body = receipt.body
    if body.get("v") != 1:
        raise _Bad(Check.FORMAT, f"unknown body version {body.get('v')!r}")
    missing = [k for k in _BODY_STRINGS if not isinstance(body.get(k), str)]
    missing += [k for k in _REQUIRED.get(receipt.type, ()) if body.get(k) is None]
    if missing:
        raise _Bad(Check.FORMAT, f"{receipt.type or 'receipt'} lacks {', '.join(missing)}")
    if "decision" in body and receipt.decision is None:
        raise _Bad(Check.FORMAT, f"unknown decision {body['decision']!r}")
    return receipt


def _check_canonical(receipt: Receipt) -> None:
    try:
        canonical = canonical_json(dict(receipt.body))
    except InvalidRequest as e:
        raise _Bad(Check.CANONICAL, str(e)) from e
    if canonical != receipt.envelope.payload:
        raise _Bad(Check.CANONICAL, "payload is not in RFC 8785 canonical form")


def _check_signature(state: _State, receipt: Receipt) -> None:
    sigs = receipt.envelope.signatures
    wanted = 2 if receipt.type == KEY_ROTATION else 1
    if len(sigs) != wanted:
        raise _Bad(Check.SIGNATURE, f"{len(sigs)} signatures, expected {wanted}")
    if sigs[0].keyid != receipt.key_id:
        raise _Bad(Check.SIGNATURE, f"signed by {sigs[0].keyid}, body names {receipt.key_id}")
    key = state.keys.get(receipt.key_id)
    if key is None:
        raise _Bad(Check.SIGNATURE, f"signed by unknown key {receipt.key_id}")
    if not key.verify(sigs[0].sig, receipt.envelope.pae()):
        raise _Bad(Check.SIGNATURE, f"signature by {receipt.key_id} does not verify")
    if state.current_key is not None and receipt.key_id != state.current_key:
        raise _Bad(Check.KEY, f"signed by {receipt.key_id}; the log's key is {state.current_key}")
    if not key.valid_at(receipt.seq):
        raise _Bad(Check.KEY, f"key {receipt.key_id} ({key.status}) may not sign seq {receipt.seq}")
    if state.current_key is None:
        state.current_key = receipt.key_id
        state.key_since.append((receipt.seq, receipt.key_id))


def _check_chain(state: _State, receipt: Receipt) -> None:
    if receipt.body.get("log_id") != state.trust.log_id:
        raise _Bad(
            Check.LOG_ID, f"log {receipt.body.get('log_id')!r}, trusted is {state.trust.log_id!r}"
        )
    if receipt.seq != state.seq + 1:
        raise _Bad(Check.SEQ, f"found seq {receipt.seq}, expected {state.seq + 1}")
    if state.seq > 0 and receipt.prev_hash != state.entry_hash:
        raise _Bad(Check.PREV_HASH, f"prev_hash {receipt.prev_hash} is not seq {state.seq}'s hash")
    if state.seq == 0 and receipt.prev_hash != "sha256:" + "0" * 64:
        raise _Bad(Check.PREV_HASH, "the first receipt must have the genesis prev_hash")
    if receipt.lamport <= state.lamport:
        raise _Bad(Check.LAMPORT, f"lamport {receipt.lamport} after {state.lamport}")


def _check_reference(state: _State, receipt: Receipt) -> None:
    ref = receipt.body.get("decision_ref")
    auth = state.authorizations.get(ref) if isinstance(ref, str) else None
    kinds: tuple[str, ...] = (DECISION, APPROVAL) if receipt.type == EXECUTION else (DECISION,)
    wanted = Decision.ALLOW if receipt.type == EXECUTION else Decision.HOLD
    if auth is None:
        raise _Bad(Check.REFERENCE, f"{receipt.type} references no earlier decision ({ref})")
    if auth.type not in kinds or auth.decision is not wanted:
        raise _Bad(
            Check.REFERENCE,
            f"{receipt.type} follows a {auth.type} {auth.decision} at seq {auth.seq}, not {wanted}",
        )
    if auth.request_hash != receipt.request_hash:
        raise _Bad(Check.REFERENCE, f"request_hash differs from the decision at seq {auth.seq}")
    if auth.used_at is not None:
        raise _Bad(
            Check.REFERENCE, f"the decision at seq {auth.seq} was used at seq {auth.used_at}"
        )
    auth.used_at = receipt.seq


def _rotate(state: _State, receipt: Receipt) -> None:
    detail = receipt.body.get("detail")
    new = detail.get("new_key") if isinstance(detail, dict) else None
    if not isinstance(new, dict) or new.get("alg") != "ed25519":
        raise _Bad(Check.ROTATION, "key_rotation lacks an ed25519 new_key")
    try:
        public = base64.b64decode(str(new.get("public_key")), validate=True)
    except binascii.Error as e:
        raise _Bad(Check.ROTATION, f"new key is not base64: {e}") from e
    key_id = new.get("key_id")
    if len(public) != 32 or key_id != key_id_for(public) or key_id == receipt.key_id:
        raise _Bad(Check.ROTATION, f"new key {key_id!r} does not match its public key")
    countersig = receipt.envelope.signatures[1]
    key = state.trust.key(key_id) or TrustedKey(key_id=key_id, public_key=public)
    if key.public_key != public or countersig.keyid != key_id:
        raise _Bad(Check.ROTATION, f"countersignature is not by the new key {key_id}")
    if not key.verify(countersig.sig, receipt.envelope.pae()):
        raise _Bad(Check.ROTATION, f"countersignature by {key_id} does not verify")
    state.keys[key_id] = key
    state.current_key = key_id
    state.key_since.append((receipt.seq + 1, key_id))


# -- the checkpoint --------------------------------------------------------------------------


def _check_checkpoint(
    state: _State, note: str, target: Checkpoint, root: bytes | None
) -> Failure | None:
    def bad(message: str, seq: int | None = None) -> Failure:
        return Failure(Check.CHECKPOINT, seq, None, message)

    if target.origin != state.trust.log_id:
        return bad(f"checkpoint is for log {target.origin!r}")
    try:
        _, signers = verify_note(note, list(state.keys.values()))
    except InvalidRequest as e:
        return bad(str(e))
    size = max(target.size, 1)
    if state.key_since and state.seq >= target.size:
        # The log itself says which key was current at that size.
        allowed = {_key_at(state, size), _key_at(state, size + 1)}
    else:  # the log is empty or too short to say: trust the trust root's ranges
        allowed = {k.key_id for k in state.trust.keys if k.valid_at(size)}
        allowed |= {k.key_id for k in state.trust.keys if k.valid_at(size + 1)}
    good = [
        k
        for k in signers
        if k in allowed and (state.keys[k].valid_at(size) or state.keys[k].valid_at(size + 1))
    ]
    if not good:
        return bad("checkpoint is not signed by a key valid at its size")
    if state.seq < target.size:
        return bad(
            f"log has {state.seq} receipts; the checkpoint covers {target.size}", state.seq + 1
        )
    if root != target.root:
        return bad(f"Merkle root of the first {target.size} receipts differs from the checkpoint")
    return None


def _key_at(state: _State, seq: int) -> str | None:
    current = None
    for first, key_id in state.key_since:
        if first <= seq:
            current = key_id
    return current
