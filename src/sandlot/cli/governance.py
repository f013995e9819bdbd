"""The governance commands: ``receipts``, ``keys``, ``approvals`` and ``policy``.

``receipts verify`` and ``receipts verify-proof`` work offline on exported files (exit 0 valid,
1 a verification failure naming the first bad seq and the check, 2 a usage or I/O error); the
others read the receipt log in the database next to the sandbox records. The receipts, the
journal and the store are imported by the commands that use them, not with this module (which
``--help`` imports).
"""

from __future__ import annotations

import getpass
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _effective_settings, _print_json, _run, app, err, out
from sandlot.cli.options import JsonOpt
from sandlot.errors import InvalidRequest, SandboxError

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.journal import Journal
    from sandlot.models import Actor
    from sandlot.receipts import ReceiptLog

__all__ = ["approvals_app", "intents_app", "keys_app", "policy_app", "receipts_app"]

receipts_app = typer.Typer(
    help="Signed receipts: export, tail, verify offline, prove inclusion.", no_args_is_help=True
)
keys_app = typer.Typer(
    help="Receipt-signing keys: export the trust root, rotate.", no_args_is_help=True
)
approvals_app = typer.Typer(
    help="Operations the policy held for approval: list, approve, deny.", no_args_is_help=True
)
policy_app = typer.Typer(
    help="The policy gate: explain a decision without running anything.", no_args_is_help=True
)
app.add_typer(receipts_app, name="receipts")
app.add_typer(keys_app, name="keys")
app.add_typer(approvals_app, name="approvals")
app.add_typer(policy_app, name="policy")


def _fail(message: str, code: int, as_json: bool) -> typer.Exit:
    from rich.markup import escape

    if as_json:
        print(json.dumps({"error": {"message": message}}))
    else:
        err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(code)


@contextmanager
def _log(as_json: bool = False) -> Iterator[ReceiptLog]:
    """The receipt log of the configured home and database."""
    from sandlot.wiring import database_url, open_receipt_log

    try:
        settings = _effective_settings()
        url = database_url(settings.values.database, settings.home)
        with open_receipt_log(settings.home, url) as log:
            yield log
    except SandboxError as e:
        raise _fail(e.message, 1, as_json) from None


# -- receipts --------------------------------------------------------------------------------


