"""A held operation through a server: the client hears of the hold at once (issue 13 item 8),
not after waiting out the approval timeout in silence."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sandlot.client import Client
from sandlot.gate.gate import Approval
from sandlot.server import ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

HOLD = Path(__file__).parents[3] / "docs" / "policies" / "hold-undecidable.cedar"


@pytest.mark.parametrize("durable", [False, True], ids=["memory-output", "database-output"])
def test_a_held_exec_tells_its_client_the_approval_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    monkeypatch.setenv("SANDLOT_POLICY", f"default:{HOLD}")
    config = ServerConfig(sweep_interval=None)
    backends = {"fake": FakeBackend()}
    with ServerThread(
        tmp_path / "srv", backends=backends, config=config, durable_output=durable
    ) as srv:
        agent_key = srv.new_key("acme", "agent")
        reviewer_key = srv.new_key("acme", "reviewer")
        heard: list[Approval] = []
        held = threading.Event()

        def on_hold(approval: Approval) -> None:
            heard.append(approval)
            held.set()

        with (
            Client(srv.url, agent_key, on_hold=on_hold) as agent,
            Client(srv.url, reviewer_key) as reviewer,
        ):
            sb = agent.create()
            results = []
            runner = threading.Thread(
                target=lambda: results.append(sb.exec("echo $HOME", on_stdout=lambda _: None))
            )
            runner.start()
            assert held.wait(15), "the client never heard of the hold"
            (approval,) = heard
            assert approval.status == "pending"
            assert approval.action == "exec"
            assert approval.sandbox_id == sb.id
            assert [a.id for a in reviewer.list_approvals()] == [approval.id]
            reviewer.approve(approval.id)
            runner.join(30)
            assert results
            assert results[0].exit_code == 0
