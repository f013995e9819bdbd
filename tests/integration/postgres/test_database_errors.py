"""A real PostgreSQL server asked for a database or a role it does not have: one line naming
the fix, from the store and from the CLI, exit code 1 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from sandlot.errors import InvalidRequest
from sandlot.store.sql import SqlStore

pytestmark = pytest.mark.needs_postgres


def sandlot(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "sandlot", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_an_unknown_database_names_createdb(pg_url: str) -> None:
    server = make_url(pg_url)
    host, port = server.host, server.port or 5432
    url = server.set(database="sandlot_no_such_db").render_as_string(hide_password=False)
    message = (
        f"PostgreSQL at {host}:{port} has no database 'sandlot_no_such_db'; create it "
        f"(createdb -h {host} -p {port} sandlot_no_such_db) or name another in the URL"
    )
    with pytest.raises(InvalidRequest) as caught:
        SqlStore(url).ensure_schema()
    assert caught.value.message == message
    proc = sandlot("--database", url, "list")
    assert (proc.returncode, proc.stderr) == (1, f"error: {message}\n")
    proc = sandlot("--database", url, "list", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"] == {
        "code": "invalid_request",
        "message": message,
        "details": {},
    }


def test_an_unknown_role_is_one_line_without_the_password(pg_url: str) -> None:
    server = make_url(pg_url)
    where = f"{server.host}:{server.port or 5432}"
    url = server.set(username="sandlot_no_such_role", password="hunter2").render_as_string(
        hide_password=False
    )
    proc = sandlot("--database", url, "list")
    assert (proc.returncode, proc.stderr) == (
        1,
        f"error: PostgreSQL at {where} has no role 'sandlot_no_such_role'; "
        "create it or name another user in the URL\n",
    )
    doctor = sandlot("--database", url, "doctor", "--json")
    assert doctor.returncode == 1
    assert "hunter2" not in doctor.stdout + doctor.stderr
    (check,) = [
        c for c in json.loads(doctor.stdout)["checks"]["general"] if c["name"] == "database"
    ]
    assert check["ok"] is False
    assert "has no role 'sandlot_no_such_role'" in check["detail"]


def test_a_reachable_database_passes_the_doctor(pg_url: str) -> None:
    doctor = sandlot("--database", pg_url, "doctor", "--json")
    (check,) = [
        c for c in json.loads(doctor.stdout)["checks"]["general"] if c["name"] == "database"
    ]
    assert (check["ok"], check["detail"]) == (True, pg_url)