@receipts_app.command("export")
def export(
    out_file: Annotated[
        Path, typer.Option("--out", "-o", help="Write the log here as JSONL ('-' for stdout).")
    ],
    from_seq: Annotated[int, typer.Option("--from", min=1, help="First seq to export.")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Export the receipt log as JSONL (one DSSE envelope per line), with a fresh checkpoint."""
    with _log(as_json) as log:
        note = log.checkpoint() if log.size() else ""
        if str(out_file) == "-":
            count = log.export_jsonl(sys.stdout, from_seq)
        else:
            with open(out_file, "w") as f:
                count = log.export_jsonl(f, from_seq)
            if note:
                out_file.with_suffix(out_file.suffix + ".checkpoint").write_text(note)
    if as_json:
        _print_json({"receipts": count, "out": str(out_file)})
    elif str(out_file) != "-":
        err.print(
            f"exported {count} receipts to {out_file}"
            + (f" (checkpoint: {out_file}.checkpoint)" if note else "")
        )


@receipts_app.command("tail")
def tail(
    n: Annotated[int, typer.Option("-n", min=1, help="How many.")] = 10,
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", help="Only receipts about this sandbox.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the newest receipts."""
    with _log(as_json) as log:
        items = log.tail(n, sandbox_id=sandbox)
    if as_json:
        _print_json([dict(r.body) for r in items])
        return
    for r in items:
        b = r.body
        what = " ".join(
            str(x)
            for x in (
                b.get("op"),
                b.get("decision"),
                b.get("reason_code"),
                f"exit={b['exit_code']}" if "exit_code" in b else None,
            )
            if x is not None
        )
        detail = b.get("detail")
        summary = detail.get("summary", "") if isinstance(detail, dict) else ""
        out.print(
            f"{r.seq:>6} {b.get('ts', '')} {r.type:<9} {b.get('sandbox_id') or '-':<16} {what} [dim]{summary}[/dim]"
        )


@receipts_app.command("verify")
def verify(
    log_file: Annotated[Path, typer.Option("--log", help="An exported JSONL log.")],
    trust_root: Annotated[
        Path,
        typer.Option(
            "--trust-root", help="The trust root (from `sandlot keys export-trust-root`)."
        ),
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="A signed checkpoint to check the log against."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify an exported log offline: signatures, chain, order, references, checkpoint."""
    from sandlot.receipts import verify_files

    try:
        result = verify_files(log_file, trust_root, checkpoint)
    except SandboxError as e:
        raise _fail(e.message, 2, as_json) from None
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        (out if result.ok else err).print(result.summary())
    raise typer.Exit(0 if result.ok else 1)


@receipts_app.command("prove")
def prove_cmd(
    seq: Annotated[int, typer.Argument(min=1, help="The receipt's seq.")],
    out_file: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the proof here (default stdout).")
    ] = None,
) -> None:
    """Print an inclusion proof of one receipt in a signed checkpoint."""
    from sandlot.receipts import prove

    with _log() as log:
        proof = prove(log, seq)
    text = json.dumps(proof, indent=2)
    if out_file:
        out_file.write_text(text + "\n")
    else:
        print(text)


@receipts_app.command("verify-proof")
def verify_proof_cmd(
    proof_file: Annotated[
        Path, typer.Option("--proof", help="A proof from `sandlot receipts prove`.")
    ],
    trust_root: Annotated[Path, typer.Option("--trust-root", help="The trust root.")],
    as_json: JsonOpt = False,
) -> None:
    """Check an inclusion proof offline (exit 0 valid, 1 invalid, 2 unreadable)."""
    from sandlot.receipts import TrustRoot, proof_problem

    try:
        proof = json.loads(proof_file.read_text())
        root = TrustRoot.load(trust_root)
    except (OSError, ValueError, SandboxError) as e:
        reason = f"cannot read the proof or trust root: {e}"
        raise _fail(reason, 2, as_json) from None
    problem = proof_problem(proof, root)
    if as_json:
        print(json.dumps({"ok": problem is None, "problem": problem}))
    elif problem is None:
        out.print("proof valid")
    else:
        err.print(f"proof invalid: {problem}")
    raise typer.Exit(0 if problem is None else 1)


@receipts_app.command("checkpoint")
def checkpoint_cmd(
    out_file: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the note here.")
    ] = None,
) -> None:
    """Sign a checkpoint of the log now and print it (C2SP signed note)."""
    with _log() as log:
        note = log.checkpoint()
    if out_file:
        out_file.write_text(note)
    else:
        print(note, end="")


# -- keys -------------------------------------------------------------------------------------


@keys_app.command("export-trust-root")
def export_trust_root(
    out_file: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write it here (default stdout).")
    ] = None,
) -> None:
    """Print the public keys a verifier should trust for this log."""
    with _log() as log:
        root = log.export_trust_root()
    if out_file:
        root.write(out_file)
    else:
        print(root.dumps())


@keys_app.command("rotate")
def rotate(as_json: JsonOpt = False) -> None:
    """Make a new signing key; the log records the change signed by both keys."""
    from sandlot.wiring import signing_keys

    keys = signing_keys(_effective_settings().home)
    with _log(as_json) as log:
        new = keys.generate()
        receipt = log.rotate(new)
        keys.activate(new.key_id)
    if as_json:
        _print_json({"key_id": new.key_id, "seq": receipt.seq})
    else:
        out.print(f"new signing key {new.key_id} (rotation receipt {receipt.seq})")


# -- approvals -----------------------------------------------------------------------------------


@approvals_app.command("list")
def approvals_list(
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Include answered and expired ones.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """List operations waiting for approval."""

    async def body(client: SandlotAPI) -> list[object]:
        return list(await client.list_approvals(status=None if all_ else "pending"))

    items = _run(as_json, body)
    if as_json:
        _print_json([a.to_dict() for a in items])  # type: ignore[attr-defined]
        return
    if not items:
        err.print("nothing waits for approval")
    for a in items:
        d = a.to_dict()  # type: ignore[attr-defined]
        out.print(
            f"{d['id']}  {d['status']:<8} {d['principal']} on {d['sandbox_id']}: {d['summary']}"
        )
        out.print(f"    [yellow]{d['question']}[/yellow]")


def _operator() -> Actor:
    """Who answers from this terminal: an operator, never the agent that asked (an agent
    cannot approve its own held operation)."""
    from sandlot.models import Actor

    return Actor(principal=f"operator:{getpass.getuser()}")


def _answer(approval_id: str, allow: bool, as_json: bool) -> None:
    async def body(client: SandlotAPI) -> object:
        return await (client.approve(approval_id) if allow else client.deny(approval_id))

    result = _run(as_json, body, actor=_operator())
    d = result.to_dict()  # type: ignore[attr-defined]
    if as_json:
        _print_json(d)
    else:
        out.print(f"{d['id']} {d['status']}")


@approvals_app.command("approve")
def approve(
    approval_id: Annotated[str, typer.Argument(help="Approval id.")], as_json: JsonOpt = False
) -> None:
    """Let a held operation run."""
    _answer(approval_id, True, as_json)


@approvals_app.command("deny")
def deny(
    approval_id: Annotated[str, typer.Argument(help="Approval id.")], as_json: JsonOpt = False
) -> None:
    """Refuse a held operation."""
    _answer(approval_id, False, as_json)


# -- policy ---------------------------------------------------------------------------------------


@policy_app.command("explain")
def explain(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox the operation would target.")],
    command: Annotated[
        list[str] | None, typer.Argument(help="For exec: the command (after --).")
    ] = None,
    action: Annotated[
        str, typer.Option("--action", help="The operation (exec, fs.write, destroy, …).")
    ] = "exec",
    path: Annotated[str | None, typer.Option("--path", help="For fs.* actions: the path.")] = None,
    shell: Annotated[
        bool, typer.Option("--shell", "-s", help="Treat the command as one shell string.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Say what the policy would decide about an operation, and which policies matched."""
    args: dict[str, object] = {}
    if command:
        args["command"] = " ".join(command) if shell else command
    if path:
        args["path"] = path
    if action in ("exec", "process.start") and "command" not in args:
        problem = "give the command after --"
        raise _fail(problem, 2, as_json)

    async def body(client: SandlotAPI) -> object:
        handle = await client.get(sandbox_id)
        return await handle.explain(action, **args)

    try:
        explanation = _run(as_json, body)
    except InvalidRequest as e:
        raise _fail(e.message, 2, as_json) from None
    if as_json:
        _print_json(explanation.to_dict())  # type: ignore[attr-defined]
    else:
        print(explanation.render())  # type: ignore[attr-defined]


# -- intents (the journal) --------------------------------------------------------------------

intents_app = typer.Typer(
    help="Operations recorded with idempotency keys: list them, resolve NEEDS_RECONCILE ones.",
    no_args_is_help=True,
)
app.add_typer(intents_app, name="intents")


@contextmanager
def _journal(as_json: bool = False) -> Iterator[Journal]:
    from sandlot.wiring import database_url, open_journal

    try:
        settings = _effective_settings()
        with open_journal(database_url(settings.values.database, settings.home)) as journal:
            yield journal
    except SandboxError as e:
        raise _fail(e.message, 1, as_json) from None


@intents_app.command("list")
def intents_list(
    state: Annotated[
        list[str] | None, typer.Option("--state", help="Only these states (repeatable).")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Recorded operations, newest first (NEEDS_RECONCILE ones wait for an operator)."""
    with _journal(as_json) as journal:
        items = journal.list(states=state or None, limit=limit)
    if as_json:
        _print_json(
            [
                {
                    "intent_id": i.intent_id,
                    "op": i.op,
                    "state": i.state.value,
                    "sandbox_id": i.sandbox_id,
                    "idempotency_key": i.idempotency_key,
                    "error": i.error,
                    "updated_at": i.updated_at.isoformat(),
                }
                for i in items
            ]
        )
        return
    if not items:
        err.print("no recorded operations")
    for i in items:
        out.print(
            f"{i.intent_id[:19]}  {i.state.value:<16} {i.op:<15} {i.sandbox_id or '-':<16} {i.error or ''}"
        )


@intents_app.command("resolve")
def intents_resolve(
    intent_id: Annotated[str, typer.Argument(help="The intent (sha256:…).")],
    cleaned: Annotated[
        bool,
        typer.Option(
            "--cleaned/--failed",
            help="Its resource is gone (cleaned) or never existed / must be forgotten (failed).",
        ),
    ],
    note: Annotated[str, typer.Option("--note", help="What you found on the backend.")],
    as_json: JsonOpt = False,
) -> None:
    """Settle a NEEDS_RECONCILE operation after checking the backend by hand."""
    with _journal(as_json) as journal:
        intent = journal.resolve(intent_id, outcome="CLEANED" if cleaned else "FAILED", note=note)
    if as_json:
        _print_json({"intent_id": intent.intent_id, "state": intent.state.value})
    else:
        out.print(f"{intent.intent_id} {intent.state.value}")
