"""No credential reaches the server's log: keys sent in every way a client might send one (the
header, a query string, a terminal's WebSocket, MCP), valid, revoked or made up, are not in
what ``sandlot serve`` writes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from sandlot.client import Client
from sandlot.sdk import database_url
from sandlot.server.keys import ApiKeyStore

SANDLOT = [sys.executable, "-m", "sandlot"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keys(home: Path) -> tuple[str, str, str]:
    """A valid key, a revoked one, and one that was never made."""

    async def make() -> tuple[str, str, str]:
        store = ApiKeyStore(database_url(None, home))
        try:
            valid = await store.create("logged")
            revoked = await store.create("logged")
            await store.revoke(revoked.info.id)
        finally:
            await store.aclose()
        return valid.key, revoked.key, "sandlot_" + "M" * 43

    return anyio.run(make)


def _use(url: str, key: str, sandbox_id: str) -> None:
    """Send ``key`` every way a client might, right or wrong."""
    ws = url.replace("http://", "ws://")
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=30) as http:
        http.get("/v1/sandboxes", headers=auth)
        for name in ("key", "api_key", "token", "access_token"):
            http.get(f"/v1/sandboxes?{name}={key}")
        http.get(f"/v1/sandboxes/{sandbox_id}?api_key={key}&x=1", headers=auth)
        http.get(f"/openapi.json?token={key}")
        http.get("/healthz", params={"api_key": key})
        http.get(f"/no/such/route/{key}")
        http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=auth)
        http.post(f"/mcp?key={key}", json={})
    terminal = f"{ws}/v1/sandboxes/{sandbox_id}/pty"
    for target, headers in (
        (terminal, auth),
        (f"{terminal}?token={key}", auth),
        (f"{terminal}?env=SECRET={key}", auth),
        (f"{terminal}?api_key={key}", {}),
    ):
        try:
            with ws_connect(target, additional_headers=headers, open_timeout=10) as conn:
                conn.recv(timeout=10)
        except InvalidStatus:
            pass  # refused: still logged


def test_no_key_reaches_the_server_log(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    valid, revoked, unknown = _keys(home)
    env = {**os.environ, "SANDLOT_HOME": str(home), "SANDLOT_BACKEND": "fake"}
    env.pop("SANDLOT_URL", None)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*SANDLOT, "serve", "--port", str(port), "--enable-backend", "fake"],
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "sandlot serve did not come up"
                time.sleep(0.1)
            with Client(url, valid) as client:
                sandbox_id = client.create().id
            for key in (valid, revoked, unknown):
                _use(url, key, sandbox_id)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    # The log did record those requests (so the absence below means something) ...
    assert "/v1/sandboxes?api_key=[redacted]" in text, text
    assert "WebSocket /v1/sandboxes/" in text, text
    # ... and no key, nor a long enough piece of one to matter, is in it.
    for key in (valid, revoked, unknown):
        secret = key.removeprefix("sandlot_")
        for start in range(6, len(secret) - 12, 4):
            assert secret[start : start + 12] not in text, (key, text)


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ('"GET /v1/x?api_key=sandlot_abcdefSECRETSECRET HTTP/1.1" 401', "api_key=[redacted]"),
        ("{'authorization': 'Bearer sandlot_abcdefSECRETSECRET'}", "Bearer [redacted]"),
        ("(b'authorization', b'Basic SECRETSECRET')", "Basic [redacted]"),
        ("GET /pty?env=TOKEN%3DSECRETSECRET&rows=5", "env=TOKEN%3D[redacted]&rows=5"),
        ("key sandlot_abcdefSECRETSECRET seen", "sandlot_abcdef...[redacted] seen"),
    ],
)
def test_redaction_leaves_enough_to_read(line: str, kept: str) -> None:
    from sandlot.server.redact import redact

    once = redact(line)
    assert "SECRET" not in once
    assert kept in once
    assert redact(once) == once  # a record filtered twice reads the same
