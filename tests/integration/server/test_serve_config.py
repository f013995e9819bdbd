"""``sandlot serve`` takes its settings from sandlot.toml, and a flag still wins over it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sandlot.client import Client

SANDLOT = [sys.executable, "-m", "sandlot"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*SANDLOT, *args, "serve"],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_up(proc: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "sandlot serve did not come up"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode in (0, 130), err
    return err


def test_serve_listens_where_the_file_says_with_its_limits(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    port = _free_port()
    (home / "sandlot.toml").write_text(
        'backend = "fake"\n'
        "[server]\n"
        f"port = {port}\n"
        'enable_backends = ["fake"]\n'
        "public_docs = true\n"
        "max_sandboxes = 1\n"
    )
    env = {"SANDLOT_HOME": str(home)}
    made = subprocess.run(
        [*SANDLOT, "api-keys", "create", "--tenant", "t"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
        check=True,
    )
    key = made.stdout.strip()
    proc = _serve([], env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        assert httpx.get(f"{url}/version").json()["default_backend"] == "fake"
        assert httpx.get(f"{url}/openapi.json").status_code == 200  # public_docs = true
        with Client(url, key) as client:
            sb = client.create()
            # max_sandboxes = 1: a second live sandbox is over the tenant's quota.
            second = httpx.post(
                f"{url}/v1/sandboxes",
                json={},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            assert second.status_code == 429, second.text
            sb.destroy()
    finally:
        err = _stop(proc)
    assert f"serving http://127.0.0.1:{port}" in err


def test_a_port_flag_wins_over_the_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    file_port, flag_port = _free_port(), _free_port()
    config = tmp_path / "elsewhere.toml"
    config.write_text(
        f'backend = "fake"\n[server]\nport = {file_port}\nenable_backends = ["fake"]\n'
    )
    env = {"SANDLOT_HOME": str(home), "SANDLOT_CONFIG": str(config)}
    proc = subprocess.Popen(
        [*SANDLOT, "serve", "--port", str(flag_port)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_up(proc, f"http://127.0.0.1:{flag_port}")
    finally:
        err = _stop(proc)
    assert f"serving http://127.0.0.1:{flag_port}" in err
