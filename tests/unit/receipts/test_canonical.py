"""Canonical JSON: our fast path writes exactly what the rfc8785 package writes."""

from __future__ import annotations

import base64
import dataclasses
import enum
import math

import pytest
import rfc8785
from hypothesis import assume, given
from hypothesis import strategies as st

from sandlot.errors import InvalidRequest
from sandlot.receipts import Decision, Ed25519Signer, Entry, PolicyRef, decision_entry
from sandlot.receipts.canonical import GENESIS_HASH, canonical_json, parse_digest_ref, sha256_ref
from sandlot.receipts.dsse import Envelope, Signature, pae
from sandlot.receipts.receipt import _canonical_body, seal, seal_entry

_SAFE = 2**53 - 1

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-_SAFE, _SAFE)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)


@given(json_values)
def test_canonical_json_equals_rfc8785(value):
    assert canonical_json(value) == rfc8785.dumps(value)


@given(st.dictionaries(st.text(max_size=4), st.text(), max_size=6))
def test_non_ascii_keys_sort_by_utf16_code_units(value):
    assert canonical_json(value) == rfc8785.dumps(value)


def test_known_canonical_forms():
    assert (
        canonical_json({"b": 1, "a": [True, None, "é\n"]})
        == '{"a":[true,null,"é\\n"],"b":1}'.encode()
    )
    assert canonical_json(1e21) == b"1e+21"
    assert canonical_json(-0.0) == b"0"
    # U+1F600 (surrogate pair D83D DE00) sorts before U+FFFD in UTF-16, after it by code point.
    assert canonical_json({"\ufffd": 1, "\U0001f600": 2}) == '{"\U0001f600":2,"\ufffd":1}'.encode()


@pytest.mark.parametrize("bad", [2**53, -(2**53), math.nan, math.inf, "\ud800", {1: "x"}])
def test_values_outside_the_scheme_are_refused(bad):
    with pytest.raises(InvalidRequest):
        canonical_json(bad)


def test_digest_refs():
    ref = sha256_ref(b"abc")
    assert ref == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert parse_digest_ref(ref).hex() == ref[7:]
    for bad in (
        "sha256:" + "A" * 64,
        "sha1:" + "0" * 64,
        "sha256:" + "0" * 63,
        "sha256:" + "zz" * 32,
    ):
        with pytest.raises(InvalidRequest):
            parse_digest_ref(bad)


def test_pae_matches_the_dsse_spec():
    assert pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


@given(st.binary(), st.text(min_size=1), st.lists(st.tuples(st.text(), st.binary()), max_size=3))
def test_envelope_json_is_canonical_and_round_trips(payload, payload_type, sigs):
    envelope = Envelope(payload_type, payload, tuple(Signature(k, s) for k, s in sigs))
    try:
        expected = rfc8785.dumps(
            {
                "payload": base64.b64encode(payload).decode(),
                "payloadType": payload_type,
                "signatures": [{"keyid": k, "sig": base64.b64encode(s).decode()} for k, s in sigs],
            }
        ).decode()
    except rfc8785.CanonicalizationError:
        return  # lone surrogates: not representable, refused on parse below
    assert envelope.to_json() == expected
    assert Envelope.from_json(expected) == envelope


def test_envelope_refuses_other_spellings():
    line = Envelope("t", b"ab", (Signature("k", b"s"),)).to_json()
    assert Envelope.from_json(line)
    for variant in (
        line.replace(",", ", "),
        line.replace('"YWI="', '"YWJ="'),  # same bytes, stray low bits in the last base64 char
        line + " ",
        line[:-1] + ',"extra":1}',
    ):
        with pytest.raises(InvalidRequest):
            Envelope.from_json(variant)


# Receipt bodies: seal_entry writes the body's canonical bytes field by field (the append hot
# path); they must be exactly what canonical_json writes, or seal_entry must step aside.

_SIGNER = Ed25519Signer.generate()


class _Op(enum.StrEnum):
    EXEC = "exec"


_text = st.text() | st.sampled_from(["é", '\x00\n"\\', "\u2028", "\U0001f600"])
_texts = st.none() | _text
_refs = st.none() | st.binary().map(sha256_ref)
_entries = st.builds(
    Entry,
    type=st.sampled_from(["network.egress", "x"]) | _text.filter(bool),
    op=_texts,
    tenant=_texts,
    principal=_texts,
    sandbox_id=_texts,
    decision_ref=_refs,
    output_hash=_refs,
    exit_code=st.none() | st.integers(-_SAFE, _SAFE),
    intent_id=_texts,
    idempotency_key=_texts,
    detail=st.none() | st.dictionaries(st.text(max_size=8), json_values, max_size=3),
)
_policies = st.builds(
    PolicyRef,
    engine=_text,
    policy_hash=st.binary().map(sha256_ref),
    matched=st.lists(_text, max_size=3).map(tuple),
)


class _Verdict(enum.Enum):
    ALLOW = "ALLOW"


