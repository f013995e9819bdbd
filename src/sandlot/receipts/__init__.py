"""Signed, hash-chained receipts: what the policy gate decided and what then ran, provable offline.

The Manager opens a :class:`ReceiptLog` with a :class:`Signer` (usually
``KeyStore.default().active()``), appends a decision receipt before anything executes and an
execution receipt after, and calls :meth:`ReceiptLog.maybe_checkpoint` as it goes and
:meth:`ReceiptLog.checkpoint` at shutdown. :func:`verify_files` checks an exported log offline;
:func:`prove` and :func:`verify_proof` handle single-receipt inclusion proofs. Re-exports only.
"""

from sandlot.receipts.canonical import canonical_json, sha256_ref
from sandlot.receipts.checkpoint import Checkpoint, parse_note
from sandlot.receipts.log import DEFAULT_LOG_ID, ReceiptLog
from sandlot.receipts.proof import PROOF_FORMAT, proof_problem, prove, verify_proof
from sandlot.receipts.receipt import (
    PAYLOAD_TYPE,
    Decision,
    Entry,
    PolicyRef,
    Receipt,
    approval_entry,
    decision_entry,
    execution_entry,
)
from sandlot.receipts.signer import Ed25519Signer, KeyStore, Signer, TrustedKey, TrustRoot
from sandlot.receipts.verify import Check, Failure, VerifyResult, verify_files, verify_log

__all__ = [
    "DEFAULT_LOG_ID",
    "PAYLOAD_TYPE",
    "PROOF_FORMAT",
    "Check",
    "Checkpoint",
    "Decision",
    "Ed25519Signer",
    "Entry",
    "Failure",
    "KeyStore",
    "PolicyRef",
    "Receipt",
    "ReceiptLog",
    "Signer",
    "TrustRoot",
    "TrustedKey",
    "VerifyResult",
    "approval_entry",
    "canonical_json",
    "decision_entry",
    "execution_entry",
    "parse_note",
    "proof_problem",
    "prove",
    "sha256_ref",
    "verify_files",
    "verify_log",
    "verify_proof",
]
