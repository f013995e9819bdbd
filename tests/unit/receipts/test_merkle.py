"""RFC 9162 Merkle tree: published vectors, and properties over every size and index."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from sandlot.receipts import merkle

# The RFC 6962 reference test data (certificate-transparency / Trillian test vectors).
DATA = [
    b"",
    b"\x00",
    b"\x10",
    b"\x20\x21",
    b"\x30\x31",
    b"\x40\x41\x42\x43",
    b"\x50\x51\x52\x53\x54\x55\x56\x57",
    bytes(range(0x60, 0x70)),
]
ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
LEAVES = [merkle.leaf_hash(d) for d in DATA]


def _h(*hexes):
    return [bytes.fromhex(h) for h in hexes]


def test_hashes_are_domain_separated():
    assert merkle.leaf_hash(b"x") == hashlib.sha256(b"\x00x").digest()
    assert merkle.node_hash(b"l", b"r") == hashlib.sha256(b"\x01lr").digest()
    assert merkle.root([]) == hashlib.sha256(b"").digest()


def test_roots_match_the_reference_vectors():
    for size, expected in enumerate(ROOTS, start=1):
        assert merkle.root(LEAVES[:size]).hex() == expected


def test_a_hand_computed_three_leaf_tree():
    a, b, c = (merkle.leaf_hash(x) for x in (b"a", b"b", b"c"))
    assert merkle.root([a, b, c]) == merkle.node_hash(merkle.node_hash(a, b), c)
    assert merkle.inclusion_proof([a, b, c], 2) == [merkle.node_hash(a, b)]
    assert merkle.inclusion_proof([a, b, c], 0) == [b, c]


def test_inclusion_proof_vectors():
    assert merkle.inclusion_proof(LEAVES, 0) == _h(
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    )
    assert merkle.inclusion_proof(LEAVES, 5) == _h(
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    )


def test_consistency_proof_vectors():
    assert merkle.consistency_proof(LEAVES, 6) == _h(
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    )
    assert merkle.consistency_proof(LEAVES[:5], 2) == _h(
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    )


leaf_lists = st.lists(st.binary(max_size=8), min_size=1, max_size=70).map(
    lambda data: [merkle.leaf_hash(d) for d in data]
)


@given(leaf_lists, st.data())
def test_every_inclusion_proof_verifies_and_a_changed_leaf_fails(leaves, data):
    size, root = len(leaves), merkle.root(leaves)
    for index in range(size):
        proof = merkle.inclusion_proof(leaves, index)
        assert merkle.verify_inclusion(leaves[index], index, size, proof, root)
    index = data.draw(st.integers(0, size - 1))
    proof = merkle.inclusion_proof(leaves, index)
    changed = merkle.leaf_hash(b"changed")
    assert not merkle.verify_inclusion(changed, index, size, proof, root)
    if size > 1:
        other = (index + 1) % size
        assert not merkle.verify_inclusion(leaves[index], other, size, proof, root) or (
            leaves[index] == leaves[other]
        )
    assert not merkle.verify_inclusion(leaves[index], size, size, proof, root)


@given(leaf_lists, st.data())
def test_every_consistency_proof_verifies_and_a_rewrite_fails(leaves, data):
    new_size, new_root = len(leaves), merkle.root(leaves)
    for old_size in range(new_size + 1):
        proof = merkle.consistency_proof(leaves, old_size)
        old_root = merkle.root(leaves[:old_size])
        assert merkle.verify_consistency(old_size, new_size, old_root, new_root, proof)
    old_size = data.draw(st.integers(1, new_size))
    rewritten = list(leaves)
    rewritten[data.draw(st.integers(0, old_size - 1))] = merkle.leaf_hash(b"rewritten")
    proof = merkle.consistency_proof(rewritten, old_size)
    if rewritten != leaves:
        assert not merkle.verify_consistency(
            old_size, new_size, merkle.root(leaves[:old_size]), merkle.root(rewritten), proof
        )


@given(leaf_lists)
def test_compact_range_root_equals_the_tree_root(leaves):
    compact = merkle.CompactRange()
    for i, leaf in enumerate(leaves, start=1):
        compact.append(leaf)
        assert compact.root() == merkle.root(leaves[:i])
    resumed = merkle.CompactRange(compact.size, compact.hashes)
    resumed.append(leaves[0])
    assert resumed.root() == merkle.root([*leaves, leaves[0]])
