"""Limits a tenant meets on a real server (in a thread, on the fake backend the operator
enabled): what a request may carry, which backends it may pick, how many programs and uploads
it may run at once."""

from __future__ import annotations

import base64
import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from sandlot.client import Client
from sandlot.errors import QuotaExceeded
from sandlot.server import Quota, ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

T = TypeVar("T")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _raw_request(port: int, head: str, body: bytes) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request byte for byte; the status and the response."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        response = b""
        while chunk := s.recv(65536):
            response += chunk
    status = int(response.split(b" ", 2)[1])
    return status, response


def test_a_digest_sent_as_a_trailer_is_refused_not_ignored(tmp_path: Path) -> None:
    fake = FakeBackend()
    config = ServerConfig(sweep_interval=None)
    with ServerThread(tmp_path, backends={"fake": fake}, config=config) as server:
        key = server.new_key("trailers")
        with Client(server.url, key) as client:
            sb = client.create()
        wrong = "sha-256=:" + base64.b64encode(hashlib.sha256(b"other").digest()).decode() + ":"
        data = b"hello trailer"
        body = b"%x\r\n%s\r\n0\r\nContent-Digest: %s\r\n\r\n" % (len(data), data, wrong.encode())
        head = (
            f"PUT /v1/sandboxes/{sb.id}/files/content?path=/workspace/t HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {key}\r\n"
            "Content-Type: application/octet-stream\r\n"
            "Transfer-Encoding: chunked\r\n"
            "Trailer: Content-Digest\r\n"
            "Connection: close\r\n\r\n"
        )
        status, response = _raw_request(server.port, head, body)
        assert status == 422, response
        assert b"as a header" in response, response
        with Client(server.url, key) as client:
            names = [f.path for f in client.get(sb.id).list_files("/workspace")]
        assert "/workspace/t" not in names, "nothing was written"


def test_the_fake_backend_is_offered_only_when_the_operator_enables_it(tmp_path: Path) -> None:
    # No backends handed in: the server offers what the registry builds, fake not among them.
    with ServerThread(tmp_path / "off", backend="local") as server:
        key = server.new_key("picky")
        with httpx.Client(base_url=server.url, headers=_auth(key)) as http:
            r = http.post("/v1/sandboxes", json={"spec": {}, "backend": "fake"})
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert "'fake' is not enabled" in detail
            assert "enabled backends: local" in detail
            assert http.get("/v1/sandboxes").json() == [], "nothing was made"
        assert "fake" not in httpx.get(f"{server.url}/version").json()["backends"]
    config = ServerConfig(sweep_interval=None, enable_backends=frozenset({"fake"}))
    with ServerThread(tmp_path / "on", backend="local", config=config) as server:
        key = server.new_key("picky")
        with Client(server.url, key) as client:
            sb = client.create(backend="fake")
            assert sb.exec("echo on").stdout == "on\n"
            sb.destroy()
        assert "fake" in httpx.get(f"{server.url}/version").json()["backends"]


def test_background_processes_and_terminals_hold_exec_slots(tmp_path: Path) -> None:
    config = ServerConfig(
        quota=Quota(max_concurrent_execs=2), admission_timeout=0.5, sweep_interval=None
    )
    with ServerThread(tmp_path, backends={"fake": FakeBackend()}, config=config) as server:
        key = server.new_key("busy")
        with Client(server.url, key) as client:
            sb = client.create()
            first = sb.start_process(["sleep", "1000"])
            sb.start_process(["sleep", "1000"])
            with pytest.raises(QuotaExceeded, match="limit of 2 concurrent execs"):
                sb.start_process(["sleep", "1000"])
            with pytest.raises(QuotaExceeded):
                sb.exec("echo over")
            with pytest.raises(QuotaExceeded):
                sb.open_pty(["sh"])
            running = [p for p in sb.list_processes() if p.running and p.command[0] == "sleep"]
            assert len(running) == 2, "the refused start started nothing"

            # An exit frees its slot: a terminal takes it, and holds it while open.
            sb.signal_process(first.id, 9)
            term = _eventually(lambda: sb.open_pty(["sh"]))
            with pytest.raises(QuotaExceeded):
                sb.start_process(["sleep", "1000"])
            term.close()
            _eventually(lambda: sb.start_process(["sleep", "1000"]))

            # Destroying the sandbox ends its processes, and with them their slots.
            sb.destroy()
            other = client.create()
            assert _eventually(lambda: other.exec("echo freed")).stdout == "freed\n"


