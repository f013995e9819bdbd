"""Idempotent replays over HTTP: a repeat with the same key and request gets the first call's
outcome, whatever else is going on (a full quota, the first call still running, many repeats
at once)."""

from __future__ import annotations

import secrets
from pathlib import Path

import anyio
import httpx

from sandlot.models import ExecResult
from sandlot.server import ServerConfig
from sandlot.server.quotas import Quota
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend, FakeExec


def _http(server: ServerThread, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


async def test_replayed_create_at_quota_returns_the_same_sandbox(tmp_path: Path) -> None:
    config = ServerConfig(
        quota=Quota(max_live_sandboxes=1), admission_timeout=0.5, sweep_interval=None
    )
    with ServerThread(tmp_path, backends={"fake": FakeBackend()}, config=config) as server:
        async with _http(server, server.new_key("small")) as http:
            body = {"spec": {"labels": {"job": "replay"}}}
            first = await http.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "c1"})
            assert first.status_code == 201, first.text
            # The tenant is now at its quota of one; the repeat creates nothing and must get
            # the sandbox the first call made.
            again = await http.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "c1"})
            assert again.status_code == 201, again.text
            assert again.json()["id"] == first.json()["id"]
            # A new key is a new sandbox, which the quota still refuses.
            other = await http.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "c2"})
            assert other.status_code == 429, other.text
            # The same key with another request is a conflict, not a quota refusal.
            changed = {"spec": {"labels": {"job": "other"}}}
            clash = await http.post(
                "/v1/sandboxes", json=changed, headers={"Idempotency-Key": "c1"}
            )
            assert clash.status_code == 409, clash.text


async def test_concurrent_replays_of_a_running_exec_all_get_its_result(tmp_path: Path) -> None:
    runs: list[str] = []

    async def slow(req: FakeExec) -> ExecResult | None:
        if req.argv[:1] != ["slow"]:
            return None
        token = secrets.token_hex(8)
        runs.append(token)
        await anyio.sleep(2)
        return ExecResult(exit_code=0, stdout=f"ran {token}\n")

    fake = FakeBackend(exec_handler=slow)
    # One exec at a time: a repeat runs nothing, so it must not queue behind the first call.
    config = ServerConfig(quota=Quota(max_concurrent_execs=1), sweep_interval=None)
    with ServerThread(tmp_path, backends={"fake": fake}, config=config) as server:
        async with _http(server, server.new_key("replayer")) as http:
            made = await http.post("/v1/sandboxes", json={"spec": {}})
            assert made.status_code == 201, made.text
            url = f"/v1/sandboxes/{made.json()['id']}/exec"
            answers: list[httpx.Response] = []

            async def replay() -> None:
                answers.append(
                    await http.post(
                        url, json={"command": ["slow"]}, headers={"Idempotency-Key": "e1"}
                    )
                )

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for _ in range(45):
                        tg.start_soon(replay)
    assert len(runs) == 1, f"the command ran {len(runs)} times"
    statuses = sorted({(a.status_code, a.text[:200]) for a in answers})
    assert [a.status_code for a in answers] == [200] * 45, statuses
    assert {a.json()["stdout"] for a in answers} == {f"ran {runs[0]}\n"}
    assert len({a.text for a in answers}) == 1, "every replay returns the same ExecResult"
