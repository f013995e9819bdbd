"""RFC 8785 canonical JSON and the SHA-256 helpers every receipt hash is built from.

This module owns the byte form that gets signed and hashed. It imports nothing from sandlot but
:mod:`sandlot.errors`.

:func:`canonical_json` gives exactly the bytes of ``rfc8785.dumps`` (the JSON Canonicalization
Scheme). Receipt bodies sit on the append hot path, and the pure-Python ``rfc8785`` costs about
45 µs for one body, half the whole append budget. For values that cannot tell the two apart —
no floats, integers within ±(2**53 - 1), ASCII object keys — the standard library's
``json.dumps`` with sorted keys and no whitespace writes the same bytes about five times faster:
both escape only ``"``, ``\\`` and control characters, with the same short forms and lowercase
``\\u00xx``. Everything else goes through ``rfc8785``. A property test pins the two paths to
identical output, and the verifier re-checks every payload, so a divergence cannot pass unseen.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TypeAlias

import rfc8785

from sandlot.errors import InvalidRequest

__all__ = [
    "GENESIS_HASH",
    "JsonValue",
    "canonical_json",
    "check_digest_ref",
    "digest_ref",
    "parse_digest_ref",
    "sha256_ref",
]

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"

# RFC 8785 (through I-JSON) only admits integers that an IEEE double holds exactly.
_MAX_SAFE_INT = 2**53 - 1

# Built once: json.dumps with arguments builds a new encoder on every call (~2 µs).
_encode = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode

_PREFIX = "sha256:"
_REF = re.compile(r"sha256:[0-9a-f]{64}")

#: The ``prev_hash`` of the first receipt of a log: there is no previous receipt.
GENESIS_HASH = _PREFIX + "0" * 64


def canonical_json(value: JsonValue) -> bytes:
    """The RFC 8785 canonical UTF-8 bytes of a JSON value.

    Args:
        value: A JSON value built from dicts with string keys, lists, strings, integers,
            floats, booleans and None.

    Returns:
        The canonical bytes, identical to ``rfc8785.dumps(value)``.

    Raises:
        InvalidRequest: The value cannot be canonicalized (an integer beyond ±(2**53 - 1), a
            NaN or infinite float, a lone surrogate, a non-string key).
    """
    if _is_plain(value):
        try:
            return _encode(value).encode()
        except UnicodeEncodeError:
            pass  # a lone surrogate: let rfc8785 report it in its own words
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, UnicodeEncodeError, TypeError) as e:
        msg = f"value cannot be written as canonical JSON: {e}"
        raise InvalidRequest(msg) from e


def _is_plain(value: JsonValue) -> bool:
    """Whether ``json.dumps`` writes ``value`` exactly as RFC 8785 does.

    Exact type checks on purpose: subclasses (enums) may serialize differently and take the
    ``rfc8785`` path. Scalars inside a dict are checked inline, without a call each: this runs
    on every append.
    """
    if type(value) is dict:
        for k, v in value.items():
            # Python sorts keys by code point, RFC 8785 by UTF-16 code unit: same on ASCII.
            if type(k) is not str or not k.isascii():
                return False
            if type(v) is str or type(v) is bool or v is None:
                continue
            if type(v) is int:
                if not -_MAX_SAFE_INT <= v <= _MAX_SAFE_INT:
                    return False
            elif not _is_plain(v):
                return False
        return True
    if type(value) is list:
        return all(_is_plain(item) for item in value)
    if type(value) is int:
        return -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT
    return type(value) is str or type(value) is bool or value is None  # floats: no


def sha256_ref(data: bytes) -> str:
    """``"sha256:<hex>"`` of ``data``: the form every hash takes inside a receipt."""
    return _PREFIX + hashlib.sha256(data).hexdigest()


def digest_ref(digest: bytes) -> str:
    """``"sha256:<hex>"`` for a SHA-256 digest already computed."""
    return _PREFIX + digest.hex()


def check_digest_ref(ref: str) -> None:
    """Refuse anything but a ``"sha256:<hex>"`` string.

    Raises:
        InvalidRequest: ``ref`` is not a ``sha256:`` reference to 32 bytes.
    """
    # Only one spelling is accepted (lowercase, no spaces), so equal digests compare equal.
    if not isinstance(ref, str) or _REF.fullmatch(ref) is None:
        msg = f"not a sha256 reference: {ref!r}"
        raise InvalidRequest(msg)


def parse_digest_ref(ref: str) -> bytes:
    """The 32 digest bytes of a ``"sha256:<hex>"`` string.

    Raises:
        InvalidRequest: ``ref`` is not a ``sha256:`` reference to 32 bytes.
    """
    check_digest_ref(ref)
    return bytes.fromhex(ref[len(_PREFIX) :])
