"""schemathesis against /openapi.json: well over 1,000 generated requests (valid and invalid
inputs), half of them aimed at a real sandbox; the server must never answer 5xx nor hang."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from sandlot.client import Client
from sandlot.server import ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

PER_OPERATION = 50


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generated_requests_never_get_a_server_error(tmp_path: Path) -> None:
    fake = FakeBackend()
    config = ServerConfig(admission_timeout=1, sweep_interval=None)
    with ServerThread(tmp_path, backends={"fake": fake}, config=config) as server:
        key = server.new_key("fuzz")
        with Client(server.url, key) as client:
            real = client.create(start="serve")
            snap = real.snapshot()
        schema = schemathesis.openapi.from_url(
            f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {key}"}
        )
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {key}"
        sent: list[tuple[str, str, int]] = []
        failures: list[str] = []
        rng = random.Random(1234)
        operations = [r.ok() for r in schema.get_all_operations()]
        assert len(operations) >= 25

        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(
                max_examples=PER_OPERATION,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
            )
            def probe(case: schemathesis.Case) -> None:
                # Half the requests name real objects, so the routes' insides run too.
                params = case.path_parameters or {}
                if "sandbox_id" in params and rng.random() < 0.5:
                    params["sandbox_id"] = real.id
                if "snapshot_id" in params and rng.random() < 0.5:
                    params["snapshot_id"] = snap.id
                if isinstance(case.query, dict) and "follow" in case.query:
                    case.query["follow"] = "false"  # an endless stream is correct, not a hang
                try:
                    response = case.call(session=session, timeout=20)
                except requests.Timeout:
                    failures.append(f"{case.method} {case.formatted_path}: no answer in 20s")
                    return
                sent.append((case.method, case.formatted_path, response.status_code))
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
                    )

            probe()
    assert not failures, "\n".join(failures[:20])
    assert len(sent) >= 1000, len(sent)
    statuses = {status for _, _, status in sent}
    assert {200, 404, 422} <= statuses, statuses
