"""The governance commands as a user runs them: receipts, keys, approvals, policy."""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

SANDLOT = [sys.executable, "-m", "sandlot"]


def sandlot(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "200"}
    proc = subprocess.run([*SANDLOT, *args], capture_output=True, text=True, env=env, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_denied_command_names_reason_and_receipt_and_verifies_offline(tmp_path: Path) -> None:
    sid = sandlot("create", check=True).stdout.strip()
    sandlot("exec", sid, "--", "echo", "fine", check=True)
    denied = sandlot("exec", sid, "--", "rm", "-rf", "/")
    assert denied.returncode == 1
    assert "denied:" in denied.stderr
    assert "receipt sha256:" in denied.stderr

    log, root = tmp_path / "log.jsonl", tmp_path / "root.json"
    sandlot("receipts", "export", "--out", str(log), check=True)
    sandlot("keys", "export-trust-root", "--out", str(root), check=True)
    checkpoint = Path(str(log) + ".checkpoint")
    ok = sandlot(
        "receipts",
        "verify",
        "--log",
        str(log),
        "--trust-root",
        str(root),
        "--checkpoint",
        str(checkpoint),
        "--json",
    )
    assert ok.returncode == 0, ok.stdout
    assert json.loads(ok.stdout)["ok"] is True

    # Turn the DENY into an ALLOW inside the signed payload: verification must fail, naming it.
    lines = log.read_text().splitlines()
    index = next(
        i
        for i, line in enumerate(lines)
        if "DENY" in base64.b64decode(json.loads(line)["payload"]).decode()
    )
    envelope = json.loads(lines[index])
    payload = base64.b64decode(envelope["payload"]).decode().replace('"DENY"', '"ALLOW"')
    envelope["payload"] = base64.b64encode(payload.encode()).decode()
    lines[index] = json.dumps(envelope, separators=(",", ":"))
    log.write_text("\n".join(lines) + "\n")
    bad = sandlot("receipts", "verify", "--log", str(log), "--trust-root", str(root), "--json")
    assert bad.returncode == 1
    failure = json.loads(bad.stdout)["failure"]
    assert failure["seq"] == index + 1

    missing = sandlot(
        "receipts", "verify", "--log", str(tmp_path / "nope"), "--trust-root", str(root)
    )
    assert missing.returncode == 2


def test_prove_and_verify_proof(tmp_path: Path) -> None:
    sid = sandlot("create", check=True).stdout.strip()
    sandlot("exec", sid, "--", "true", check=True)
    proof, root = tmp_path / "p.json", tmp_path / "root.json"
    sandlot("receipts", "prove", "2", "--out", str(proof), check=True)
    sandlot("keys", "export-trust-root", "--out", str(root), check=True)
    assert (
        sandlot(
            "receipts", "verify-proof", "--proof", str(proof), "--trust-root", str(root)
        ).returncode
        == 0
    )
    data = json.loads(proof.read_text())
    data["tree_size"] = int(data["tree_size"]) + 1
    proof.write_text(json.dumps(data))
    assert (
        sandlot(
            "receipts", "verify-proof", "--proof", str(proof), "--trust-root", str(root)
        ).returncode
        == 1
    )


def test_tail_approvals_explain_and_rotation() -> None:
    sid = sandlot("create", check=True).stdout.strip()
    tail = json.loads(sandlot("receipts", "tail", "-n", "2", "--json", check=True).stdout)
    assert [r["type"] for r in tail] == ["decision", "execution"]
    assert json.loads(sandlot("approvals", "list", "--json", check=True).stdout) == []
    explained = json.loads(
        sandlot("policy", "explain", sid, "--json", "--", "rm", "-rf", "/").stdout
    )
    assert explained["decision"]["outcome"] == "DENY"
    rotated = json.loads(sandlot("keys", "rotate", "--json", check=True).stdout)
    assert rotated["key_id"].startswith("ed25519:")
    sandlot("exec", sid, "--", "true", check=True)
    root = json.loads(sandlot("keys", "export-trust-root", check=True).stdout)
    assert len(root["keys"]) == 2


def test_a_held_exec_says_how_to_approve_it_at_once(tmp_path: Path) -> None:
    """Issue 13 item 8: a held command printed nothing for up to 300 s."""
    import select
    import time

    hold = Path(__file__).parents[2] / "docs" / "policies" / "hold-undecidable.cedar"
    env = {
        **os.environ,
        "SANDLOT_BACKEND": "fake",
        "SANDLOT_POLICY": f"default:{hold}",
        "COLUMNS": "200",
    }
    run = functools.partial(subprocess.run, capture_output=True, text=True, env=env, timeout=60)
    sid = run([*SANDLOT, "create"]).stdout.strip()
    started = time.monotonic()
    proc = subprocess.Popen(
        [*SANDLOT, "exec", sid, "--shell", "--", "echo $HOME"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        ready, _, _ = select.select([proc.stderr], [], [], 20)
        assert ready, "nothing on stderr while held"
        line = proc.stderr.readline()
        assert line.startswith("held for approval appr-"), line
        assert time.monotonic() - started < 20
        approval = line.split()[3].rstrip(":")
        assert f"sandlot approvals approve {approval}" in line + proc.stderr.readline()
        approved = run([*SANDLOT, "approvals", "approve", approval])
        assert approved.returncode == 0, approved.stderr
        proc.communicate(timeout=30)
        assert proc.returncode == 0, "the approved command ran"
    finally:
        proc.kill()
