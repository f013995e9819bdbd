"""Inclusion proofs for one receipt: "this receipt is in the log this checkpoint signs".

A proof is a self-contained JSON document anyone can check offline with the trust root::

    {"format": "sandlot.receipt-proof/v1", "log_id": "<origin>", "seq": 42,
     "tree_size": 1000, "receipt": "<the JSONL line>",
     "inclusion_path": ["<base64 hash>", …], "checkpoint": "<signed note>"}

The receipt's leaf index in the tree is ``seq - 1``. This module imports the log only to build
proofs; checking one needs nothing but the trust root.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from sandlot.errors import InvalidRequest, NotFound
from sandlot.receipts import merkle
from sandlot.receipts.canonical import JsonValue, canonical_json
from sandlot.receipts.checkpoint import parse_note, verify_note
from sandlot.receipts.log import ReceiptLog
from sandlot.receipts.receipt import PAYLOAD_TYPE, Receipt
from sandlot.receipts.signer import TrustRoot

__all__ = ["PROOF_FORMAT", "proof_problem", "prove", "verify_proof"]

PROOF_FORMAT = "sandlot.receipt-proof/v1"


def prove(log: ReceiptLog, seq: int) -> dict[str, JsonValue]:
    """An inclusion proof of receipt ``seq`` against the smallest checkpoint covering it.

    Signs a new checkpoint first when none covers ``seq`` yet.

    Raises:
        NotFound: There is no receipt ``seq``.
    """
    receipt = log.get(seq)
    note = log.checkpoint_covering(seq) or log.checkpoint()
    checkpoint = parse_note(note)[0]
    if checkpoint.size < seq:
        msg = f"no checkpoint covers receipt {seq}"
        raise NotFound(msg)
    path = log.inclusion_proof(seq, checkpoint.size)
    return {
        "format": PROOF_FORMAT,
        "log_id": log.log_id,
        "seq": seq,
        "tree_size": checkpoint.size,
        "receipt": receipt.line,
        "inclusion_path": [base64.b64encode(h).decode() for h in path],
        "checkpoint": note,
    }


def verify_proof(proof: Mapping[str, JsonValue], trust_root: TrustRoot) -> bool:
    """Whether ``proof`` shows a validly signed receipt inside a validly signed checkpoint."""
    return proof_problem(proof, trust_root) is None


def proof_problem(proof: Mapping[str, JsonValue], trust_root: TrustRoot) -> str | None:
    """What is wrong with ``proof`` (None when it verifies)."""
    try:
        _check(proof, trust_root)
    except _BadProof as e:
        return str(e)
    return None


class _BadProof(Exception):
    pass


def _check(proof: Mapping[str, JsonValue], trust: TrustRoot) -> None:
    if proof.get("format") != PROOF_FORMAT:
        msg = f"not a {PROOF_FORMAT} document"
        raise _BadProof(msg)
    seq, size, line, note = (proof.get(k) for k in ("seq", "tree_size", "receipt", "checkpoint"))
    if not (isinstance(seq, int) and isinstance(size, int) and isinstance(line, str)):
        msg = "seq, tree_size and receipt are required"
        raise _BadProof(msg)
    if not isinstance(note, str):
        msg = "checkpoint is required"
        raise _BadProof(msg)
    receipt = _signed_receipt(line, trust)
    if receipt.seq != seq:
        msg = f"the receipt is seq {receipt.seq}, not {seq}"
        raise _BadProof(msg)
    root = _signed_root(note, trust, size)
    path = _hashes(proof.get("inclusion_path"))
    if not merkle.verify_inclusion(receipt.leaf_hash, seq - 1, size, path, root):
        msg = f"inclusion path does not lead to the checkpoint root of {size}"
        raise _BadProof(msg)


def _signed_receipt(line: str, trust: TrustRoot) -> Receipt:
    try:
        receipt = Receipt.from_line(line)
        canonical = canonical_json(dict(receipt.body))
    except InvalidRequest as e:
        msg = f"bad receipt: {e}"
        raise _BadProof(msg) from e
    envelope = receipt.envelope
    if envelope.payload_type != PAYLOAD_TYPE or canonical != envelope.payload:
        msg = "receipt is not a canonical sandlot receipt"
        raise _BadProof(msg)
    if receipt.body.get("log_id") != trust.log_id:
        msg = f"receipt is from log {receipt.body.get('log_id')!r}"
        raise _BadProof(msg)
    key = trust.key(receipt.key_id)
    if key is None or not key.valid_at(receipt.seq):
        msg = f"key {receipt.key_id} is not trusted at seq {receipt.seq}"
        raise _BadProof(msg)
    sig = envelope.signatures[0] if envelope.signatures else None
    if sig is None or sig.keyid != key.key_id or not key.verify(sig.sig, envelope.pae()):
        msg = "receipt signature does not verify"
        raise _BadProof(msg)
    return receipt


def _signed_root(note: str, trust: TrustRoot, size: int) -> bytes:
    try:
        checkpoint, signers = verify_note(note, trust.keys)
    except InvalidRequest as e:
        raise _BadProof(str(e)) from e
    if checkpoint.origin != trust.log_id or checkpoint.size != size:
        msg = "checkpoint is for another log or size"
        raise _BadProof(msg)
    valid = [
        k
        for k in signers
        if (key := trust.key(k)) is not None and (key.valid_at(size) or key.valid_at(size + 1))
    ]
    if not valid:
        msg = "checkpoint is not signed by a key trusted at its size"
        raise _BadProof(msg)
    return checkpoint.root


def _hashes(value: JsonValue | None) -> list[bytes]:
    if not isinstance(value, list) or not all(isinstance(h, str) for h in value):
        msg = "inclusion_path must be a list of base64 hashes"
        raise _BadProof(msg)
    try:
        return [base64.b64decode(str(h), validate=True) for h in value]
    except binascii.Error as e:
        msg = f"bad hash in inclusion_path: {e}"
        raise _BadProof(msg) from e
