"""The HTTP client is thin: importing it loads no server, Manager, store, journal, gate,
policy engine, receipts or backend, nor SQLAlchemy, cryptography or a web framework."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Modules (and their submodules) that a process which only talks HTTP must never load.
_HEAVY = (
    "sandlot.server",
    "sandlot.manager",
    "sandlot.sdk",
    "sandlot.sync",
    "sandlot.store",
    "sandlot.journal",
    "sandlot.gate",
    "sandlot.policy",
    "sandlot.receipts",
    "sandlot.backends",
    "sandlot.channel",
    "sandlot.network",
    "sandlot.mcp",
    "sandlot.cli",
    "sqlalchemy",
    "alembic",
    "cryptography",
    "nacl",
    "cedarpy",
    "fastapi",
    "starlette",
    "uvicorn",
    "mcp",
)


def _loaded_after(statement: str) -> list[str]:
    probe = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return list(json.loads(out))


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in _HEAVY)]


@pytest.mark.parametrize(
    "statement",
    [
        "import sandlot.client",
        "from sandlot.client import AsyncClient, Client, AsyncRemoteSandbox",
        "from sandlot import AsyncSandbox, Sandbox, ExecResult, SandboxSpec",
        "import sandlot.api, sandlot.handle, sandlot.wire",
        # Building clients (nothing listens there; nothing is sent) imports nothing more.
        "from sandlot.client import AsyncClient, Client\n"
        "Client('http://127.0.0.1:9').close()\n"
        "AsyncClient('http://127.0.0.1:9')",
    ],
)
def test_the_client_imports_nothing_of_the_server(statement: str) -> None:
    assert _heavy(_loaded_after(statement)) == []


def test_the_probe_sees_a_heavy_import() -> None:
    # The in-process SDK does load the Manager and the store: the check above can fail.
    heavy = _heavy(_loaded_after("import sandlot.sdk"))
    assert "sandlot.manager" in heavy
    assert "sqlalchemy" in heavy
