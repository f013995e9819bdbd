"""Noisy neighbour: tenant B floods exec and explain with the largest commands the gate reads.

Issue 23: a 781 KiB ``true && true && …`` in one request kept the server's event loop busy for
seconds normalizing it, so tenant A's exec p99 went to 19 s (``/healthz`` stalled too). Now an
oversized command is refused by name before it is read, and reading one of the largest allowed
ones runs off the event loop, one at a time, in a server tuned to hand the event loop the
interpreter lock quickly (``sandlot.gate.offload``).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from sandlot.policy.limits import MAX_ARG_BYTES, MAX_COMMANDS

from .noisy import NoisyServer, Victim, assert_unharmed, attack

# The most work a command the gate accepts can ask for: MAX_COMMANDS simple commands, each
# with a word, about MAX_ARG_BYTES in all.
WORD = "x" * (MAX_ARG_BYTES // MAX_COMMANDS - len("true  && "))
LARGEST = " && ".join([f"true {WORD}"] * (MAX_COMMANDS - 1))
# The most reading a refused one costs: MAX_ARG_BYTES of one-letter commands, refused by
# MAX_COMMANDS only once read.
MOST_COMMANDS = ";".join(["a"] * (MAX_ARG_BYTES // 2))
ISSUE_23 = " && ".join(["true"] * 200_000)
JSON = {"content-type": "application/json"}


def _refused(r: httpx.Response, limit: str) -> None:
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_request", r.text
    assert limit in r.text, r.text


def test_largest_commands_on_exec_and_explain_leave_the_victim_unharmed(tmp_path: Path) -> None:
    assert len(LARGEST.encode()) <= MAX_ARG_BYTES
    with NoisyServer(tmp_path) as server:
        victim = Victim(server, rounds=20)
        base = victim.measure()
        b = server.client(server.key_b)
        made = b.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}})
        assert made.status_code in (200, 201), made.text
        sid = made.json()["id"]
        ran = b.post(f"/v1/sandboxes/{sid}/exec", json={"command": LARGEST})
        assert ran.status_code == 200, ran.text
        assert ran.json()["exit_code"] == 0, ran.text
        _refused(b.post(f"/v1/sandboxes/{sid}/exec", json={"command": ISSUE_23}), "MAX_ARG_BYTES")

        # Encoded once: the attacker's threads share this process's interpreter lock with
        # the victim's client, and encoding 781 KiB of JSON per request there slowed the
        # victim's own measurement (it showed as a server stall that was not one).
        requests = [
            (path, json.dumps(body).encode())
            for command in (LARGEST, MOST_COMMANDS, ISSUE_23)
            for path, body in (
                ("explain", {"action": "exec", "args": {"command": command}}),
                ("exec", {"command": command}),
            )
        ]

        def step() -> None:
            for path, content in requests:
                b.post(f"/v1/sandboxes/{sid}/{path}", content=content, headers=JSON)

        try:
            with attack(step, workers=2) as errors:
                loaded = victim.measure()
                health = httpx.get(f"{server.url}/healthz", timeout=5)
            assert health.status_code == 200
            assert not errors, errors[:3]
        finally:
            victim.close()
            b.close()
        print(f"baseline {base}\nunder attack {loaded}")
        assert_unharmed(base, loaded)
