"""The commands as a user runs them: `sandlot api-keys`, `sandlot serve`, and the ordinary CLI
talking to a server when SANDLOT_URL is set."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sandlot.client import Client
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

SANDLOT = [sys.executable, "-m", "sandlot"]


def sandlot(
    *args: str, env: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*SANDLOT, *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=60
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_api_keys_create_list_revoke(tmp_path: Path) -> None:
    env = {"SANDLOT_HOME": str(tmp_path)}
    made = json.loads(
        sandlot("api-keys", "create", "--tenant", "acme", "--admin", "--json", env=env).stdout
    )
    assert made["key"].startswith("sandlot_")
    assert (made["tenant"], made["admin"], made["principal"]) == ("acme", True, made["id"])
    plain = sandlot("api-keys", "create", "--tenant", "acme", "--principal", "ci-bot", env=env)
    key_text = plain.stdout.strip()
    assert key_text.startswith("sandlot_")
    assert "not shown again" in plain.stderr
    listed = json.loads(sandlot("api-keys", "list", "--json", env=env).stdout)
    assert [k["principal"] for k in listed] == [made["id"], "ci-bot"]
    assert key_text not in json.dumps(listed)
    assert made["key"] not in json.dumps(listed)
    assert "ci-bot" in sandlot("api-keys", "list", env=env).stdout
    revoked = json.loads(sandlot("api-keys", "revoke", made["id"], "--json", env=env).stdout)
    assert revoked["revoked_at"] is not None
    bad = sandlot("api-keys", "create", "--tenant", "no spaces", env=env, check=False)
    assert bad.returncode == 1
    assert "tenant" in bad.stderr
    assert sandlot("api-keys", "revoke", "ak-000000000000", env=env, check=False).returncode == 1


def test_cli_talks_to_a_server_when_sandlot_url_is_set(tmp_path: Path) -> None:
    with ServerThread(tmp_path / "server", backends={"fake": FakeBackend()}) as server:
        key = server.new_key("cli-tenant")
        env = {
            "SANDLOT_URL": server.url,
            "SANDLOT_API_KEY": key,
            "SANDLOT_HOME": str(tmp_path / "client-home"),
        }
        sid = sandlot("create", "--setup", "echo preparing", env=env).stdout.strip()
        assert sid.startswith("sb-")
        ran = sandlot("exec", sid, "--", "echo", "over http", env=env, check=False)
        assert (ran.returncode, ran.stdout) == (0, "over http\n")
        assert sandlot("exec", sid, "--shell", "--", "exit 7", env=env, check=False).returncode == 7
        piped = subprocess.run(
            [*SANDLOT, "exec", sid, "--", "cat"],
            input="through stdin",
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=60,
        )
        assert piped.stdout == "through stdin"
        sandlot("write-file", sid, "/workspace/f.txt", "-", env=env)
        listed = json.loads(sandlot("list", "--json", env=env).stdout)
        assert [s["id"] for s in listed] == [sid]
        assert listed[0]["tenant"] == "cli-tenant"
        assert (
            json.loads(sandlot("destroy", sid, "--json", env=env).stdout)["status"] == "destroyed"
        )
        denied = sandlot("reconcile", env=env, check=False)
        assert denied.returncode == 1
        assert "admin" in denied.stderr
        # Nothing was made in the client's own home: the server holds the state.
        assert not (tmp_path / "client-home" / "sandlot.db").exists()
        wrong = sandlot("list", env={**env, "SANDLOT_API_KEY": "sandlot_wrong"}, check=False)
        assert wrong.returncode == 1
        assert "API key" in wrong.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sandlot_serve(tmp_path: Path) -> None:
    env = {"SANDLOT_HOME": str(tmp_path), "SANDLOT_BACKEND": "fake"}
    key = sandlot("api-keys", "create", "--tenant", "served", env=env).stdout.strip()
    port = _free_port()
    proc = subprocess.Popen(
        [
            *SANDLOT,
            "serve",
            "--port",
            str(port),
            "--max-sandboxes",
            "5",
            "--enable-backend",
            "fake",
            "--public-docs",
        ],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "sandlot serve did not come up"
            time.sleep(0.1)
        with Client(url, key) as client:
            sb = client.create()
            assert sb.exec("echo served").stdout == "served\n"
            sb.destroy()
        assert httpx.get(f"{url}/version").json()["default_backend"] == "fake"
        assert httpx.get(f"{url}/openapi.json").status_code == 200  # --public-docs
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode in (0, 130), err
    assert f"serving http://127.0.0.1:{port}" in err


def test_sandlot_serve_refuses_a_default_backend_it_would_not_offer(tmp_path: Path) -> None:
    env = {"SANDLOT_HOME": str(tmp_path), "SANDLOT_BACKEND": "fake"}
    proc = sandlot("serve", "--port", str(_free_port()), env=env, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "--enable-backend fake" in " ".join(proc.stderr.split())
