"""Keys on disk: generated on first use, private to their owner, one active key per store."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
import textwrap

import pytest

from sandlot.errors import InvalidRequest, InvalidState, NotFound
from sandlot.receipts import Ed25519Signer, KeyStore, Signer, TrustedKey
from sandlot.receipts.signer import key_id_for


def test_key_id_is_a_hash_of_the_public_key():
    signer = Ed25519Signer.generate()
    assert signer.key_id == "ed25519:" + hashlib.sha256(signer.public_key).hexdigest()[:32]
    assert key_id_for(signer.public_key) == signer.key_id
    assert isinstance(signer, Signer)


def test_signatures_verify_under_the_public_key():
    signer = Ed25519Signer.generate()
    key = TrustedKey(signer.key_id, signer.public_key)
    assert key.verify(signer.sign(b"message"), b"message")
    assert not key.verify(signer.sign(b"message"), b"other message")


def test_signatures_are_those_of_the_key_file_library():
    # Signing goes through libsodium, keys through cryptography: Ed25519 is deterministic, so
    # both must give the same 64 bytes; a difference would mean two different keys.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    signer = Ed25519Signer.generate()
    key = load_pem_private_key(signer.to_pem(), password=None)
    assert isinstance(key, Ed25519PrivateKey)
    for message in (b"", b"message", bytes(range(256)) * 40):
        assert signer.sign(message) == key.sign(message)


def test_pem_round_trip():
    signer = Ed25519Signer.generate()
    pem = signer.to_pem()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert Ed25519Signer.from_pem(pem).key_id == signer.key_id
    with pytest.raises(InvalidRequest):
        Ed25519Signer.from_pem(b"not a key")


def test_first_use_generates_a_private_key_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDLOT_HOME", str(tmp_path / "home"))
    store = KeyStore.default()
    assert store.directory == tmp_path / "home" / "keys"
    signer = store.active()
    assert store.active().key_id == signer.key_id  # the same key next time
    (pem,) = store.directory.glob("*.pem")
    assert stat.S_IMODE(pem.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert store.key_ids() == [signer.key_id]


def test_rotation_keeps_old_keys_and_switches_the_active_one(tmp_path):
    store = KeyStore(tmp_path)
    old = store.active()
    new = store.generate()
    assert store.active().key_id == old.key_id  # generated, not yet active
    store.activate(new.key_id)
    assert store.active().key_id == new.key_id
    assert store.load(old.key_id).key_id == old.key_id
    with pytest.raises(NotFound):
        store.activate("ed25519:" + "0" * 32)


def test_a_key_readable_by_others_is_refused(tmp_path):
    store = KeyStore(tmp_path)
    signer = store.active()
    path = next(tmp_path.glob("*.pem"))
    path.chmod(0o644)
    with pytest.raises(InvalidState, match="chmod 600"):
        store.load(signer.key_id)


def test_a_key_file_holding_another_key_is_refused(tmp_path):
    store = KeyStore(tmp_path)
    signer = store.active()
    path = next(tmp_path.glob("*.pem"))
    path.write_bytes(Ed25519Signer.generate().to_pem())
    with pytest.raises(InvalidState, match="holds"):
        store.load(signer.key_id)


def test_racing_processes_agree_on_one_first_key(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from sandlot.receipts import KeyStore
        print(KeyStore(sys.argv[1]).active().key_id)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(ids) == 1
    assert KeyStore(tmp_path).key_ids() == sorted(ids)  # the losers' keys were removed


def test_trusted_key_must_match_its_id():
    a, b = Ed25519Signer.generate(), Ed25519Signer.generate()
    with pytest.raises(InvalidRequest):
        TrustedKey(a.key_id, b.public_key)


def test_validity_ranges():
    s = Ed25519Signer.generate()
    key = TrustedKey(s.key_id, s.public_key, valid_from_seq=3, valid_to_seq=9, revoked_at_seq=7)
    assert [key.valid_at(n) for n in (2, 3, 6, 7, 9, 10)] == [
        False,
        True,
        True,
        False,
        False,
        False,
    ]
    assert key.status == "revoked"
