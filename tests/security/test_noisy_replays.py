"""Noisy neighbour: tenant B repeats one long exec under one idempotency key, 45 times at once.

Each repeat waits for the first call's outcome. Waiting must not hold one of the server's
worker threads: 40 of them were the whole pool, and tenant A's requests (whose API-key check
and store reads need a thread) then got no answer at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.security.noisy import NoisyServer, Victim, assert_unharmed, attack

pytestmark = pytest.mark.slow  # a real server, and the attack's exec runs 40 s


def test_concurrent_replays_of_a_long_exec_leave_the_victim_alone(tmp_path: Path) -> None:
    with NoisyServer(tmp_path) as server:
        victim = Victim(server, rounds=20)
        base = victim.measure()
        b = server.client(server.key_b)
        made = b.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        answers: list[int] = []

        def step() -> None:
            r = b.post(
                f"/v1/sandboxes/{sid}/exec",
                json={"command": "sleep 40"},
                headers={"Idempotency-Key": "k1"},
            )
            answers.append(r.status_code)

        with attack(step, workers=45) as errors:
            loaded = victim.measure()
        victim.close()
        b.close()
        print(f"victim baseline {base}; under 45 replays {loaded}")
        assert_unharmed(base, loaded)
        # Every repeat waited for the one run and got its result.
        assert not errors, errors[:3]
        assert answers, "no repeat finished"
        assert set(answers) == {200}, sorted(set(answers))