def _eventually(call: Callable[[], T], within: float = 10.0) -> T:
    """``call()`` once a slot frees (slots come back asynchronously, as programs end)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return call()
        except QuotaExceeded:
            if time.monotonic() > deadline:
                raise


def test_concurrent_uploads_are_capped_per_tenant_and_in_all(tmp_path: Path) -> None:
    config = ServerConfig(
        quota=Quota(max_concurrent_uploads=1),
        max_concurrent_uploads=2,
        admission_timeout=0.5,
        sweep_interval=None,
    )
    with ServerThread(tmp_path, backends={"fake": FakeBackend()}, config=config) as server:
        keys = {t: server.new_key(t) for t in ("a", "b", "c")}
        sandboxes = {}
        for tenant, key in keys.items():
            with Client(server.url, key) as client:
                sandboxes[tenant] = client.create().id
        go_on = threading.Event()
        results: dict[str, int] = {}

        def stalled_upload(tenant: str) -> threading.Thread:
            sent_first = threading.Event()

            def body() -> Iterator[bytes]:
                yield b"first part, "
                sent_first.set()
                go_on.wait(30)
                yield b"then the rest"

            def run() -> None:
                with httpx.Client(base_url=server.url, headers=_auth(keys[tenant])) as http:
                    r = http.put(
                        f"/v1/sandboxes/{sandboxes[tenant]}/files/content",
                        params={"path": "/workspace/slow"},
                        content=body(),
                    )
                    results[tenant] = r.status_code

            thread = threading.Thread(target=run)
            thread.start()
            assert sent_first.wait(10)
            return thread

        def upload(tenant: str) -> httpx.Response:
            with httpx.Client(base_url=server.url, headers=_auth(keys[tenant])) as http:
                return http.put(
                    f"/v1/sandboxes/{sandboxes[tenant]}/files/content",
                    params={"path": "/workspace/quick"},
                    content=b"quick",
                )

        def refused(tenant: str) -> httpx.Response:
            # Until the stalled upload holds its slot (the server admits in arrival order).
            deadline = time.monotonic() + 10
            while (r := upload(tenant)).status_code != 429 and time.monotonic() < deadline:
                time.sleep(0.1)
            return r

        slow = [stalled_upload("a")]
        try:
            own = refused("a")
            assert own.status_code == 429, own.text
            assert "tenant 'a' stayed at its limit of 1 concurrent uploads" in own.json()["detail"]
            slow.append(stalled_upload("b"))
            full = refused("c")
            assert full.status_code == 429, full.text
            assert (
                "this server stayed at its limit of 2 concurrent uploads" in full.json()["detail"]
            )
        finally:
            go_on.set()
            for thread in slow:
                thread.join(30)
        assert results == {"a": 200, "b": 200}
        # Finished uploads give their slots back.
        for tenant in keys:
            assert upload(tenant).status_code == 200


def test_a_process_input_is_capped_like_an_upload(tmp_path: Path) -> None:
    """A process's standard input is held in memory until written: it meets the one upload
    limit, refused with 413 before it is read when its length is declared, and named alike."""
    limit = 1 << 20
    config = ServerConfig(sweep_interval=None, max_upload_bytes=limit)
    with ServerThread(tmp_path, backends={"fake": FakeBackend()}, config=config) as server:
        key = server.new_key("acme")
        with Client(server.url, key) as client:
            sb = client.create()
            proc = sb.start_process("cat", name="cat")
        url = f"/v1/sandboxes/{sb.id}/processes/{proc.id}/stdin"
        over = b"i" * (limit + 100_000)  # within the JSON allowance, over the content limit

        def chunked() -> Iterator[bytes]:
            yield over[: limit // 2]
            yield over[limit // 2 :]

        with httpx.Client(base_url=server.url, headers=_auth(key), timeout=30) as http:
            declared = http.put(url, content=over)
            streamed = http.put(url, content=chunked())
            for r in (declared, streamed):
                assert r.status_code == 413, r.text
                assert r.json()["details"]["limit"] == limit
                assert r.json()["detail"].startswith("the input")
                assert f"upload limit of {limit} bytes" in r.json()["detail"]
            assert f"({len(over)} bytes)" in declared.json()["detail"]
            assert http.put(url, content=b"i" * limit).status_code == 204


def test_json_files_and_process_input_count_as_uploads(tmp_path: Path) -> None:
    """Both hold their body in memory, so a tenant at its concurrent uploads waits (then 429)
    for them as for a streamed upload, and gets its slot back after each."""
    config = ServerConfig(
        quota=Quota(max_concurrent_uploads=1), admission_timeout=0.5, sweep_interval=None
    )
    with ServerThread(tmp_path, backends={"fake": FakeBackend()}, config=config) as server:
        key = server.new_key("acme")
        with Client(server.url, key) as client:
            sb = client.create()
            proc = sb.start_process("cat", name="cat")
        files = {"files": [{"path": "/workspace/j", "content": base64.b64encode(b"j").decode()}]}
        stdin = f"/v1/sandboxes/{sb.id}/processes/{proc.id}/stdin"
        go_on = threading.Event()
        sent_first = threading.Event()
        stalled: dict[str, int] = {}

        def body() -> Iterator[bytes]:
            yield b"first part, "
            sent_first.set()
            go_on.wait(30)
            yield b"then the rest"

        def stall() -> None:
            with httpx.Client(base_url=server.url, headers=_auth(key), timeout=30) as http:
                r = http.put(
                    f"/v1/sandboxes/{sb.id}/files/content",
                    params={"path": "/workspace/slow"},
                    content=body(),
                )
                stalled["status"] = r.status_code

        thread = threading.Thread(target=stall)
        thread.start()
        try:
            assert sent_first.wait(10)
            with httpx.Client(base_url=server.url, headers=_auth(key), timeout=30) as http:
                # Until the stalled upload holds its slot (the server admits in arrival order).
                deadline = time.monotonic() + 10
                while (
                    refused_json := http.post(f"/v1/sandboxes/{sb.id}/files", json=files)
                ).status_code != 429 and time.monotonic() < deadline:
                    time.sleep(0.1)
                refused_input = http.put(stdin, content=b"in")
                for r in (refused_json, refused_input):
                    assert r.status_code == 429, r.text
                    assert "stayed at its limit of 1 concurrent uploads" in r.json()["detail"]
        finally:
            go_on.set()
            thread.join(30)
        assert stalled == {"status": 200}
        with httpx.Client(base_url=server.url, headers=_auth(key), timeout=30) as http:
            assert http.post(f"/v1/sandboxes/{sb.id}/files", json=files).status_code == 200
            assert http.put(stdin, content=b"in").status_code == 204
            assert http.put(stdin, content=b"more").status_code == 204
