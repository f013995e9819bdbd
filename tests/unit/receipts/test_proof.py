"""Single-receipt inclusion proofs, checked with nothing but the trust root."""

from __future__ import annotations

import json

import pytest

from sandlot.errors import NotFound
from sandlot.receipts import Ed25519Signer, proof_problem, prove, verify_proof


def test_prove_and_verify_every_receipt(log, decision):
    log.append_many([decision(n) for n in range(9)])
    trust = log.export_trust_root()
    for seq in range(1, 10):
        proof = json.loads(json.dumps(prove(log, seq)))  # survives a trip through a file
        assert proof["format"] == "sandlot.receipt-proof/v1"
        assert proof["tree_size"] == 9
        assert verify_proof(proof, trust), proof_problem(proof, trust)


def test_prove_uses_the_smallest_covering_checkpoint(log, decision):
    log.append_many([decision(n) for n in range(3)])
    log.checkpoint()
    log.append_many([decision(n) for n in range(3, 8)])
    assert prove(log, 2)["tree_size"] == 3
    assert prove(log, 5)["tree_size"] == 8  # none covered it: a new checkpoint was signed
    with pytest.raises(NotFound):
        prove(log, 99)


def test_proofs_across_a_key_rotation(log, decision):
    log.append_many([decision(n) for n in range(3)])
    log.rotate(Ed25519Signer.generate())
    log.append_many([decision(n) for n in range(3, 6)])
    trust = log.export_trust_root()
    for seq in (1, 4, 7):
        proof = prove(log, seq)
        assert verify_proof(proof, trust), proof_problem(proof, trust)


def test_tampered_proofs_fail(log, decision):
    log.append_many([decision(n) for n in range(6)])
    trust = log.export_trust_root()
    good = prove(log, 3)
    other = prove(log, 4)
    cases = {
        "another receipt": {**good, "receipt": other["receipt"]},
        "wrong seq": {**good, "seq": 4},
        "path of another leaf": {**good, "inclusion_path": other["inclusion_path"]},
        "short path": {**good, "inclusion_path": good["inclusion_path"][:-1]},
        "another size": {**good, "tree_size": 5},
        "edited checkpoint": {**good, "checkpoint": good["checkpoint"].replace("\n6\n", "\n7\n")},
        "no format": {k: v for k, v in good.items() if k != "format"},
    }
    for name, proof in cases.items():
        assert not verify_proof(proof, trust), name
    stranger = Ed25519Signer.generate()
    untrusted = type(trust)(
        log_id=trust.log_id, keys=(type(trust.keys[0])(stranger.key_id, stranger.public_key),)
    )
    assert not verify_proof(good, untrusted)
    assert "not trusted" in proof_problem(good, untrusted)
