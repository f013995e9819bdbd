"""A server enforces time to live for API-key tenants (issue 13 item 1).

Before, the sweep acted as the ``default`` tenant, the default policy's tenant boundary denied
every stop of another tenant's sandbox, and the failure was only a log line: an expired sandbox
of tenant ``acme`` ran for good while ``/v1/stop-expired`` answered ``{"stopped": []}``.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from sandlot.client import Client
from sandlot.models import SandboxStatus
from sandlot.server import ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend


def test_a_tenants_sandbox_stops_when_its_ttl_runs_out(tmp_path: Path) -> None:
    fake = FakeBackend()
    config = ServerConfig(sweep_interval=0.2)
    with ServerThread(tmp_path / "srv", backends={"fake": fake}, config=config) as server:
        key = server.new_key("acme")
        with Client(server.url, key) as acme:
            sb = acme.create(timeout=1)
            deadline = time.monotonic() + 15
            while sb.refresh().status is SandboxStatus.RUNNING and time.monotonic() < deadline:
                time.sleep(0.1)
            info = sb.refresh()
            assert info.status is SandboxStatus.STOPPED
            assert info.death is not None
            assert info.death.cause == "ttl"
            assert fake.sandboxes[f"fake-{sb.id}"].state == "stopped"


def test_stop_expired_reports_what_it_could_not_stop(tmp_path: Path) -> None:
    fake = FakeBackend()
    config = ServerConfig(sweep_interval=None)
    with ServerThread(tmp_path / "srv", backends={"fake": fake}, config=config) as server:
        key = server.new_key("acme")
        admin = server.new_key("ops", admin=True)
        with Client(server.url, key) as acme:
            stuck = acme.create(timeout=1)
            fine = acme.create(timeout=1)
            time.sleep(1.2)
            fake.fail_next("stop")  # the first stop of the sweep fails
            r = httpx.post(
                f"{server.url}/v1/stop-expired", headers={"Authorization": f"Bearer {admin}"}
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["stopped"]) == 1
            assert len(body["errors"]) == 1
            (failed_id,) = body["errors"]
            assert {failed_id, *body["stopped"]} == {stuck.id, fine.id}
            assert "injected failure in stop" in body["errors"][failed_id]
            # The one whose stop failed is failed now, with why, its processes still running;
            # the next sweep stops them (its files stay).
            info = acme.get(failed_id).info
            assert info.status is SandboxStatus.FAILED
            assert "injected failure in stop" in (info.error or "")
            with Client(server.url, admin) as ops:
                again = ops.stop_expired()
            assert (again.expired, again.errors) == ([failed_id], {})
            assert fake.sandboxes[f"fake-{failed_id}"].state == "stopped"


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "with-setup-output"])
def test_an_interrupted_remote_create_leaves_nothing(tmp_path: Path, streamed: bool) -> None:
    """Ctrl-C in a client while the server creates: a plain create is finished by the server
    (it never leaves a transition half done), which sees its client gone and destroys it; a
    streamed one is cancelled on the server, which destroys what it had made."""
    import anyio

    from sandlot.client import AsyncClient
    from sandlot.models import ExecResult
    from sandlot.testing import FakeExec

    fake = FakeBackend()

    async def slow(req: FakeExec) -> ExecResult | None:
        if req.argv[-1] == "slow setup":
            await anyio.sleep(1.5)
            return ExecResult(exit_code=0, stdout="set up\n")
        return None

    fake.exec_handler = slow
    config = ServerConfig(sweep_interval=None)
    with ServerThread(tmp_path / "srv", backends={"fake": fake}, config=config) as server:
        key = server.new_key("acme")

        async def interrupted() -> None:
            async with AsyncClient(server.url, api_key=key) as client:
                with anyio.move_on_after(0.5) as scope:
                    await client.create(
                        setup="slow setup", on_setup_output=(lambda c: None) if streamed else None
                    )
                assert scope.cancelled_caught
                with anyio.fail_after(15):
                    while True:
                        (info,) = await client.list(include_destroyed=True)
                        if info.status is SandboxStatus.DESTROYED:
                            break
                        await anyio.sleep(0.1)
                assert await client.list() == []

        anyio.run(interrupted)
        assert fake.sandboxes == {}
