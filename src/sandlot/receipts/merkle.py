"""The RFC 9162 Merkle tree: tree hash, inclusion and consistency proofs, and their checks.

Leaves are hashed ``SHA-256(0x00 || data)`` and inner nodes ``SHA-256(0x01 || left || right)``;
a tree of n leaves splits at the largest power of two below n; the empty tree hashes to
``SHA-256("")`` (RFC 9162 section 2.1.1). Functions take *leaf hashes*, not leaf data, so the
log can keep them in a column instead of re-reading every payload. Proof checks follow the
algorithms of RFC 9162 sections 2.1.3.2 and 2.1.4.2 step by step. Pure functions over bytes;
this module imports nothing from sandlot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import final

__all__ = [
    "EMPTY_ROOT",
    "CompactRange",
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "node_hash",
    "root",
    "verify_consistency",
    "verify_inclusion",
]

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    """``SHA-256(0x00 || data)``."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """``SHA-256(0x01 || left || right)``."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(leaves: Sequence[bytes]) -> bytes:
    """The Merkle Tree Hash of a list of leaf hashes."""
    if not leaves:
        return EMPTY_ROOT
    return _mth(leaves, 0, len(leaves))


def _mth(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    n = hi - lo
    if n & (n - 1) == 0:
        return _perfect(leaves, lo, hi)
    k = _split(n)
    return node_hash(_mth(leaves, lo, lo + k), _mth(leaves, lo + k, hi))


def _perfect(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    # A power-of-two range: hash level by level, without recursion.
    level = list(leaves[lo:hi])
    while len(level) > 1:
        level = [node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """The audit path of leaf ``index`` in the tree of all ``leaves`` (RFC 9162 PATH).

    Raises:
        IndexError: ``index`` is not a leaf of the tree.
    """
    if not 0 <= index < len(leaves):
        msg = f"leaf {index} is not in a tree of {len(leaves)}"
        raise IndexError(msg)
    return _path(leaves, index, 0, len(leaves))


def _path(leaves: Sequence[bytes], m: int, lo: int, hi: int) -> list[bytes]:
    n = hi - lo
    if n == 1:
        return []
    k = _split(n)
    if m < k:
        return [*_path(leaves, m, lo, lo + k), _mth(leaves, lo + k, hi)]
    return [*_path(leaves, m - k, lo + k, hi), _mth(leaves, lo, lo + k)]


def verify_inclusion(
    leaf: bytes, index: int, size: int, proof: Sequence[bytes], root_hash: bytes
) -> bool:
    """Whether ``proof`` shows leaf hash ``leaf`` at ``index`` in the tree ``(size, root_hash)``."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root_hash


def consistency_proof(leaves: Sequence[bytes], old_size: int) -> list[bytes]:
    """The proof that the tree of ``old_size`` leaves is a prefix of the tree of all ``leaves``.

    Empty when ``old_size`` is 0 or equals ``len(leaves)``: there is nothing to prove.

    Raises:
        IndexError: ``old_size`` is larger than the tree.
    """
    if not 0 <= old_size <= len(leaves):
        msg = f"a tree of {len(leaves)} cannot extend one of {old_size}"
        raise IndexError(msg)
    if old_size in (0, len(leaves)):
        return []
    return _subproof(leaves, old_size, 0, len(leaves), complete=True)


def _subproof(leaves: Sequence[bytes], m: int, lo: int, hi: int, *, complete: bool) -> list[bytes]:
    n = hi - lo
    if m == n:
        return [] if complete else [_mth(leaves, lo, hi)]
    k = _split(n)
    if m <= k:
        return [*_subproof(leaves, m, lo, lo + k, complete=complete), _mth(leaves, lo + k, hi)]
    return [*_subproof(leaves, m - k, lo + k, hi, complete=False), _mth(leaves, lo, lo + k)]


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """Whether ``proof`` shows the tree ``(old_size, old_root)`` is a prefix of the new tree."""
    if not 0 <= old_size <= new_size:
        return False
    if old_size == 0:
        return not proof and old_root == EMPTY_ROOT and (new_size > 0 or new_root == EMPTY_ROOT)
    if old_size == new_size:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == old_root and sr == new_root and sn == 0


@final
class CompactRange:
    """The roots of the perfect subtrees covering leaves ``[0, size)``: a growing tree's root
    in O(log n) space, extended one leaf at a time.

    Its :meth:`root` equals :func:`root` of the same leaves, because RFC 9162's split at the
    largest power of two decomposes a tree into exactly these subtrees, largest first.
    """

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        """Resume from a saved ``(size, hashes)``; one hash per set bit of ``size``."""
        if len(hashes) != size.bit_count():
            msg = (
                f"a compact range of {size} leaves has {size.bit_count()} hashes, not {len(hashes)}"
            )
            raise ValueError(msg)
        self.size = size
        self.hashes = list(hashes)

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash."""
        self.hashes.append(leaf)
        # Each trailing 1-bit of the old size is a subtree the new leaf completes a sibling for.
        size = self.size
        while size & 1:
            right = self.hashes.pop()
            self.hashes[-1] = node_hash(self.hashes[-1], right)
            size >>= 1
        self.size += 1

    def root(self) -> bytes:
        """The Merkle Tree Hash of the leaves so far."""
        if not self.hashes:
            return EMPTY_ROOT
        r = self.hashes[-1]
        for h in reversed(self.hashes[:-1]):
            r = node_hash(h, r)
        return r
