"""What a receipt says: entries (what the caller reports), bodies (what gets signed), receipts.

The caller describes an event as an :class:`Entry` (built with :func:`decision_entry`,
:func:`execution_entry`, :func:`approval_entry`, or directly for free types such as
``network.egress``). The log adds the chain fields (``log_id``, ``seq``, ``lamport``, ``ts``,
``prev_hash``, ``key_id``) and seals the body into a DSSE envelope: a :class:`Receipt`. Every
field of the body is signed; nothing but the envelope lies outside the signature.

Body v1 (fields that are None are left out)::

    {"v": 1, "type": "decision", "log_id": "<origin>", "seq": 42, "lamport": 42,
     "ts": "2026-01-01T00:00:00.000000Z", "tenant": "…", "principal": "agent:…",
     "sandbox_id": "sbx_…", "op": "exec", "request_hash": "sha256:…",
     "decision": "ALLOW|DENY|HOLD", "reason_code": "OK",
     "policy": {"engine": "cedar", "policy_hash": "sha256:…", "matched": ["…"]},
     "decision_ref": "sha256:…", "output_hash": "sha256:…", "exit_code": 0,
     "intent_id": "…", "idempotency_key": "…", "detail": {…},
     "prev_hash": "sha256:…", "key_id": "ed25519:…"}

This module imports nothing from sandlot but :mod:`sandlot.errors` and the receipts' own
``canonical``, ``dsse`` and ``signer`` modules; it must not import the database.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import final

from sandlot.errors import InvalidRequest
from sandlot.receipts.canonical import JsonValue, canonical_json, check_digest_ref, sha256_ref
from sandlot.receipts.dsse import Envelope, Signature, sign_envelope
from sandlot.receipts.signer import Signer

__all__ = [
    "APPROVAL",
    "DECISION",
    "EXECUTION",
    "KEY_ROTATION",
    "PAYLOAD_TYPE",
    "Decision",
    "Entry",
    "PolicyRef",
    "Receipt",
    "approval_entry",
    "decision_entry",
    "draft_entry",
    "execution_entry",
    "seal",
    "seal_entry",
    "seal_signed",
]

#: The DSSE payload type of every receipt; the verifier accepts no other.
PAYLOAD_TYPE = "application/vnd.sandlot.receipt.v1+json"

DECISION = "decision"
EXECUTION = "execution"
APPROVAL = "approval"
KEY_ROTATION = "key_rotation"

_MAX_SAFE_INT = 2**53 - 1


class Decision(enum.StrEnum):
    """What the policy gate decided."""

    ALLOW = "ALLOW"
    DENY = "DENY"
    HOLD = "HOLD"


@final
@dataclass(frozen=True, kw_only=True)
class PolicyRef:
    """Which policy decided: the engine, the hash of the policy set, the policies that matched."""

    engine: str
    policy_hash: str
    matched: tuple[str, ...] = ()

    def to_json(self) -> dict[str, JsonValue]:
        """The ``policy`` object of a receipt body."""
        return {
            "engine": self.engine,
            "policy_hash": self.policy_hash,
            "matched": list(self.matched),
        }


@final
@dataclass(frozen=True, kw_only=True)
class Entry:
    """An event to record, before the log gives it a place in the chain.

    Attributes:
        type: ``decision``, ``execution``, ``approval``, ``key_rotation`` or a free type
            (``network.egress``, …).
        op: The operation (``exec``, ``fs.write``, ``sandbox.create``, …).
        tenant: The tenant the operation belongs to.
        principal: Who asked (``agent:<id>@<tenant>``, ``user:…``).
        sandbox_id: The sandbox concerned, if any.
        request_hash: ``sha256:`` of the canonical normalized request.
        decision: ALLOW, DENY or HOLD (decisions and approvals).
        reason_code: Why (``OK``, ``POLICY_DENY``, ``POLICY_ERROR``, …).
        policy: The policy that decided.
        decision_ref: ``entry_hash`` of the receipt this one follows from (an execution's
            decision, an approval's HOLD).
        output_hash: ``sha256:`` of what the execution produced.
        exit_code: The execution's exit code.
        intent_id: The journal intent, if any.
        idempotency_key: The caller's idempotency key, if any.
        detail: Type-specific data (JSON object).
    """

    type: str
    op: str | None = None
    tenant: str | None = None
    principal: str | None = None
    sandbox_id: str | None = None
    request_hash: str | None = None
    decision: Decision | None = None
    reason_code: str | None = None
    policy: PolicyRef | None = None
    decision_ref: str | None = None
    output_hash: str | None = None
    exit_code: int | None = None
    intent_id: str | None = None
    idempotency_key: str | None = None
    detail: Mapping[str, JsonValue] | None = None

    def __post_init__(self) -> None:
        if not self.type:
            msg = "a receipt needs a type"
            raise InvalidRequest(msg)
        for ref in (self.request_hash, self.decision_ref, self.output_hash):
            if ref is not None:
                check_digest_ref(ref)
        if self.policy is not None:
            check_digest_ref(self.policy.policy_hash)
        if self.exit_code is not None:
            if not isinstance(self.exit_code, int) or isinstance(self.exit_code, bool):
                msg = f"exit_code must be an integer, not {self.exit_code!r}"
                raise InvalidRequest(msg)
            if abs(self.exit_code) > _MAX_SAFE_INT:
                msg = f"exit_code out of range: {self.exit_code}"
                raise InvalidRequest(msg)
        _check_shape(self)

    def fields(self) -> dict[str, JsonValue]:
        """The entry's part of a receipt body (None fields left out)."""
        # Spelled out rather than a loop over the field names: this runs on every append.
        out: dict[str, JsonValue] = {"type": self.type}
        if self.op is not None:
            out["op"] = self.op
        if self.tenant is not None:
            out["tenant"] = self.tenant
        if self.principal is not None:
            out["principal"] = self.principal
        if self.sandbox_id is not None:
            out["sandbox_id"] = self.sandbox_id
        if self.request_hash is not None:
            out["request_hash"] = self.request_hash
        if self.reason_code is not None:
            out["reason_code"] = self.reason_code
        if self.decision_ref is not None:
            out["decision_ref"] = self.decision_ref
        if self.output_hash is not None:
            out["output_hash"] = self.output_hash
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        if self.intent_id is not None:
            out["intent_id"] = self.intent_id
        if self.idempotency_key is not None:
            out["idempotency_key"] = self.idempotency_key
        if self.decision is not None:
            out["decision"] = self.decision.value
        if self.policy is not None:
            out["policy"] = self.policy.to_json()
        if self.detail is not None:
            out["detail"] = dict(self.detail)
        return out


_REQUIRED: dict[str, tuple[str, ...]] = {
    DECISION: ("op", "request_hash", "decision", "reason_code"),
    EXECUTION: ("op", "request_hash", "decision_ref"),
    APPROVAL: ("request_hash", "decision", "reason_code", "decision_ref"),
    KEY_ROTATION: ("detail",),
}


def _check_shape(entry: Entry) -> None:
    missing = [f for f in _REQUIRED.get(entry.type, ()) if getattr(entry, f) is None]
    if missing:
        msg = f"a {entry.type} receipt needs {', '.join(missing)}"
        raise InvalidRequest(msg)
    if entry.decision is Decision.HOLD and entry.type != DECISION:
        msg = "only a decision can be HOLD"
        raise InvalidRequest(msg)


def decision_entry(
    *,
    op: str,
    request_hash: str,
    decision: Decision,
    reason_code: str,
    policy: PolicyRef | None = None,
    tenant: str | None = None,
    principal: str | None = None,
    sandbox_id: str | None = None,
    intent_id: str | None = None,
    idempotency_key: str | None = None,
    detail: Mapping[str, JsonValue] | None = None,
) -> Entry:
    """A policy decision about one normalized request (written before anything executes)."""
    return Entry(
        type=DECISION,
        op=op,
        request_hash=request_hash,
        decision=decision,
        reason_code=reason_code,
        policy=policy,
        tenant=tenant,
        principal=principal,
        sandbox_id=sandbox_id,
        intent_id=intent_id,
        idempotency_key=idempotency_key,
        detail=detail,
    )


def execution_entry(
    authorization: Receipt,
    *,
    output_hash: str | None = None,
    exit_code: int | None = None,
    detail: Mapping[str, JsonValue] | None = None,
) -> Entry:
    """The outcome of executing what ``authorization`` allowed.

    Args:
        authorization: The ALLOW decision receipt (or the ALLOW approval of a HOLD).
        output_hash: ``sha256:`` of the output, if there was any.
        exit_code: The exit code, if the operation has one.
        detail: Type-specific data.

    Raises:
        InvalidRequest: ``authorization`` is not an ALLOW decision or approval.
    """
    if (
        authorization.type not in (DECISION, APPROVAL)
        or authorization.decision is not Decision.ALLOW
    ):
        msg = f"receipt {authorization.seq} is not an ALLOW decision; nothing may execute on it"
        raise InvalidRequest(msg)
    b = authorization.body
    return Entry(
        type=EXECUTION,
        op=_opt_str(b.get("op")),
        tenant=_opt_str(b.get("tenant")),
        principal=_opt_str(b.get("principal")),
        sandbox_id=_opt_str(b.get("sandbox_id")),
        request_hash=authorization.request_hash,
        decision_ref=authorization.entry_hash,
        intent_id=_opt_str(b.get("intent_id")),
        idempotency_key=_opt_str(b.get("idempotency_key")),
        output_hash=output_hash,
        exit_code=exit_code,
        detail=detail,
    )


def approval_entry(
    hold: Receipt,
    *,
    decision: Decision,
    principal: str,
    reason_code: str = "APPROVED",
    detail: Mapping[str, JsonValue] | None = None,
) -> Entry:
    """A human's or agent's answer to a HOLD decision.

    Args:
        hold: The HOLD decision receipt.
        decision: ALLOW or DENY.
        principal: Who approved or denied.
        reason_code: Why (``APPROVED``, ``REJECTED``, ``HOLD_TIMEOUT``, …).
        detail: Type-specific data.

    Raises:
        InvalidRequest: ``hold`` is not a HOLD decision, or ``decision`` is HOLD.
    """
    if hold.type != DECISION or hold.decision is not Decision.HOLD:
        msg = f"receipt {hold.seq} is not a HOLD decision"
        raise InvalidRequest(msg)
    b = hold.body
    return Entry(
        type=APPROVAL,
        op=_opt_str(b.get("op")),
        tenant=_opt_str(b.get("tenant")),
        sandbox_id=_opt_str(b.get("sandbox_id")),
        principal=principal,
        request_hash=hold.request_hash,
        decision=decision,
        reason_code=reason_code,
        decision_ref=hold.entry_hash,
        detail=detail,
    )


@final
@dataclass(frozen=True, eq=False)
class Receipt:
    """One signed receipt: its body, its DSSE envelope and its place in the chain.

    Attributes:
        seq: Position in the log, from 1, contiguous.
        lamport: The Lamport clock value.
        type: The receipt type.
        entry_hash: ``sha256:`` of the signed payload; what ``prev_hash`` and
            ``decision_ref`` point at, and the receipt's id.
        body: The signed body.
        envelope: The DSSE envelope.
        line: The receipt as one JSONL line (the canonical envelope, no newline).
    """

    seq: int
    lamport: int
    type: str
    entry_hash: str
    body: Mapping[str, JsonValue]
    envelope: Envelope
    line: str

    @property
    def leaf_hash(self) -> bytes:
        """The RFC 9162 Merkle leaf hash of the payload."""
        return hashlib.sha256(b"\x00" + self.envelope.payload).digest()

    @property
    def key_id(self) -> str:
        """The key that signed (for a rotation: the old key)."""
        return _opt_str(self.body.get("key_id")) or ""

    @property
    def prev_hash(self) -> str:
        """``entry_hash`` of the previous receipt."""
        return _opt_str(self.body.get("prev_hash")) or ""

    @property
    def decision(self) -> Decision | None:
        """ALLOW, DENY or HOLD, for decisions and approvals."""
        value = self.body.get("decision")
        if not isinstance(value, str):
            return None
        try:
            return Decision(value)
        except ValueError:
            return None

    @property
    def reason_code(self) -> str | None:
        """Why the decision went the way it did."""
        return _opt_str(self.body.get("reason_code"))

    @property
    def request_hash(self) -> str | None:
        """``sha256:`` of the normalized request."""
        return _opt_str(self.body.get("request_hash"))

    @classmethod
    def from_line(cls, line: str) -> Receipt:
        """Parse one JSONL line (no signature check: see :mod:`sandlot.receipts.verify`).

        Raises:
            InvalidRequest: The line is not a canonical envelope around a receipt body.
        """
        envelope = Envelope.from_json(line)
        body = _parse_body(envelope.payload)
        return cls(
            seq=_int(body, "seq"),
            lamport=_int(body, "lamport"),
            type=_opt_str(body.get("type")) or "",
            entry_hash=sha256_ref(envelope.payload),
            body=body,
            envelope=envelope,
            line=line.removesuffix("\n"),
        )


def seal(body: dict[str, JsonValue], signers: Sequence[Signer]) -> Receipt:
    """Sign a complete body (chain fields included) into a receipt.

    ``signers[0]`` is the key named by ``body["key_id"]``; a rotation adds the new key second.
    """
    payload = canonical_json(body)
    return _sealed(body, payload, signers)


def seal_entry(
    entry: Entry,
    *,
    log_id: str,
    seq: int,
    lamport: int,
    ts: str,
    prev_hash: str,
    signers: Sequence[Signer],
) -> Receipt:
    """Sign ``entry`` at its place in a chain into a receipt.

    The same receipt, byte for byte, as :func:`seal` of ``entry.fields()`` plus the chain
    fields, ``key_id`` being ``signers[0]``'s; only faster, as it runs on every append.
    """
    body, payload = draft_entry(
        entry,
        log_id=log_id,
        seq=seq,
        lamport=lamport,
        ts=ts,
        prev_hash=prev_hash,
        key_id=signers[0].key_id,
    )
    return _sealed(body, payload, signers)


def draft_entry(
    entry: Entry, *, log_id: str, seq: int, lamport: int, ts: str, prev_hash: str, key_id: str
) -> tuple[dict[str, JsonValue], bytes]:
    """The body :func:`seal_entry` signs and its canonical payload, not yet signed (a log signs
    a batch of drafts at once, see :func:`seal_signed`).

    Raises:
        InvalidRequest: A value of the entry cannot be written as canonical JSON.
    """
    body = entry.fields()
    body.update(
        v=1, log_id=log_id, seq=seq, lamport=lamport, ts=ts, prev_hash=prev_hash, key_id=key_id
    )
    payload = _canonical_body(entry, log_id, seq, lamport, ts, prev_hash, key_id)
    if payload is None:  # off the fast path: check what it checked
        _int(body, "seq")
        _int(body, "lamport")
        payload = canonical_json(body)
    return body, payload


def seal_signed(
    body: dict[str, JsonValue], payload: bytes, entry_hash: str, signatures: Sequence[Signature]
) -> Receipt:
    """The receipt of a :func:`draft_entry` whose PAE (:func:`~sandlot.receipts.dsse.pae` of
    :data:`PAYLOAD_TYPE` and ``payload``) the caller signed; ``entry_hash`` is
    ``sha256_ref(payload)``, which the caller computed to chain the next draft."""
    envelope = Envelope(payload_type=PAYLOAD_TYPE, payload=payload, signatures=tuple(signatures))
    return Receipt(
        seq=_int(body, "seq"),
        lamport=_int(body, "lamport"),
        type=str(body["type"]),
        entry_hash=entry_hash,
        body=body,
        envelope=envelope,
        line=envelope.to_json(),
    )


def _sealed(body: dict[str, JsonValue], payload: bytes, signers: Sequence[Signer]) -> Receipt:
    """Sign a drafted payload with every signer, in order, into its receipt."""
    signatures = sign_envelope(PAYLOAD_TYPE, payload, signers).signatures
    return seal_signed(body, payload, sha256_ref(payload), signatures)


def _canonical_body(
    e: Entry, log_id: str, seq: int, lamport: int, ts: str, prev_hash: str, key_id: str
) -> bytes | None:
    """``canonical_json`` of the body :func:`seal_entry` builds, written field by field.

    ``canonical_json`` checks every value of a body, then has ``json`` sort and write them:
    ~10 µs of an append. Here the keys are known, so they are written in their canonical
    order directly, and each value is checked only for being of the exact type whose
    ``json`` spelling is also its RFC 8785 one (as ``canonical_json``'s fast path does).
    Anything else (a subclass, a float, an integer beyond ±(2**53 - 1), a lone surrogate)
    returns None, and the caller takes ``canonical_json``, which decides or refuses it; the
    free-form ``detail`` always goes through ``canonical_json``. Tests pin this to
    ``canonical_json``, and the verifier re-checks every payload.
    """
    for value in (
        e.type,
        e.op,
        e.tenant,
        e.principal,
        e.sandbox_id,
        e.request_hash,
        e.reason_code,
        e.decision_ref,
        e.output_hash,
        e.intent_id,
        e.idempotency_key,
        log_id,
        ts,
        prev_hash,
        key_id,
    ):
        if value is not None and type(value) is not str:
            return None
    for number in (seq, lamport, e.exit_code):
        if number is not None and (type(number) is not int or abs(number) > _MAX_SAFE_INT):
            return None
    q = encode_basestring  # json's string writer: RFC 8785 escaping, see canonical.py
    decision = detail = exit_code = policy = ""
    if e.decision is not None:
        if type(e.decision) is not Decision:
            return None
        decision = f'"decision":{q(e.decision)},'  # a StrEnum: written as its value
    if e.detail is not None:
        # Free-form: canonical_json writes it, or refuses it just as seal would.
        detail = f'"detail":{canonical_json(dict(e.detail)).decode()},'
    if e.exit_code is not None:
        exit_code = f'"exit_code":{e.exit_code},'
    if e.policy is not None:
        p = e.policy
        if not all(type(m) is str for m in (p.engine, p.policy_hash, *p.matched)):
            return None
        matched = ",".join([q(m) for m in p.matched])
        policy = (
            f',"policy":{{"engine":{q(p.engine)},"matched":[{matched}],'
            f'"policy_hash":{q(p.policy_hash)}}}'
        )
    # Members before "key_id" end in a comma, those after it start with one.
    ref = "" if e.decision_ref is None else f'"decision_ref":{q(e.decision_ref)},'
    idem = "" if e.idempotency_key is None else f'"idempotency_key":{q(e.idempotency_key)},'
    intent = "" if e.intent_id is None else f'"intent_id":{q(e.intent_id)},'
    op = "" if e.op is None else f',"op":{q(e.op)}'
    output = "" if e.output_hash is None else f',"output_hash":{q(e.output_hash)}'
    principal = "" if e.principal is None else f',"principal":{q(e.principal)}'
    reason = "" if e.reason_code is None else f',"reason_code":{q(e.reason_code)}'
    request = "" if e.request_hash is None else f',"request_hash":{q(e.request_hash)}'
    sandbox = "" if e.sandbox_id is None else f',"sandbox_id":{q(e.sandbox_id)}'
    tenant = "" if e.tenant is None else f',"tenant":{q(e.tenant)}'
    text = (
        f'{{{decision}{ref}{detail}{exit_code}{idem}{intent}"key_id":{q(key_id)},'
        f'"lamport":{lamport},"log_id":{q(log_id)}{op}{output}{policy},'
        f'"prev_hash":{q(prev_hash)}{principal}{reason}{request}{sandbox},"seq":{seq}{tenant},'
        f'"ts":{q(ts)},"type":{q(e.type)},"v":1}}'
    )
    try:
        return text.encode()
    except UnicodeEncodeError:
        return None  # a lone surrogate: canonical_json refuses it in its own words


def _parse_body(payload: bytes) -> dict[str, JsonValue]:
    try:
        body = json.loads(payload)
    except ValueError as e:
        msg = f"receipt payload is not JSON: {e}"
        raise InvalidRequest(msg) from e
    if not isinstance(body, dict):
        msg = "receipt payload is not a JSON object"
        raise InvalidRequest(msg)
    return body


def _int(body: Mapping[str, JsonValue], name: str) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"receipt field {name!r} must be an integer, got {value!r}"
        raise InvalidRequest(msg)
    return value


def _opt_str(value: JsonValue | None) -> str | None:
    return value if isinstance(value, str) else None