class _ExitCode(enum.IntEnum):
    FAILED = 1


# Values that json.dumps and RFC 8785 may write differently, or that cannot be written at all.
_ODD = [5, 1.5, True, _Op.EXEC, "\ud800", ("\ud800",)]
_ODD_VALUES = {
    "type": _ODD,
    "op": _ODD,
    "principal": _ODD,
    "intent_id": _ODD,
    "exit_code": [_ExitCode.FAILED],  # an int subclass (other types: Entry refuses them)
    "decision": [_Verdict.ALLOW],
    "detail": [{"x": 1.5}, {"x": 2**53}, {"\ud800": 1}],
    "policy.engine": _ODD,
    "policy.matched": [(5,), ("\ud800",), (_Op.EXEC,)],
}
_ODD_CASES = [(field, value) for field, values in _ODD_VALUES.items() for value in values]
_big = st.integers(2**53, 2**60) | st.integers(-(2**60), -(2**53))


def _chain(seq: object, lamport: object) -> dict:
    return {
        "log_id": "test.example/receipts",
        "seq": seq,
        "lamport": lamport,
        "ts": "2026-01-01T00:00:00.000000Z",
        "prev_hash": GENESIS_HASH,
    }


@given(st.data())
def test_sealed_entries_are_what_seal_writes(data):
    entry = data.draw(_entries)
    extra: dict[str, object] = {
        "request_hash": data.draw(_refs),
        "reason_code": data.draw(_texts),
        "policy": data.draw(st.none() | _policies),
    }
    if data.draw(st.booleans()):  # a decision: the one type that may carry a HOLD
        extra.update(type="decision", decision=data.draw(st.sampled_from(Decision)))
    if data.draw(st.integers(0, 3)) == 0:  # now and then, one value off the fast path
        extra.update(_odd(*data.draw(st.sampled_from(_ODD_CASES))))
    try:
        entry = dataclasses.replace(entry, **extra)
    except InvalidRequest:
        assume(False)
    ints = st.integers(1, _SAFE)
    chain = _chain(data.draw(ints | _big), data.draw(ints | _big | st.just(2.0)))
    _check_sealed_like_seal(entry, chain)


def _odd(field: str, value: object) -> dict[str, object]:
    if field.startswith("policy."):
        policy = PolicyRef(engine="cedar", policy_hash=sha256_ref(b""))
        return {"policy": dataclasses.replace(policy, **{field.removeprefix("policy."): value})}
    return {field: value}


@pytest.mark.parametrize(("field", "value"), _ODD_CASES)
def test_values_off_the_fast_path_are_sealed_as_seal_does(field, value):
    fields = {"type": "network.egress", "op": "exec", "tenant": "default", **_odd(field, value)}
    entry = Entry(**fields)
    _check_sealed_like_seal(entry, _chain(5, 5))


def _check_sealed_like_seal(entry: Entry, chain: dict) -> None:
    body = {**entry.fields(), "v": 1, **chain, "key_id": _SIGNER.key_id}
    try:
        expected = seal(body, [_SIGNER])
    except InvalidRequest:
        with pytest.raises(InvalidRequest):
            seal_entry(entry, signers=[_SIGNER], **chain)
        return
    got = seal_entry(entry, signers=[_SIGNER], **chain)
    assert got.line == expected.line
    assert got.body == expected.body
    assert (got.seq, got.lamport, got.type) == (expected.seq, expected.lamport, expected.type)
    fast = _canonical_body(entry, key_id=_SIGNER.key_id, **chain)
    assert fast is None or fast == canonical_json(body)


def test_ordinary_receipts_take_the_fast_path():
    policy = PolicyRef(engine="cedar", policy_hash=sha256_ref(b"p"), matched=("a", "b"))
    ref = sha256_ref(b"x")
    entries = [
        decision_entry(
            op="exec",
            request_hash=ref,
            decision=Decision.HOLD,
            reason_code="NEEDS_APPROVAL",
            policy=policy,
            tenant="default",
            principal="agent:é@default",
            sandbox_id="sbx_1",
            intent_id="i",
            idempotency_key="k",
            detail={"argv": ["rm", "-rf", "/"], "n": 1},
        ),
        Entry(type="execution", op="exec", request_hash=ref, decision_ref=ref, exit_code=-1),
        Entry(type="network.egress", output_hash=ref),
    ]
    for entry in entries:
        chain = _chain(7, 9)
        body = {**entry.fields(), "v": 1, **chain, "key_id": _SIGNER.key_id}
        assert _canonical_body(entry, key_id=_SIGNER.key_id, **chain) == canonical_json(body)


@pytest.mark.parametrize("exit_code", ["0", 1.5, True, 2**60])
def test_entry_refuses_an_exit_code_that_is_not_a_safe_integer(exit_code):
    with pytest.raises(InvalidRequest, match="exit_code"):
        Entry(type="execution", exit_code=exit_code)
